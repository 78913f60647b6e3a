"""A slower chip, emulated: the stretch scales the step's compute (its CPU time on the CPU), never the time
it waited for a core shared with other learners."""

from __future__ import annotations

import pytest

from diloco.client.slower_chip import stretch_s


def test_on_the_cpu_the_stretch_scales_cpu_time_so_waiting_for_a_core_is_not_multiplied():
    # A step that computed 40 ms and waited 60 ms for a core: at a quarter speed it lasts 100 + 3 x 40 ms.
    assert stretch_s(0.25, wall_s=0.100, cpu_s=0.040) == pytest.approx(0.120)
    assert stretch_s(0.5, wall_s=0.100, cpu_s=0.040) == pytest.approx(0.040)


def test_on_an_accelerator_the_stretch_scales_wall_time():
    assert stretch_s(0.25, wall_s=0.100, cpu_s=None) == pytest.approx(0.300)
    assert stretch_s(1.0, wall_s=0.100, cpu_s=0.040) == 0.0


@pytest.mark.parametrize("speed", [0.0, -0.5, 1.5])
def test_a_speed_outside_zero_to_one_is_refused(speed):
    with pytest.raises(ValueError, match="speed must be in"):
        stretch_s(speed, wall_s=0.1, cpu_s=0.04)
