import pytest
import torch

from diloco import cache_chunks
from diloco.outer import Nesterov, merge_fragment, radial_directional, weighted_mean
from diloco.outer.delayed_nesterov import DelayedNesterov
from diloco.outer.merge import MergeSums, tensor_norm


def test_nesterov_by_hand():
    theta = {"w": torch.tensor([1.0])}
    opt = Nesterov(lr=0.7, momentum=0.9)
    opt.step(theta, {"w": torch.tensor([0.5])})
    # b = 0.5; Θ = 1 − 0.7·(0.5 + 0.9·0.5) = 0.335
    assert theta["w"].item() == pytest.approx(0.335)
    opt.step(theta, {"w": torch.tensor([0.5])})
    # b = 0.9·0.5 + 0.5 = 0.95; Θ = 0.335 − 0.7·(0.5 + 0.855) = −0.6135
    assert theta["w"].item() == pytest.approx(-0.6135)


def test_nesterov_matches_torch_sgd():
    torch.manual_seed(0)
    start = torch.randn(7, 3)
    ours = {"w": start.clone()}
    ref = torch.nn.Parameter(start.clone())
    sgd = torch.optim.SGD([ref], lr=0.4, momentum=0.9, nesterov=True)
    opt = Nesterov(lr=0.4, momentum=0.9)
    for _ in range(5):
        delta = torch.randn(7, 3)
        opt.step(ours, {"w": delta})
        ref.grad = delta.clone()
        sgd.step()
    torch.testing.assert_close(ours["w"], ref.detach(), rtol=1e-6, atol=1e-6)


def test_outer_step_moves_theta_towards_the_learner():
    # The learner went up by 1: Δ = anchor − θ = −1, so Θ must go up.
    theta = {"w": torch.zeros(3)}
    learner = torch.ones(3)
    Nesterov(lr=0.7, momentum=0.0).step(theta, {"w": theta["w"] - learner})
    assert torch.all(theta["w"] > 0)


def test_nesterov_keeps_fp32_state():
    theta = {"w": torch.zeros(4)}
    opt = Nesterov(lr=1.0, momentum=0.5)
    opt.step(theta, {"w": torch.ones(4, dtype=torch.bfloat16)})
    assert opt.buffers["w"].dtype == torch.float32
    restored = Nesterov(lr=1.0, momentum=0.5)
    restored.load_state_dict(opt.state_dict())
    torch.testing.assert_close(restored.buffers["w"], opt.buffers["w"])


def test_weighted_mean_by_hand():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 4.0])
    torch.testing.assert_close(weighted_mean([a, b], [3.0, 1.0]), torch.tensor([0.75, 1.0]))


def test_plain_mean_ignores_weights():
    deltas = [{"w": torch.tensor([2.0])}, {"w": torch.tensor([4.0])}]
    assert merge_fragment(deltas, [1.0, 100.0], "mean")["w"].item() == pytest.approx(3.0)
    assert merge_fragment(deltas, [1.0, 3.0], "weighted")["w"].item() == pytest.approx(3.5)


def test_rda_of_orthogonal_unit_vectors_keeps_the_norm():
    a, b = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    merged = radial_directional([a, b], [1.0, 1.0])
    torch.testing.assert_close(merged, torch.tensor([2**-0.5, 2**-0.5]))
    # The plain mean would have shrunk it to norm 1/√2.
    assert weighted_mean([a, b], [1.0, 1.0]).norm().item() == pytest.approx(2**-0.5)


def test_rda_of_identical_directions_is_the_weighted_norm_along_it():
    d = torch.tensor([3.0, 4.0])
    merged = radial_directional([d, 2 * d], [1.0, 3.0])
    # norms 5 and 10 weighted 1:3 → 8.75 along unit(d)
    torch.testing.assert_close(merged, d / 5 * 8.75)


def test_rda_never_shrinks_below_the_weighted_mean():
    g = torch.Generator().manual_seed(1)
    for _ in range(20):
        deltas = [torch.randn(50, generator=g) for _ in range(4)]
        weights = torch.rand(4, generator=g).add(0.1).tolist()
        rda = radial_directional(deltas, weights).norm()
        mean = weighted_mean(deltas, weights).norm()
        mean_norm = sum(w * d.norm() for w, d in zip(weights, deltas)) / sum(weights)
        assert rda >= mean - 1e-5
        assert rda == pytest.approx(float(mean_norm), rel=1e-5)


def test_rda_falls_back_to_the_mean_when_directions_cancel():
    a = torch.tensor([1.0, 0.0])
    merged = radial_directional([a, -a], [1.0, 1.0])
    torch.testing.assert_close(merged, torch.zeros(2))


def test_embeddings_take_the_weighted_mean_under_rda():
    deltas = [{"emb": torch.tensor([1.0, 0.0]), "w": torch.tensor([1.0, 0.0])},
              {"emb": torch.tensor([0.0, 1.0]), "w": torch.tensor([0.0, 1.0])}]
    merged = merge_fragment(deltas, [1.0, 1.0], "rda", embeddings={"emb"})
    torch.testing.assert_close(merged["emb"], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(merged["w"], torch.tensor([2**-0.5, 2**-0.5]))


def test_merge_rejects_bad_weights():
    with pytest.raises(ValueError):
        merge_fragment([{"w": torch.ones(1)}], [0.0], "weighted")
    with pytest.raises(ValueError):
        merge_fragment([], [], "mean")


@pytest.mark.parametrize("make", [lambda: Nesterov(0.7, 0.9), lambda: DelayedNesterov(0.7, 0.9),
                                  lambda: DelayedNesterov(0.5, 0.8, buffer=3)])
def test_chunked_step_on_a_lazy_merge_is_the_whole_tensor_step_bit_for_bit(make, monkeypatch):
    """The outer step reads the merged Δ a chunk at a time (`MergeSums.merged_lazily`) and does all its ops
    while the chunk is in cache: Θ and the state come out as one whole-tensor op at a time gives them."""

    def run(chunk: int, lazy: bool) -> list[torch.Tensor]:
        monkeypatch.setattr(cache_chunks, "CPU_CHUNK_ELEMENTS", chunk)
        generator = torch.Generator().manual_seed(0)
        theta = {"w": torch.randn(37, 29, generator=generator), "b": torch.randn(5, generator=generator)}
        optimizer, seen = make(), []
        for r in range(7):
            sums = MergeSums()
            for m in range(3):
                deltas = {n: torch.randn(t.shape, generator=generator) * 1e-3 for n, t in theta.items()}
                sums.fold(deltas, 1.0 + m, radial={n: tensor_norm(d) for n, d in deltas.items() if n == "w"})
            merged = sums.merged_lazily(list(theta), "rda") if lazy else sums.merged(list(theta), "rda")
            out = {n: torch.empty_like(t) for n, t in theta.items()}
            optimizer.step(theta, merged, 0.5 if r % 2 else 1.0, out=out)
            theta = out
            seen += [t.clone() for t in (*theta.values(), *optimizer.tensors())]
        optimizer.step(theta, merged, 1.0)  # in place
        return seen + list(theta.values())

    whole = run(1 << 20, lazy=False)  # one chunk per tensor: each op over the whole tensor
    for got in (run(100, lazy=True), run(100, lazy=False)):
        assert len(got) == len(whole)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(got, whole))
