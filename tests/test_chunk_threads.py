"""A shard's merge on several threads (`chunk_threads`, `diloco syncer --threads N`): the pieces cover a
tensor once on the loops' block boundaries, run at the same time, fail loudly, and give the values of one
thread bit for bit, from a single loop up to a syncer core's rounds."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import diloco.cache_chunks as cache_chunks
import diloco.chunk_threads as chunk_threads
import diloco.codecs.compiled as compiled
import diloco.codecs.compiled_sums as compiled_sums
from diloco.codecs import get_codec
from diloco.config import load_config
from diloco.core.events import PushArrived
from diloco.core.messages import Push
from diloco.fragments import Fragment
from diloco.strategies import build_strategy
from diloco.transport.wire_messages import DecodedOnUse


@pytest.fixture(autouse=True)
def one_thread_after():
    yield
    chunk_threads.set_threads(1)


@pytest.mark.parametrize("numel,multiple,threads", [(10_000_037, 64, 3), (5 << 20, 1 << 14, 4), (1000, 64, 8),
                                                     (0, 64, 2), (3 * chunk_threads.MIN_PIECE - 1, 64, 8)])
def test_pieces_cover_the_tensor_once_on_block_boundaries(numel: int, multiple: int, threads: int) -> None:
    chunk_threads.set_threads(threads)
    spans = chunk_threads.pieces(numel, multiple)
    assert spans[0][0] == 0 and spans[-1][1] == numel
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert all(start % multiple == 0 for start, _ in spans)
    assert len(spans) <= threads
    assert len(spans) == 1 or all(stop - start >= chunk_threads.MIN_PIECE // 2 for start, stop in spans[:-1])


def test_spans_run_at_once_each_once_in_order() -> None:
    chunk_threads.set_threads(3)
    together = threading.Barrier(3, timeout=10)  # only met if three spans run at the same time
    seen: list[int] = []

    def work(start: int, stop: int) -> int:
        if start < 3:
            together.wait()
        seen.append(start)
        return start * 10

    spans = [(k, k + 1) for k in range(7)]
    assert chunk_threads.run(spans, work) == [k * 10 for k in range(7)]
    assert sorted(seen) == list(range(7))


def test_a_failing_span_raises_after_every_span_is_done() -> None:
    chunk_threads.set_threads(2)
    done: list[int] = []

    def work(start: int, stop: int) -> None:
        if start == 1:
            raise ValueError("span 1 broke")
        done.append(start)

    with pytest.raises(ValueError, match="span 1 broke"):
        chunk_threads.run([(k, k + 1) for k in range(6)], work)
    assert sorted(done) == [0, 2, 3, 4, 5]


def test_a_run_inside_a_piece_runs_its_spans_itself() -> None:
    chunk_threads.set_threads(2)  # one helper: a nested run that waited for it would never end
    inner = chunk_threads.run([(0, 1), (1, 2)], lambda a, b: chunk_threads.run([(0, 1), (1, 2), (2, 3)],
                                                                               lambda c, d: c + a))
    assert inner == [[0, 1, 2], [1, 2, 3]]


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_a_bad_thread_count_is_refused_and_changes_nothing(bad: object) -> None:
    chunk_threads.set_threads(2)
    with pytest.raises(ValueError, match="thread count"):
        chunk_threads.set_threads(bad)  # type: ignore[arg-type]
    assert chunk_threads.threads() == 2


needs_loops = pytest.mark.skipif(not compiled_sums.folds_like_torch(), reason="numba is not installed here")
ODD = 3 * (1 << 16) + 37
"""Three pieces and an odd tail: the last int4 byte holds one code."""


def _each_thread_count(make) -> list:
    results = []
    for threads in (1, 2, 3):
        chunk_threads.set_threads(threads)
        results.append(make())
    return results


@needs_loops
@pytest.mark.parametrize("codec_name", ["int4", "int8"])
def test_an_encode_in_pieces_gives_the_bytes_of_one_loop(codec_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunk_threads, "MIN_PIECE", 1 << 14)
    codec = get_codec(codec_name, 64)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(ODD, generator=generator)
    base = x + 1e-2 * torch.randn(ODD, generator=generator)
    x[1094 * 64:1095 * 64] = float("nan")  # a block that is not finite, in the second piece

    def encode() -> tuple:
        encoded, onto = codec.encode_difference_onto(x.nan_to_num(), base)
        plain = codec.encode(x.nan_to_num())
        scales = np.empty(-(-ODD // 64), np.float32)
        compiled.encode_linear(x, None, 64, 7, np.zeros(ODD, np.int8), scales)
        return (bytes(encoded.payload), encoded.scales, onto.numpy().tobytes(), bytes(plain.payload), plain.scales,
                np.isnan(scales).nonzero()[0].tolist())

    first, *others = _each_thread_count(encode)
    assert first[-1] == [1094]
    assert all(other == first for other in others)


@needs_loops
def test_a_group_folded_in_pieces_gives_the_sums_of_one_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(chunk_threads, "MIN_PIECE", 1 << 14)
    codec = get_codec("int4", 64)
    generator = torch.Generator().manual_seed(4)
    pushes = [codec.encode(torch.randn(ODD, generator=generator)) for _ in range(3)]
    payloads = [np.frombuffer(p.payload, np.uint8) for p in pushes]
    scales = [np.frombuffer(p.scales, np.float32) for p in pushes]
    alphas = np.array([[0.3, 1.0], [1.7, 0.25], [0.9, 2.0]], np.float32)
    base = (torch.randn(ODD, generator=generator), torch.randn(ODD, generator=generator))

    def fold() -> list[bytes]:
        made = (torch.empty(ODD), torch.empty(ODD))
        compiled_sums.fold_group(payloads, scales, 64, 7.0, made, (None, None), alphas)
        onto = tuple(t.clone() for t in base)
        compiled_sums.fold_group(payloads, scales, 64, 7.0, onto, onto, alphas)
        return [t.numpy().tobytes() for t in (*made, *onto)]

    first, *others = _each_thread_count(fold)
    assert all(other == first for other in others)


@needs_loops
def test_a_cores_rounds_on_threads_give_the_state_of_one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """The default config's decoupled core, int4 both ways, through plain and momentum steps: Θ, the outer
    optimizer, the published copy and every answer are the same bytes with 1, 2 and 3 threads."""
    monkeypatch.setattr(chunk_threads, "MIN_PIECE", 1 << 14)
    monkeypatch.setattr(cache_chunks, "CPU_CHUNK_ELEMENTS", 1 << 16)  # four chunks of the step
    codec, learners = get_codec("int4", 64), 4

    def rounds() -> list[bytes]:
        spec = build_strategy(load_config(overrides=[f"learners.count={learners}", "learners.speeds=[]",
                                                     "outer.fragments=1", "outer.quorum=2", "outer.pacing=false",
                                                     "codec.up=int4", "codec.down=int4"]))
        core = spec.syncer_core({"w": torch.randn(ODD, generator=torch.Generator().manual_seed(5))},
                                [Fragment(0, ("w",), ODD, False)], range(learners), embeddings=())
        for m in range(learners):
            core.declare(m, 64)
            core.rejoin_state(m, after_seq=0)
        answers = []
        for seq in range(1, 5):
            for m in range(learners):
                delta = torch.randn(ODD, generator=torch.Generator().manual_seed(10 * seq + m)) * 1e-3
                push = Push(m, 0, core.version(0), seq, DecodedOnUse({"w": codec.encode(delta)}), 256, 4,
                            step_time_s=0.01, sent_at=0.0, step=4 * seq)
                for action in core.handle(PushArrived(push), seq + 0.01 * m):
                    answers.append(repr(action).encode())
        assert core.rounds_closed >= 6
        state = core.state_dict()
        return [*answers, *(t.numpy().tobytes() for t in _tensors(state))]

    first, *others = _each_thread_count(rounds)
    assert all(other == first for other in others)


def _tensors(tree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        return [t for key in sorted(tree, key=str) for t in _tensors(tree[key])]
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    return []


@needs_loops
@pytest.mark.integration
def test_the_threads_benchmark_times_every_loop_on_every_count(tmp_path) -> None:
    """`benchmarks/merge_threads.py` stays runnable: each loop, each thread count, ratios against one."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).parents[1] / "benchmarks" / "merge_threads.py"
    out = tmp_path / "threads.json"
    subprocess.run([sys.executable, str(script), "--numel", str(ODD), "--threads", "1,3", "--repeats", "2",
                    "--json", str(out)], check=True, capture_output=True, timeout=300)
    result = json.loads(out.read_text())
    assert set(result["loops"]) == {"outer step", "downlink encode", "fold of 8 pushes"}
    for rows in result["loops"].values():
        assert set(rows) == {"1", "3"} and rows["1"]["speedup"] == rows["1"]["cpu_ratio"] == 1.0
        assert all(row["cpu_ns_per_element"] > 0 and row["wall_ns_per_element"] > 0 for row in rows.values())


def test_a_shards_threads_go_to_its_loops_and_torch_keeps_one_where_numba_runs_them(monkeypatch) -> None:
    from diloco.shard.serving import merge_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(compiled, "_enabled", True)
        assert merge_threads(3) == 1 and chunk_threads.threads() == 3
        monkeypatch.setattr(compiled, "_enabled", False)  # torch's ops are the arithmetic: they take them
        assert merge_threads(2) == 2 and chunk_threads.threads() == 2
    finally:
        torch.set_num_threads(before)
