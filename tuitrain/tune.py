"""The tuner's search: the fastest setting that fits, found by measuring real steps of the run.

    result = search(candidates(global_batch=8, ...), forecaster, trainer)
    result.best.candidate, result.trials, result.steps

1. Every candidate is forecast by the plan and the time model (`Forecaster`): those that do
   not fit any budget are dropped with the reason, and no trial ever runs them.
2. The rest are tried fastest forecast first, in the running process (`Trainer`): a trial
   applies the setting, skips the step after the change and any step that re-traced, and
   takes the median of at least `trial_steps` settled steps. Each is a real step of the run.
3. A trial whose settled steps are all clearly slower than the best so far stops early. A
   setting the engine refuses, or a step that fails, is recorded with its reason and the
   search goes on.
4. Measured times correct the forecast (their ratio, the model's error on this run; per
   kind of setting, policy and checkpointing, where trials of that kind were measured), the
   most promising untried candidate is tried next, and the search stops when no untried
   candidate, so corrected and given the model's uncertainty (its accuracy target for a
   kind not yet measured), can beat the best by more than `ENOUGH`, when `time_limit` is
   reached, when the run has no room left for another trial (`steps_left`, for a run of
   a set length), or when `stop()` says so (the user's key).
5. Trials whose medians lie within the noise of their own steps of the best's (at least
   MIN_UNCERTAINTY) cannot be told apart by one trial each: the best and the closest
   `RUN_OFF` of them are measured again, in turn, and the median of all their settled
   steps decides. Those still within `ENOUGH` of the fastest on all their steps are a
   difference a shared machine does not resolve: of them the one the model forecasts
   fastest is kept, so two searches of the same run keep the same setting. The best is
   then applied, and kept (`keep_best`), where the run goes on after the search.

No UI here: the CLI and the app show the trials (`on_trial`) as they like.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from tuitrain.formatting import plural
from tuitrain.tune_candidates import Candidate, Forecast, Forecaster, candidates

__all__ = [
    "Candidate",
    "Ended",
    "Failed",
    "Forecast",
    "Forecaster",
    "Refused",
    "StepResult",
    "Trial",
    "TuneResult",
    "candidates",
    "model_error",
    "search",
]

ENOUGH = 0.03  # an untried candidate must promise a gain above this to be tried
# How far a forecast may be off, relative to the others, before a run has shown more: the
# time model's accuracy target. Then, for a kind of setting measured, the spread of
# measured / forecast over its trials, never below MIN_UNCERTAINTY.
UNCERTAINTY = 0.15
MIN_UNCERTAINTY = 0.05
RUN_OFF = 2  # trials close to the best measured again beside it, at most
CLEARLY_SLOWER = 1.25  # a trial whose fastest settled step is this much slower stops early
MIN_TRIAL_STEPS = 3


@dataclass(frozen=True)
class StepResult:
    seconds: float
    retraced: bool = False  # the step recorded a new trace: not a settled step
    # Steps the run made before this one that no trial took: under the setting before, while
    # a change waited for the step boundary. Steps of the run the search took all the same.
    earlier: int = 0


class Refused(Exception):
    """The engine would not take the setting (its reason is the message)."""


class Failed(Exception):
    """A step under the setting failed (its reason is the message)."""


class Ended(Failed):
    """The run has made its last step: no trial gets another. The search ends there, as at
    its step limit, keeping the best so far (a trainer's caller that knows only Failed
    sees a step that could not be had)."""


class Trainer(Protocol):
    """The running run: changes apply at the next step; every step is a step of the run."""

    def apply(self, candidate: Candidate) -> None:
        """Raises Refused, or Ended when the run ended first."""

    def step(self) -> StepResult:
        """Raises Failed, or Ended when the run has no step left."""


# Trial.status values
PENDING, MEASURING, MEASURED, STOPPED_EARLY = "pending", "measuring", "measured", "stopped early"
DOES_NOT_FIT, SLOWER, REFUSED, FAILED = "does not fit", "forecast slower", "refused", "failed"
NOT_REACHED = "not tried"


@dataclass
class Trial:
    candidate: Candidate
    forecast: Forecast
    status: str = PENDING
    reason: str = ""
    steps: list[float] = field(default_factory=list)  # settled steps' seconds
    skipped: int = 0  # steps after the change, or re-traced, not measured
    measured: float | None = None  # median of the settled steps
    # How much slower than the best it was (stopped early: measured) or would be (forecast
    # slower: its corrected forecast), as a share: 0.12 is 12% slower.
    slower: float | None = None

    @property
    def tried(self) -> bool:
        return self.status in (MEASURED, STOPPED_EARLY, FAILED)


@dataclass
class TuneResult:
    best: Trial | None
    trials: list[Trial]
    steps: int  # steps of the run the search took
    stopped_by: str  # "converged", "time limit", "step limit", "stopped", "exhausted"
    log: list[str] = field(default_factory=list)


def search(
    space: Iterable[Candidate],
    forecaster: Forecaster,
    trainer: Trainer,
    *,
    trial_steps: int = MIN_TRIAL_STEPS,
    time_limit: float | None = None,
    stop: Callable[[], bool] = lambda: False,
    clock: Callable[[], float] = time.monotonic,
    on_trial: Callable[[Trial], None] = lambda trial: None,
    steps_left: Callable[[], int | None] = lambda: None,
    keep_best: bool = True,
) -> TuneResult:
    """Find the fastest candidate of `space` that fits; see the module's docstring.

    Args:
        trial_steps: settled steps a trial measures (at least MIN_TRIAL_STEPS).
        time_limit: seconds of `clock` the search may take; None: no limit. A trial under
            way when it passes is finished.
        stop: asked between steps; True ends the search at once, keeping the best so far.
        on_trial: told every time a trial changes (for a table, a progress line).
        steps_left: steps the run will still make after a change asked for now; None (the
            default): as many as asked for. A trial begins only when they hold its step
            after the change and its `trial_steps`, and is measured again only then; else,
            or when the run ends under a trial (the trainer's Ended), the search ends,
            stopped by "step limit".
        keep_best: apply the best at the end, for the rest of the run (the default); False
            when the run ends with the search, which a change would only hold up.
    """
    trial_steps = max(MIN_TRIAL_STEPS, trial_steps)
    start = clock()
    log: list[str] = []
    trials = [Trial(c, forecaster(c)) for c in space]
    for t in trials:
        if not t.forecast.fits:
            t.status, t.reason = DOES_NOT_FIT, t.forecast.reason
            on_trial(t)
    queue = sorted((t for t in trials if t.forecast.fits), key=lambda t: t.forecast.seconds)
    pending = list(queue)
    best: Trial | None = None
    steps = 0
    stopped_by = "exhausted"
    applied: Candidate | None = None
    ended = False  # the run made its last step

    def room(need: int) -> bool:
        left = steps_left()
        return left is None or left >= need

    while pending:
        trial = pending[0]
        if best is not None:
            # The most promising next: measured trials may have shown the model to be off
            # for one kind of setting and not another, which reorders the forecasts.
            trial = min(pending, key=lambda t: _promise(t, trials))
            if _promise(trial, trials) / best.measured > 1.0 - ENOUGH:
                stopped_by = "converged"
                for rest in pending:
                    rest.status = SLOWER
                    _against(rest, best, trials)
                    on_trial(rest)
                log.append(f"no untried setting can beat {best.candidate.describe()} by more "
                           f"than {ENOUGH:.0%}: done")
                break
        if time_limit is not None and clock() - start >= time_limit:
            stopped_by = "time limit"
            break
        if stop():
            stopped_by = "stopped"
            break
        if not room(trial_steps + 1):
            stopped_by = "step limit"
            break
        pending.remove(trial)
        try:
            ran, applied_now = _run_trial(trial, trainer, best, trial_steps, stop, on_trial,
                                          log)
        except Ended:
            ended, stopped_by = True, "step limit"
            steps += _taken(trial)
            if trial.status == MEASURING:
                trial.status = NOT_REACHED
                trial.reason = (f"the run ended after {len(trial.steps)} of "
                                f"{plural(trial_steps, 'step')}")
                on_trial(trial)
            break
        steps += ran
        applied = applied_now or applied
        if trial.status == MEASURED and (best is None or trial.measured < best.measured):
            best = trial
    if best is not None and stopped_by in ("converged", "exhausted"):
        def over() -> bool:
            return (stop() or (time_limit is not None and clock() - start >= time_limit)
                    or not room(trial_steps + 1))

        ran, applied_now, best = _run_off(best, trials, trainer, trial_steps, over,
                                          on_trial, log, applied)
        steps += ran
        applied = applied_now or applied
        if ran:  # the best, or its median, may have changed: so do the others' shares
            for rest in trials:
                if rest.status in (SLOWER, STOPPED_EARLY):
                    _against(rest, best, trials)
                    on_trial(rest)
    for rest in queue:
        if rest.status == PENDING:
            rest.status, rest.reason = NOT_REACHED, stopped_by
            on_trial(rest)
    if keep_best and best is not None and applied != best.candidate and not ended and room(1):
        try:
            trainer.apply(best.candidate)  # the best is kept for the rest of the run
            log.append(f"applied the best: {best.candidate.describe()}")
        except Ended:
            log.append("the run ended before the best could be applied")
    return TuneResult(best, trials, steps, stopped_by, log)


def _ratios(trials: list[Trial], like: Candidate | None = None) -> list[float]:
    """measured / forecast of every measured trial (of the same kind as `like`, if given):
    the model's error on this run."""
    return [t.measured / t.forecast.seconds for t in trials
            if t.status == MEASURED and t.forecast.seconds > 0
            and (like is None or _kind(t.candidate) == _kind(like))]


def _kind(candidate: Candidate) -> tuple[str, bool]:
    """What the time model forecasts with different terms: where the chunks live (the
    copies) and whether activations are recomputed. Its error on one kind says little of
    its error on another."""
    return candidate.policy, candidate.activation_checkpointing


def model_error(trials: list[Trial]) -> float | None:
    """The median of measured / forecast over the measured trials; None before any."""
    ratios = _ratios(trials)
    return statistics.median(ratios) if ratios else None


def _corrected(trial: Trial, trials: list[Trial]) -> float:
    """The trial's forecast times the model's error so far: on trials of its kind where
    there are some, else on all (the median ratio)."""
    ratios = _ratios(trials, trial.candidate) or _ratios(trials)
    return trial.forecast.seconds * (statistics.median(ratios) if ratios else 1.0)


def _uncertainty(trial: Trial, trials: list[Trial]) -> float:
    """How much faster than its corrected forecast a candidate may still turn out: the
    spread of the model's error over the measured trials of the candidate's kind, never
    below MIN_UNCERTAINTY (the noise of a trial); until two trials, one of them of its
    kind, have been measured, the model's own accuracy target (UNCERTAINTY) or the spread
    over all trials, whichever is more."""
    ratios, alike = _ratios(trials), _ratios(trials, trial.candidate)
    if len(ratios) < 2 or not alike:
        return max(UNCERTAINTY, _spread(ratios))
    return max(MIN_UNCERTAINTY, _spread(alike))


def _spread(ratios: list[float]) -> float:
    """The farthest of `ratios` from their median, as a share of it."""
    if not ratios:
        return 0.0
    middle = statistics.median(ratios)
    return max(abs(r / middle - 1) for r in ratios)


def _promise(trial: Trial, trials: list[Trial]) -> float:
    """The fastest a candidate may still turn out, in seconds per step."""
    return _corrected(trial, trials) * (1 - _uncertainty(trial, trials))


def _close_to(best: Trial, trials: list[Trial]) -> list[Trial]:
    """The measured trials one trial each cannot tell from `best`, closest first: a median
    within the steps' own spread of the best's (either trial's, at least MIN_UNCERTAINTY)."""
    close = [t for t in trials if t.status == MEASURED and t is not best
             and t.measured <= best.measured * (1 + max(MIN_UNCERTAINTY, _spread(best.steps),
                                                        _spread(t.steps)))]
    return sorted(close, key=lambda t: t.measured)[:RUN_OFF]


def _run_off(best: Trial, trials: list[Trial], trainer: Trainer, trial_steps: int,
             stop: Callable[[], bool], on_trial: Callable[[Trial], None], log: list[str],
             applied: Candidate | None) -> tuple[int, Candidate | None, Trial]:
    """Measure `best` and the trials close to it again, the one applied now first; returns
    (steps of the run taken, the candidate applied last, the best on all their steps)."""
    close = _close_to(best, trials)
    if not close:
        return 0, None, best
    contest = sorted([best, *close], key=lambda t: t.candidate != applied)
    log.append("too close to tell: " + ", ".join(t.candidate.describe() for t in contest)
               + "; measured again")
    ran, last = 0, None
    for trial in contest:
        if stop():
            break
        changed = trial.candidate != applied  # the one the run has now needs no change
        try:
            if changed:
                trainer.apply(trial.candidate)
        except Ended:
            break
        except Refused as error:  # taken a moment ago: the run changed under it
            log.append(f"{trial.candidate.describe()}: refused: {error}")
            continue
        last = applied = trial.candidate
        trial.status = MEASURING
        on_trial(trial)
        before = _taken(trial)
        ended = False
        try:
            _settled_steps(trial, trainer, len(trial.steps) + trial_steps, stop, on_trial,
                           after_change=changed)
        except Ended:  # as if stopped: the steps it had are all it gets
            ended = True
        except Failed as error:
            ran += 1
            _fail(trial, error, log, on_trial)
            continue
        finally:
            ran += _taken(trial) - before
        trial.status = MEASURED
        trial.measured = statistics.median(trial.steps)
        log.append(f"{trial.candidate.describe()}: {trial.measured:.3f} s/step over "
                   f"{len(trial.steps)} steps")
        on_trial(trial)
        if ended:
            break
    measured = [t for t in contest if t.status == MEASURED]
    if not measured:
        return ran, last, best
    fastest = min(measured, key=lambda t: t.measured)
    alike = [t for t in measured if t.measured <= fastest.measured * (1 + ENOUGH)]
    kept = min(alike, key=lambda t: t.forecast.seconds)
    if kept is not fastest:
        log.append(f"{kept.candidate.describe()} within {ENOUGH:.0%} of "
                   f"{fastest.candidate.describe()} on all their steps: kept the one the "
                   f"model forecasts faster")
    return ran, last, kept


def _against(trial: Trial, best: Trial, trials: list[Trial]) -> None:
    """`trial.slower` and its reason against `best`: measured for a trial stopped early (its
    fastest settled step), its forecast corrected by `trials` for one not tried."""
    if trial.status == STOPPED_EARLY:
        trial.slower = min(trial.steps) / best.measured - 1
        trial.reason = (f"{trial.slower:.0%} slower than the best after "
                        f"{plural(len(trial.steps), 'step')}")
        return
    trial.slower = _corrected(trial, trials) / best.measured - 1.0
    trial.reason = (f"forecast {trial.slower:+.0%} against the best measured"
                    if trial.slower > -ENOUGH
                    else f"forecast within {ENOUGH:.0%} of the best measured")


def _fail(trial: Trial, error: Failed, log: list[str],
          on_trial: Callable[[Trial], None]) -> None:
    """Record that a step under `trial`'s setting failed, and why."""
    trial.status, trial.reason = FAILED, str(error)
    log.append(f"{trial.candidate.describe()}: failed: {error}")
    on_trial(trial)


def _taken(trial: Trial) -> int:
    """Steps of the run a trial has taken so far, the failing one aside."""
    return len(trial.steps) + trial.skipped


def _settled_steps(trial: Trial, trainer: Trainer, until: int, stop: Callable[[], bool],
                   on_trial: Callable[[Trial], None],
                   slower: Callable[[Trial], bool] = lambda trial: False, *,
                   after_change: bool = True) -> None:
    """Steps of the run under `trial`'s setting until it holds `until` settled steps,
    `stop()` says so, or `slower(trial)`; the step after a change (`after_change`: the
    setting was just applied) and any step that re-traced are skipped (Trial.skipped).
    Raises Failed."""
    while len(trial.steps) < until:
        if stop():
            break
        result = trainer.step()
        trial.skipped += result.earlier
        if after_change or result.retraced:
            after_change = False
            trial.skipped += 1
            continue
        trial.steps.append(result.seconds)
        on_trial(trial)
        if slower(trial):
            break


def _run_trial(trial: Trial, trainer: Trainer, best: Trial | None, trial_steps: int,
               stop: Callable[[], bool], on_trial: Callable[[Trial], None],
               log: list[str]) -> tuple[int, Candidate | None]:
    """Measure one candidate; returns (steps of the run taken, the candidate if applied)."""
    try:
        trainer.apply(trial.candidate)
    except Refused as error:
        trial.status, trial.reason = REFUSED, str(error)
        log.append(f"{trial.candidate.describe()}: refused: {error}")
        on_trial(trial)
        return 0, None
    trial.status = MEASURING
    on_trial(trial)

    def clearly_slower(trial: Trial) -> bool:
        return best is not None and min(trial.steps) > CLEARLY_SLOWER * best.measured

    try:
        _settled_steps(trial, trainer, trial_steps, stop, on_trial, clearly_slower)
    except Ended:
        raise  # not the setting's failure: the search ends (see search)
    except Failed as error:
        _fail(trial, error, log, on_trial)
        return _taken(trial) + 1, trial.candidate
    ran = _taken(trial)
    if trial.steps and clearly_slower(trial):
        trial.status = STOPPED_EARLY
        trial.measured = statistics.median(trial.steps)
        _against(trial, best, [])
        log.append(f"{trial.candidate.describe()}: {trial.reason}")
        on_trial(trial)
        return ran, trial.candidate
    if len(trial.steps) < trial_steps:  # stopped before its trial was over: no median
        trial.status = NOT_REACHED
        trial.reason = f"stopped after {len(trial.steps)} of {plural(trial_steps, 'step')}"
        on_trial(trial)
        return ran, trial.candidate
    trial.status = MEASURED
    trial.measured = statistics.median(trial.steps)
    log.append(f"{trial.candidate.describe()}: {trial.measured:.3f} s/step "
               f"(forecast {trial.forecast.seconds:.3f})")
    on_trial(trial)
    return ran, trial.candidate
