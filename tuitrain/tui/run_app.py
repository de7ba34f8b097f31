"""The terminal app run to its end for `tuitrain run`: what the shell gets back."""

from __future__ import annotations

import contextlib
import sys
from typing import TextIO

from tuitrain.run_preset import PresetPace
from tuitrain.run_summary import interrupted_line, ran_to_its_end
from tuitrain.settings import Settings
from tuitrain.tui.app import TuitrainApp
from tuitrain.tui.failure_panel import failure_line
from tuitrain.tui.spawn import data_parallel_factory


def run_app(settings: Settings, *, nproc: int = 1, err: TextIO | None = None,
            pace: PresetPace | None = None) -> int:
    """Run the terminal app until the user quits; `nproc` ranks train data parallel
    (tuitrain.rank_worker), the app steering rank 0 and showing every rank's memory.

    Returns 0; 1 when the run had failed, 2 when it failed on a mistake in the input (as
    the headless runner does); 143 after SIGTERM and 129 after SIGHUP, which stop the run
    at once (tuitrain.tui.termination). A failure, or a run so stopped, is also told in one
    line on `err` (default stderr), since the screen that showed it is gone once the app
    exits.
    """
    factory = data_parallel_factory(nproc) if nproc > 1 else None
    app = TuitrainApp(settings, worker_factory=factory)
    app.preset_pace = pace
    app.run()
    line = None
    if app.failure_at_quit is not None:
        line = failure_line(app.failure_at_quit, log_path=app.log_path)
    elif app.termination.stopped_run:
        summary = app.finished.summary if app.finished else None
        step = app.latest.step if app.latest is not None else 0
        if not ran_to_its_end(summary):  # else it had finished as the signal came
            line = interrupted_line(app.settings, step, now=True, summary=summary)
    if line is not None:
        # After a hangup the terminal may be gone; the line is then for nobody.
        with contextlib.suppress(OSError):
            print(line, file=err or sys.stderr, flush=True)
    return app.termination.exit_status or app.return_code or 0
