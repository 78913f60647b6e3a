"""The CPU profile (`diloco.cpu_profile`): a thread's CPU is charged to the frames it spends it in, a thread
that waits is charged nothing, and a window's shares are the difference of two snapshots."""

from __future__ import annotations

import json
import threading
import time

import pytest

from diloco.cpu_profile import PROFILE_ENV, CpuProfile, difference, start_from_env

pytestmark = pytest.mark.skipif(not CpuProfile.available(), reason="no per-thread CPU clocks here")


def _spin_in_the_hot_frame(seconds: float) -> int:
    end, count = time.thread_time() + seconds, 0
    while time.thread_time() < end:
        count += 1
    return count


def _wait_in_the_idle_frame(done: threading.Event) -> None:
    done.wait()


def test_cpu_is_charged_to_the_frame_that_spends_it_and_a_waiting_thread_to_nothing():
    profile = CpuProfile(period_s=0.001)
    done = threading.Event()
    waiter = threading.Thread(target=_wait_in_the_idle_frame, args=(done,))
    spinner = threading.Thread(target=_spin_in_the_hot_frame, args=(0.4,))
    waiter.start()
    assert profile.start()
    spinner.start()
    spinner.join()
    profile.stop()
    done.set()
    waiter.join()
    window = difference(profile.snapshot(), None)
    shares = dict(window["inclusive"])
    assert 0.25 < window["cpu_s"] < 2.0  # the spinner's 0.4 s of CPU, and what the test's own thread spent
    assert shares["test_cpu_profile.py:_spin_in_the_hot_frame"] > 0.5
    assert shares.get("test_cpu_profile.py:_wait_in_the_idle_frame", 0.0) < 0.05
    assert dict(window["leaf"]).get("test_cpu_profile.py:_spin_in_the_hot_frame <- threading.py:run", 0) > 0.5


def test_a_windows_shares_are_the_difference_of_two_snapshots():
    earlier = {"cpu_ns": 1_000, "leaf": {"a": 600, "b": 400}, "inclusive": {"a": 600, "b": 400, "run": 1_000}}
    later = {"cpu_ns": 5_000, "leaf": {"a": 1_600, "b": 3_400}, "inclusive": {"a": 1_600, "b": 3_400, "run": 5_000}}
    window = difference(later, earlier)
    assert window["cpu_s"] == pytest.approx(4e-6)
    assert window["leaf"] == [["b", 0.75], ["a", 0.25]]
    assert window["inclusive"][0] == ["run", 1.0]
    assert difference(earlier, earlier) == {"cpu_s": 0.0, "leaf": [], "inclusive": []}


def test_a_process_profiles_itself_to_the_file_the_environment_names(tmp_path, monkeypatch):
    assert start_from_env() is None  # not asked
    target = tmp_path / "profile.json"
    monkeypatch.setenv(PROFILE_ENV, str(target))
    profile = start_from_env()
    assert profile is not None
    try:
        _spin_in_the_hot_frame(0.05)
        profile.write(target)
        written = json.loads(target.read_text())
        assert set(written) == {"unix", "cpu_ns", "leaf", "inclusive"} and not (tmp_path / "profile.json.part").exists()
    finally:
        profile.stop()


def test_frames_beyond_the_top_are_summed_as_other():
    from diloco.cpu_profile import TOP

    names = {f"f{k}": 10 + k for k in range(TOP + 5)}
    window = difference({"cpu_ns": sum(names.values()), "leaf": names, "inclusive": names}, None)
    assert len(window["leaf"]) == TOP + 1 and window["leaf"][-1][0] == "(other)"
    assert window["leaf"][0][0] == f"f{TOP + 4}" and sum(s for _, s in window["leaf"]) == pytest.approx(1.0, abs=1e-3)
