"""What a run measured, read back from its metrics file for a preset saved when it ends.

The figures are those of tuitrain.trials (medians over settled steps), so that a preset
saved from a headless run says what the run's summary printed, and what a preset saved
from the app's trials table says.
"""

from __future__ import annotations

import os

from engine.telemetry import stats_from_dict
from tuitrain.metrics import latest_run
from tuitrain.trials import TrialBook


def measure_metrics(path: str | os.PathLike) -> dict[str, object] | None:
    """The trial of the setting the latest run in a metrics file ended under, as a preset's
    header records it (tuitrain.trials.Trial.measured); None when the run has no step."""
    book = TrialBook()
    for record in latest_run(path):
        book.record(stats_from_dict(record))
    current = book.current
    trial = next((t for t in book.rows() if t.setting == current), None)
    return None if trial is None else trial.measured()
