"""A run's summary gives each fact once, in the figure and words every other place shows:
the host peak is the steps' (each one's VmHWM, as the trials, the app and a saved preset
have it), said alike by the headless run and the app."""

from __future__ import annotations

import io
import re

from tests.tuitrain.fakeworker import GiB, fake_stats
from tests.tuitrain.test_headless import report_on
from tuitrain.run_summary import run_summary_lines


def test_the_headless_summary_and_the_apps_give_the_peaks_in_one_line_of_the_same_words():
    out = io.StringIO()
    report = report_on(out, steps=3)
    for step in (1, 2, 3):
        report.step(fake_stats(step))
    rss = max(fake_stats(step).memory.process_rss for step in (1, 2, 3))
    summary = {"steps": 3, "last_step": 3, "planned_steps": 3, "tokens": 768, "seconds": 2.0,
               "first_step_seconds": 1.0, "final_loss": 2.0, "peak_device_bytes": 2 * GiB,
               "peak_host_bytes": rss, "metrics": None}
    report.finished(summary)
    headless = out.getvalue()
    app = "\n".join(run_summary_lines(summary, report.trials.rows()))
    (peaks,) = [line.strip() for line in app.splitlines() if "peak host" in line]
    assert peaks in headless
    # One host figure in each: the same value the trials show.
    for text in (headless, app):
        assert len(re.findall(r"host RSS ([\d.]+ \w+)", text.split("trials")[0])) == 1
