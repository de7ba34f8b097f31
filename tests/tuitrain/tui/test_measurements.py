"""RunMeter: recent pace, and the device peak since the settings last changed."""

from __future__ import annotations

import dataclasses

from tuitrain.fakeworker import fake_stats
from tuitrain.tui.measurements import Measured, RunMeter


def with_peak(step: int, peak: int, *, tokens: int = 100, seconds: float = 0.5):
    stats = fake_stats(step, tokens=tokens)
    memory = dataclasses.replace(stats.memory, device_peak=peak)
    return dataclasses.replace(stats, memory=memory, seconds=seconds)


def test_nothing_is_measured_before_a_step():
    assert RunMeter().measured() is None
    assert RunMeter().tokens_per_second is None


def test_pace_is_averaged_over_the_window():
    meter = RunMeter(window=2)
    for step, seconds in ((1, 10.0), (2, 1.0), (3, 3.0)):
        meter.record(with_peak(step, 5, seconds=seconds))
    assert meter.tokens_per_second == 200 / 4.0
    assert meter.measured().step_seconds == 2.0


def test_the_peak_restarts_when_the_settings_change():
    meter = RunMeter()
    meter.record(with_peak(1, 900))
    meter.settings_changed()
    meter.record(with_peak(2, 400))
    meter.record(with_peak(3, 500))
    assert meter.measured().device_peak == 500


def test_the_pace_is_that_of_the_current_settings_without_the_tracing_first_step():
    meter = RunMeter()
    for step, seconds in ((1, 20.0), (2, 4.0), (3, 4.0)):
        meter.record(with_peak(step, 5, seconds=seconds))
    assert meter.measured().step_seconds == 4.0  # step 1 also traced the chunk order
    meter.settings_changed(from_step=4)
    meter.record(with_peak(4, 7, seconds=1.0))
    meter.record(with_peak(5, 6, seconds=3.0))
    measured = meter.measured()
    assert measured.step_seconds == 2.0 and measured.device_peak == 7
    assert measured.tokens_per_second == 200 / 4.0


def test_measured_gives_the_keys_a_preset_records():
    measured = Measured(step=4, device_peak=2 * 1024**3, step_seconds=0.25, tokens_per_second=None)
    assert measured.as_dict() == {"step": 4, "device_peak": 2 * 1024**3, "step_seconds": 0.25}
    assert measured.describe() == "measured at step 4: peak 2.0 GiB, 250.0 ms/step"
