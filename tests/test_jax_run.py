"""Mixed runs from the config: `diloco run` with torch and JAX learners trains one Θ, every token accounted,
and its model.pt loads into the Flax GPT; the simulator says in one line that it ignores the key."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import TINY

pytest.importorskip("jax")
pytest.importorskip("flax")
pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

from diloco.jax.flax_gpt import FlaxGPT, init_gpt  # noqa: E402
from diloco.jax.name_map import load_model_file  # noqa: E402
from diloco.models.gpt import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.integration  # runs diloco as processes

MIXED = 'learners.frameworks=["torch","jax"]'


def diloco(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco", *args], capture_output=True, text=True, timeout=400)


def sets(*overrides: str) -> list[str]:
    return [x for o in overrides for x in ("--set", o)]


def test_a_mixed_run_trains_one_theta_every_token_accounted_and_model_pt_loads_into_either_model(tmp_path):
    done = diloco("run", *sets(*TINY, "learners.speeds=[1, 1]", "train.tokens=20480", MIXED), "--out", str(tmp_path),
                  "-q")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    reports = [json.loads((tmp_path / "learners" / f"learner-{m}.json").read_text()) for m in range(2)]
    assert [r.get("framework", "torch") for r in reports] == ["torch", "jax"]
    assert all(r["tokens"] > 0 and r["pushes"] > 0 for r in reports)
    assert summary["tokens"] == sum(r["tokens"] for r in reports) >= 20480
    assert summary["tokens_merged"] + summary["tokens_stale"] + summary["tokens_lost"] == summary["tokens"]
    assert summary["duplicates"] == 0
    assert np.isfinite(summary["final_eval_loss"])

    state = torch.load(tmp_path / "model.pt", weights_only=True)
    cfg = GPTConfig(vocab_size=state["token_embedding.weight"].shape[0], context=16, layers=1, width=32, heads=2)
    model = GPT(cfg)
    model.load_state_dict(state, strict=True)
    params = load_model_file(str(tmp_path / "model.pt"), init_gpt(cfg, seed=0))
    x = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(x).numpy()
    np.testing.assert_allclose(np.asarray(FlaxGPT(cfg).apply({"params": params}, jnp.asarray(x.numpy()))), expected,
                               rtol=1e-4, atol=1e-5)


def test_the_simulator_ignores_learners_frameworks_in_one_warning_line(tmp_path):
    done = diloco("sim", *sets(*TINY, "learners.speeds=[1, 1]", MIXED), "--out", str(tmp_path), "-q")
    assert done.returncode == 0, done.stderr[-3000:]
    warnings = [line for line in done.stderr.splitlines() if "learners.frameworks" in line]
    assert len(warnings) == 1 and "ignored by `diloco sim`" in warnings[0]
    assert json.loads((tmp_path / "summary.json").read_text())["tokens"] >= 10240
