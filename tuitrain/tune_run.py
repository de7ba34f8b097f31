"""The run a `tuitrain tune` trains: how many steps it is given, and the steps it made.

Without --steps the run is the search's alone: it is given room for every trial and the
measuring again, and stopped when the search ends, so each of its steps is one the tune
took. With --steps N it trains as `tuitrain run --steps N` does, N steps in all, the
search's among them: the search ends when no trial fits in what is left (its step limit),
and the run goes on with the best to its last step. What the tune says of its steps is
counted from the steps the run reported, one each, which are the metrics file's step lines;
the file then ends with the run's summary, as a headless run's does. Ctrl-C, SIGTERM and a
reader of the output that goes away stop the run as they stop a headless one (`RunEnd`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tuitrain.errors import UsageError
from tuitrain.events import Event, Failed, Finished, Step
from tuitrain.run_summary import record_summary
from tuitrain.settings import Settings
from tuitrain.stop_requests import repeats_the_stop
from tuitrain.trials import TrialBook
from tuitrain.tune import RUN_OFF
from tuitrain.tune_worker import wait_for_end

if TYPE_CHECKING:
    from tuitrain.stop_requests import Stopping
    from tuitrain.worker import ProcessWorker

# Steps a trial takes beyond its measured ones: the step under way when its change is asked
# for (the change waits for a step boundary; the run's first step when the search begins),
# and the step after the change, which re-places chunks and is not measured.
SPARE_STEPS = 2


def least_steps(trial_steps: int) -> int:
    """The fewest steps in which a tune measures one setting."""
    return trial_steps + SPARE_STEPS


def check_steps(steps: int, trial_steps: int) -> None:
    """Refuse a --steps that cannot hold one trial (UsageError)."""
    least = least_steps(trial_steps)
    if steps < least:
        raise UsageError(f"--steps: a tune measures a setting in {least} steps at the "
                         f"least (--trial-steps {trial_steps}, the step under way when it "
                         f"is applied and the one after; got {steps})")


def check_tune_steps(settings: Settings, steps: int | None, trial_steps: int) -> int:
    """The step after which a tune's run resumes (0: it starts anew), or a UsageError for a
    --steps (`steps`, None when not given) too short for one trial.

    A resumed run continues a run of a set length: its learning rate's course and its last
    evaluation are the length's, and a checkpoint it saves is taken for that run's by the
    next --resume. So its tune needs --steps N, the run's length, with room for a trial
    after the checkpoint; the search begins there and the best trains on to step N. Sized
    for the search alone (no --steps), the run would get a length of the tune's choosing,
    short of the checkpoint's step or soon after it."""
    if settings.checkpoint.resume is None:
        if steps is not None:
            check_steps(steps, trial_steps)
        return 0
    from tuitrain.resume import resumed_state

    folder, state = resumed_state(settings)
    done, least = int(state.get("step", 0)), least_steps(trial_steps)
    if steps is None:
        saved = (state.get("settings") or {}).get("training", {}).get("steps")
        had = f"; the run that saved it had --steps {saved}" if saved else ""
        raise UsageError(f"--resume: a tune of a resumed run needs the run's length: give "
                         f"--steps N, at least {done + least} ({folder} is after step {done}, "
                         f"and a trial takes {least} steps{had})")
    if steps < done + least:
        raise UsageError(f"--steps: {folder} is after step {done}, and a tune measures a "
                         f"setting in {least} steps at the least (--trial-steps "
                         f"{trial_steps}, the step under way when it is applied and the "
                         f"one after): give at least {done + least} (got {steps})")
    return done


def run_length(steps: int | None, *, settings_steps: int, fitting: int,
               trial_steps: int) -> int:
    """The run's last step: `steps` (--steps N) when given; else room for a trial of each
    of the `fitting` candidates and for the measuring again (the run is stopped when the
    search ends, so `settings_steps`, the preset's or the default, only adds room)."""
    if steps is not None:
        return steps
    room = (fitting + RUN_OFF + 1) * least_steps(trial_steps) + SPARE_STEPS
    return max(room, settings_steps)


class RunSteps:
    """The tune's run as its events tell it: the steps it made, by number; its trials
    (tuitrain.trials), for its summary; and how it ended."""

    def __init__(self) -> None:
        self.numbers: list[int] = []
        self.book = TrialBook()
        self.end: Finished | Failed | None = None

    def see(self, event: Event) -> None:
        if isinstance(event, Step):
            self.numbers.append(event.stats.step)
            self.book.record(event.stats)
        elif isinstance(event, (Finished, Failed)):
            self.end = event

    @property
    def total(self) -> int:
        """Steps the run made so far."""
        return len(self.numbers)

    @property
    def latest(self) -> int:
        """The number of the latest step the run reported; 0 before any."""
        return max(self.numbers, default=0)

    def before(self, step: int) -> int:
        """Steps the run made before step number `step`."""
        return sum(n < step for n in self.numbers)

    def append_summary(self) -> str | None:
        """A finished run's summary and its trials as the last line of its metrics file,
        as a headless run's (tuitrain.run_summary.record_summary); returns the line to say
        when it cannot be written, else None."""
        if not isinstance(self.end, Finished):
            return None
        return record_summary(self.end.summary, self.book.rows())


class RunEnd:
    """How the tune's run ends, and every event until then relayed to `on_event`: by
    itself at its last step (`wait`), stopped by the tune once its search is over (`end`),
    or as its user asked (`stopped`), as a headless run is: at the next look at the worker
    after a Ctrl-C or the output's reader gone, the step under way ending at its next
    layer; at once after a second Ctrl-C or SIGTERM (tuitrain.stop_requests.Stopping)."""

    def __init__(self, worker: ProcessWorker, stopping: Stopping, seen: RunSteps,
                 on_event: Callable[[Event], None], *, last_step: int) -> None:
        self.worker = worker
        self.stopping = stopping
        self.seen = seen
        self.on_event = on_event
        self.last_step = last_step

    def stopped(self) -> bool:
        """Whether the run was asked to stop. Asked before each wait for the worker, so
        that the first request sends it Stop at once, whatever waits; a reader that goes
        after the run's last step stops nothing, the run ending as it is."""
        self.stopping.look(reader_matters=self.seen.latest < self.last_step)
        return self.stopping.asked

    def wait(self) -> bool:
        """Wait for the run's last step: True once it has ended, False when asked to stop
        first."""
        return wait_for_end(self.worker, self.on_event, stopped=self.stopped)

    def end(self) -> None:
        """End the run now: one asked to stop once it has (or as soon as it is to be
        ended at once), any other with a Stop; then relay what came meanwhile, its
        summary or why there is none."""
        if self.stopping.asked:
            wait_for_end(self.worker, self._quiet, stopped=self.stopping.look)
        self.stopping.end()
        for event in self.worker.poll():
            self._quiet(event)

    def _quiet(self, event: Event) -> None:
        if not repeats_the_stop(event):  # no news to whoever stopped it
            self.on_event(event)
