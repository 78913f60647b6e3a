"""The accelerator paths, exercised on the CPU here: device choice, bf16 autocast, staging between the
device and the host. The CUDA-only checks skip cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_config
from diloco.data import ShardSampler, load_corpus
from diloco.errors import DilocoError
from diloco.models.factory import build_model
from diloco.client.staging import DeviceStaging
from diloco.training import Replica, make_optimizer, resolve_device

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def tiny_replica(*overrides: str) -> Replica:
    config = tiny_config(*overrides)
    corpus = load_corpus("shakespeare")
    model = build_model(config, corpus.vocab_size).to(resolve_device(config.train.device))
    sampler = ShardSampler(corpus.train, learner=0, learners=1, seq_len=16, batch_size=4, seed=0)
    return Replica(model, config.train, sampler, planned_steps=10)


def test_auto_is_the_gpu_when_there_is_one_and_a_missing_gpu_is_a_clear_error():
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(DilocoError, match="sees no CUDA device"):
            resolve_device("cuda")


def test_bf16_autocast_trains_and_keeps_fp32_parameters_and_optimizer_state():
    replica = tiny_replica("train.precision=bf16", "train.device=cpu")
    before = {n: p.detach().clone() for n, p in replica.named_params().items()}
    for _ in range(3):
        replica.train_step()
    assert replica.last_loss is not None and torch.isfinite(torch.tensor(replica.last_loss))
    for name, p in replica.named_params().items():
        assert p.dtype == torch.float32 and not torch.equal(p, before[name])
    state = replica.optimizer.state_dict()["state"]
    assert all(s["exp_avg"].dtype == torch.float32 for s in state.values())


def test_adamw_is_fused_only_on_a_gpu():
    model = torch.nn.Linear(4, 4)
    assert not make_optimizer(model, tiny_config().train).defaults.get("fused")


def test_staging_on_the_cpu_uses_tensors_where_they_are():
    staging = DeviceStaging(torch.device("cpu"))
    deltas = [torch.ones(3)]
    assert staging.hand_off(deltas) is None and staging.done() is None
    with staging.side():
        moved = staging.to_device(deltas[0])
    staging.wait_in_training(None)
    assert torch.equal(moved, deltas[0])


@cuda
def test_staging_on_a_gpu_moves_values_off_the_training_stream_exactly():
    device = torch.device("cuda")
    staging = DeviceStaging(device)
    anchor = torch.randn(1000, device=device)
    delta = torch.randn(1000)
    with staging.side():
        value = anchor + staging.to_device(delta)
        ready = staging.done()
    staging.wait_in_training(ready)
    assert torch.equal(value.cpu(), anchor.cpu() + delta)  # one fp32 add rounds alike on both
    grads = [torch.randn(1000, device=device)]
    handed = staging.hand_off(grads)
    with staging.side(handed):
        host = grads[0].cpu()
    assert torch.equal(host, grads[0].cpu())


@cuda
def test_adamw_is_fused_on_a_gpu():
    model = torch.nn.Linear(4, 4).cuda()
    assert make_optimizer(model, tiny_config().train).defaults.get("fused")


@pytest.mark.integration  # runs the benchmark as a process
def test_the_gpu_benchmark_runs_end_to_end_in_its_smoke_mode(tmp_path):
    """benchmarks/gpu.py measures only on a GPU; its smoke mode keeps the script working everywhere."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu.py"
    done = subprocess.run([sys.executable, str(script), "--smoke", "--out", str(tmp_path / "gpu.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    assert result["smoke"] and result["synced"]["pushes"] > 0 and result["step_time_ratio"] > 0
