import numpy as np
import pytest
import torch

from diloco.data import EvalBatches, ShardSampler, load_corpus
from diloco.errors import DilocoError


@pytest.fixture
def positions_file(tmp_path):
    """A token file whose ids are their own positions, so every batch shows where it came from."""
    path = tmp_path / "positions.bin"
    np.arange(40_000, dtype=np.uint32).tofile(path)
    return path


def test_bundled_corpus_is_real_english_bytes():
    corpus = load_corpus()
    assert corpus.vocab_size == 256
    assert len(corpus.train) > 4_000_000
    text = bytes(corpus.train[:200_000]).decode("ascii")
    assert "HAMLET" in bytes(corpus.train).decode("ascii") or "Hamlet" in text
    assert len(corpus.eval) == pytest.approx(0.05 * (len(corpus.train) + len(corpus.eval)), rel=0.01)


def test_token_file_uint16_and_uint32(tmp_path):
    for dtype in ("uint16", "uint32"):
        path = tmp_path / f"tokens-{dtype}.bin"
        np.array([5, 1, 7, 3] * 100, dtype=dtype).tofile(path)
        corpus = load_corpus(str(path), dtype=dtype)
        assert corpus.vocab_size == 8
        assert list(corpus.train[:4]) == [5, 1, 7, 3]


def test_token_file_errors(tmp_path):
    with pytest.raises(DilocoError, match="data file not found"):
        load_corpus(str(tmp_path / "absent.bin"))
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x02\x03")
    with pytest.raises(DilocoError, match="not a whole number of uint16"):
        load_corpus(str(odd), dtype="uint16")
    big = tmp_path / "big.bin"
    np.array([1, 2, 900] * 10, dtype=np.uint16).tofile(big)
    with pytest.raises(DilocoError, match="beyond data.vocab_size"):
        load_corpus(str(big), vocab_size=512)


def _positions_seen(sampler, batches):
    seen = set()
    for _ in range(batches):
        x, y = sampler.next_batch()
        assert torch.equal(x[:, 1:], y[:, :-1])
        seen.update(x.flatten().tolist())
        seen.update(y.flatten().tolist())
    return seen


def test_shards_are_disjoint_and_held_out_split_is_apart(positions_file):
    corpus = load_corpus(str(positions_file), dtype="uint32")
    seen = [_positions_seen(ShardSampler(corpus.train, learner=m, learners=3, seq_len=16, batch_size=8, seed=0), 50)
            for m in range(3)]
    for a in range(3):
        for b in range(a + 1, 3):
            assert not seen[a] & seen[b]
    eval_tokens = {int(t) for x, y in EvalBatches(corpus.eval, seq_len=16, batch_size=4, batches=3)
                   for t in torch.cat([x.flatten(), y.flatten()])}
    assert min(eval_tokens) > max(max(s) for s in seen)


def test_sampling_is_deterministic_and_resumes_exactly(positions_file):
    corpus = load_corpus(str(positions_file), dtype="uint32")

    def sampler(seed=0):
        return ShardSampler(corpus.train, learner=1, learners=2, seq_len=16, batch_size=8, seed=seed)

    a, b = sampler(), sampler()
    for _ in range(5):
        assert torch.equal(a.next_batch()[0], b.next_batch()[0])
    assert not torch.equal(sampler(seed=1).next_batch()[0], sampler(seed=0).next_batch()[0])
    # Run far enough to cross into a second epoch, save the position, resume elsewhere.
    for _ in range(150):
        a.next_batch()
    state = a.state_dict()
    assert state["epoch"] >= 1
    resumed = sampler()
    resumed.load_state_dict(state)
    for _ in range(10):
        assert torch.equal(a.next_batch()[0], resumed.next_batch()[0])


def test_position_of_another_learner_is_refused(positions_file):
    corpus = load_corpus(str(positions_file), dtype="uint32")
    s0 = ShardSampler(corpus.train, learner=0, learners=2, seq_len=16, batch_size=8, seed=0)
    s1 = ShardSampler(corpus.train, learner=1, learners=2, seq_len=16, batch_size=8, seed=0)
    before = s1.state_dict()
    with pytest.raises(DilocoError, match="belongs to learner 0"):
        s1.load_state_dict(s0.state_dict())
    assert s1.state_dict() == before


def test_shard_too_small_is_a_clear_error(tmp_path):
    path = tmp_path / "tiny.bin"
    np.arange(100, dtype=np.uint16).tofile(path)
    corpus = load_corpus(str(path))
    with pytest.raises(DilocoError, match="fewer than one batch"):
        ShardSampler(corpus.train, learner=0, learners=4, seq_len=16, batch_size=8, seed=0)
