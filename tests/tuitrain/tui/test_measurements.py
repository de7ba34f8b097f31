"""RunMeter: the recent pace the header shows (what a setting achieved is a trial's)."""

from __future__ import annotations

import dataclasses

from tests.tuitrain.fakeworker import fake_stats
from tuitrain.tui.measurements import RunMeter


def timed(step: int, *, tokens: int = 100, seconds: float = 0.5):
    return dataclasses.replace(fake_stats(step, tokens=tokens), seconds=seconds)


def test_nothing_is_measured_before_a_step():
    assert RunMeter().tokens_per_second is None


def test_pace_is_averaged_over_the_window():
    meter = RunMeter(window=2)
    for step, seconds in ((1, 10.0), (2, 1.0), (3, 3.0)):
        meter.record(timed(step, seconds=seconds))
    assert meter.tokens_per_second == 200 / 4.0


def test_a_reset_forgets_the_run():
    meter = RunMeter()
    meter.record(timed(1))
    meter.reset()
    assert meter.tokens_per_second is None
