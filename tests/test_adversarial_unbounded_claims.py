"""Issue 32: claims a peer or a file makes that the hardening had left unbounded, each refused in one
line with nothing changed."""

import copy
import dataclasses

import pytest
import torch

from diloco.config import Config, load_config
from diloco.core.events import HeartbeatArrived, ProgressArrived
from diloco.core.messages import Progress, Push
from diloco.core.actions import Stop
from diloco.core.refusals import ProtocolError
from diloco.errors import ConfigError, DilocoError
from diloco.fragments import Fragment
from diloco.shard.store import ShardStore
from diloco.strategies import build_strategy
from core_state import refused

FRAGMENT = [Fragment(0, ("w",), 4, False)]


def run_core(members=(0, 1)):
    """The syncer core exactly as both drivers build it from the default config (shared budget on)."""
    spec = build_strategy(Config())
    return spec.syncer_core({"w": torch.tensor([1.0, -1.0, 0.5, 2.0])}, FRAGMENT, members, embeddings=())


def test_one_learner_cannot_declare_a_rate_that_ends_the_run():
    core = run_core()
    assert core.budget is not None
    assert "tokens per step" in refused(lambda: core.declare(0, 10**12))
    before = copy.deepcopy(core.claims.state_dict())
    claim = 10**12
    refused(lambda: core.on_push(Push(0, 0, 0, 1, {"w": torch.zeros(4)}, claim, 1, step=1), now=1.0))
    refused(lambda: core.handle(HeartbeatArrived(0, step=1, tokens=claim), now=1.0))
    refused(lambda: core.handle(ProgressArrived(Progress(0, 1, claim, 0.1)), now=1.0))
    assert not core.stopped and not core.budget_spent
    assert core.claims.state_dict() == before and core.tokens_reported() == 0
    core.declare(0, 16 * 64)  # the run's own batch x sequence: honest
    actions = core.handle(HeartbeatArrived(0, step=1, tokens=16 * 64), now=1.1)
    assert not any(isinstance(a, Stop) for a in actions)


def test_a_learner_that_declares_nothing_is_held_to_the_run_s_rate_too():
    core = run_core()
    refused(lambda: core.handle(HeartbeatArrived(0, step=1, tokens=2**24), now=1.0))
    assert not core.stopped


# ---------------------------------------------------------------- 2. --resume of a shard that had run


def seeded_store(state_dir):
    """A shard's store that seeded Θ, saved and exited cleanly: its journal is empty."""
    store = ShardStore(state_dir, 0, resume=False)
    store.open(last_seq=0)
    store.save({"core": {}})
    store.journal.close()
    assert (state_dir / "shard-0.journal").stat().st_size == 0
    return store


@pytest.mark.parametrize("damage", ["missing", "a directory"])
def test_resume_of_a_shard_that_seeded_theta_never_starts_fresh(tmp_path, damage):
    store = seeded_store(tmp_path)
    store.state_path.unlink()
    if damage == "a directory":
        store.state_path.mkdir()
    with pytest.raises(DilocoError) as caught:
        ShardStore(tmp_path, 0, resume=True)
    assert "\n" not in str(caught.value)
    assert ("had seeded" if damage == "missing" else "is not a file") in str(caught.value)


def test_only_a_shard_that_never_seeded_starts_fresh_on_resume(tmp_path):
    ShardStore(tmp_path, 0, resume=False)  # killed before any learner seeded Θ: an empty journal, no mark
    assert not ShardStore(tmp_path, 0, resume=True).saved


# ---------------------------------------------------------------- 4. config numbers training cannot live with


@pytest.mark.parametrize("override", ["outer.lr=1e308", "outer.lr=1e3", "train.lr=50", "regional.lr=1e12",
                                      "link.bandwidth_mbit=1e308", "failures.detect_s=1e300",
                                      "learners.step_time_s=1e20", "outer.outlier_factor=1e300"])
def test_every_config_number_has_a_range_training_can_live_with(override):
    with pytest.raises(ConfigError) as caught:
        load_config(None, [override])
    assert override.split("=")[0] in str(caught.value) and "\n" not in str(caught.value)


def test_an_outer_step_the_config_cannot_take_is_one_line_at_start_up():
    config = Config()
    unchecked = dataclasses.replace(config, outer=dataclasses.replace(config.outer, lr=1e308))  # past validation
    with pytest.raises(DilocoError) as caught:
        build_strategy(unchecked)
    assert "outer step" in str(caught.value) and "\n" not in str(caught.value)


# ---------------------------------------------------------------- 5. state files sealed with the run's secret


def test_a_state_file_is_sealed_with_the_run_s_secret_and_a_rewritten_one_is_refused(tmp_path):
    from diloco.state_files import file_key, load_checked, save_checked

    key = file_key(b"the run's secret")
    path = tmp_path / "shard-0.state.pt"
    state = {"core": {"theta": {"w": torch.full((4,), 0.02)}}}
    save_checked(state, path, key)
    assert torch.equal(load_checked(path, "state", "advice", key)["core"]["theta"]["w"], state["core"]["theta"]["w"])
    state["core"]["theta"]["w"] = torch.full((4,), 3e38)
    for forged, why in ((None, "not sealed"), (file_key(b"another run's secret"), "does not match its seal")):
        save_checked(state, path, forged)  # rewritten, its checksum recomputed as well as the writer can
        with pytest.raises(DilocoError) as caught:
            load_checked(path, "state", "advice", key)
        assert why in str(caught.value) and "\n" not in str(caught.value)
    save_checked(state, path, key)
    with pytest.raises(DilocoError, match="none is given"):
        load_checked(path, "state", "advice")  # a sealed file needs the secret


def test_a_shard_store_seals_its_state_and_a_checkpoint_is_sealed_by_the_learner_s_credential(tmp_path):
    from diloco.client.checkpoints import checkpoint_key
    from diloco.state_files import file_key

    key = file_key(b"secret")
    store = ShardStore(tmp_path, 0, resume=False, key=key)
    store.open(last_seq=0)
    store.save({"core": {}})
    store.journal.close()
    with pytest.raises(DilocoError, match="sealed with a run secret"):
        ShardStore(tmp_path, 0, resume=True).load()
    assert ShardStore(tmp_path, 0, resume=True, key=key).load()["core"] == {}
    assert checkpoint_key(None, "ab" * 32) != checkpoint_key(None, "cd" * 32) and checkpoint_key(None) is None


# ---------------------------------------------------------------- credentials: one canonical form


def test_a_credential_has_one_canonical_form():
    from diloco.transport.security import LEARNER_KEY, METADATA_KEY, CredentialInterceptor, learner_token
    from diloco.transport.security_settings import call_token

    secret = b"secret"
    interceptor = CredentialInterceptor(secret)
    right = call_token(learner_token(secret, 1), None)
    assert interceptor.identify([(METADATA_KEY, right), (LEARNER_KEY, "1")])[0].learner == 1
    for metadata in ([(METADATA_KEY, right), (LEARNER_KEY, "01")],
                     [(METADATA_KEY, right), (LEARNER_KEY, "+1")],
                     [(METADATA_KEY, "wrong"), (METADATA_KEY, right), (LEARNER_KEY, "1")],
                     [(METADATA_KEY, right), (METADATA_KEY, "wrong"), (LEARNER_KEY, "1")]):
        caller, why = interceptor.identify(metadata)
        assert caller is None and why
