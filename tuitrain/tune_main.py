"""`tuitrain tune MODEL [run flags]`: the tuner's search (tuitrain.tune) on a real run.

The run starts as `tuitrain run --headless` would, and the search measures its candidates on
the run's own steps (tuitrain.tune_worker): a progress line per trial, a `{"trial": ...}`
metrics record per candidate, a `{"tuned": ...}` one and the run's `{"summary": ...}` last,
and, with --save-preset, the run's settings with the best setting, its header saying what
was measured and how it was found. The run stops when the search is done, or, with --steps
N, goes on with the best to step N (tuitrain.tune_run). Ctrl-C, SIGTERM and a reader of the
output that goes away stop it as they stop a headless run (tuitrain.stop_requests), with the
same exit statuses and its summary last in the metrics; a stopped tune saves no preset.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from tuitrain.closed_pipe import WatchedOutput
from tuitrain.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, UsageError
from tuitrain.events import Event, Failed, Finished, Log
from tuitrain.formatting import format_seconds
from tuitrain.run_summary import interrupted_line, ran_to_its_end
from tuitrain.settings import Settings
from tuitrain.stop_requests import Stopping, StopRequests
from tuitrain.tune import (
    DOES_NOT_FIT,
    MEASURED,
    MEASURING,
    MIN_TRIAL_STEPS,
    PENDING,
    Candidate,
    Trial,
    TuneResult,
    search,
)
from tuitrain.tune_run import RunEnd, RunSteps, check_tune_steps, run_length
from tuitrain.tune_setup import learn_from, trial_line

if TYPE_CHECKING:
    from engine.planning.calibration import Calibration
    from tuitrain.given import Given
    from tuitrain.tune_worker import WorkerTrainer
    from tuitrain.worker import ProcessWorker

PROG = "tuitrain"
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)h)?(?:(\d+(?:\.\d+)?)m)?(?:(\d+(?:\.\d+)?)s?)?")


def parse_duration(text: str) -> float:
    """Seconds in `90`, `90s`, `5m`, `1m30s`, `1h`; ValueError otherwise."""
    match = _DURATION.fullmatch(text.strip())
    if not text.strip() or match is None or not any(match.groups()):
        raise ValueError(f"{text!r} is not a duration (e.g. 90s, 5m, 1h)")
    hours, minutes, seconds = (float(g) if g else 0.0 for g in match.groups())
    total = hours * 3600 + minutes * 60 + seconds
    if total <= 0:
        raise ValueError(f"{text!r}: a duration must be above zero")
    return total


def add_tune_parser(commands, run_flags) -> argparse.ArgumentParser:
    """`tuitrain tune`: the model and every flag of `tuitrain run` (`run_flags`), and the
    search's own."""
    tune = commands.add_parser(
        "tune",
        help="find the fastest setting that fits, measured on the run's own steps",
        description="Start the run and search its settings (policy, margin, the split of "
        "its global batch into micro-batches, activation checkpointing) while it trains: "
        "the plan drops what does not fit, the time model orders the rest, and the most "
        "promising are measured on real steps at the run's global batch.",
    )
    tune.add_argument("model", nargs="?", metavar="MODEL", help="as for `tuitrain run`")
    tune.add_argument("--preset", metavar="FILE", help="tune the preset's settings")
    for flag in run_flags:
        if flag.name == "--steps":  # the run's length, as for `run`, but not its default
            flag = dataclasses.replace(flag, help=(
                "train N steps in all, the search's among them, then on with the best "
                "(default: stop when the search ends)"))
        flag.add_to(tune)
    tune.add_argument("--trial-steps", metavar="N", type=int, default=MIN_TRIAL_STEPS,
                      help=f"settled steps each trial measures (default and least "
                      f"{MIN_TRIAL_STEPS})")
    tune.add_argument("--time-limit", metavar="DURATION",
                      help="stop searching after this long (e.g. 90s, 5m), keeping the best")
    tune.add_argument("--save-preset", metavar="FILE", help="save the run with the best setting")
    tune.add_argument("--force", action="store_true",
                      help="let --save-preset replace an existing file")
    tune.set_defaults(command_parser=tune)
    return tune


def tune_command(
    args: argparse.Namespace, settings: Settings, given: Given, *, simulated: bool
) -> int:
    """Check the search's flags (UsageError), then tune; `given`: how the user gave the
    settings, for what a mistake names."""
    from tuitrain.run_checks import check_runnable
    from tuitrain.run_preset import save_target

    if args.trial_steps < MIN_TRIAL_STEPS:  # a median of fewer is one step's noise
        raise UsageError(f"--trial-steps: must be at least {MIN_TRIAL_STEPS} (got "
                         f"{args.trial_steps})")
    # --steps N is the run's length, as for `tuitrain run`; a preset's steps are its run's.
    steps = settings.training.steps if args.steps is not None else None
    after = check_tune_steps(settings, steps, args.trial_steps)
    try:
        limit = parse_duration(args.time_limit) if args.time_limit is not None else None
    except ValueError as error:
        raise UsageError(f"--time-limit: {error}") from None
    args.headless = True  # a tune has no app: its preset is saved as a headless run's
    save_to = save_target(args, settings.logging.metrics)
    check_runnable(settings, given)
    return tune_main(settings, trial_steps=args.trial_steps, time_limit=limit, steps=steps,
                     after=after, save_to=save_to, overwrite=args.force, simulated=simulated)


def tune_main(settings: Settings, *, trial_steps: int, time_limit: float | None,
              save_to: Path | None, overwrite: bool, simulated: bool,
              steps: int | None = None, after: int = 0,
              out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Tune `settings`' run; `steps`: its length (--steps N, searched and then trained
    with the best), None: it ends with the search; `after`: the step its checkpoint was
    saved after (--resume; check_tune_steps), where the search begins."""
    # Whoever reads the output may go (`| head`): that stops the run, as it would a
    # headless one, and what is still said goes nowhere rather than raising mid-way.
    out, err = WatchedOutput(out or sys.stdout), WatchedOutput(err or sys.stderr)
    from tuitrain.tune_setup import run_budget, tune_forecaster, tune_space

    budget = run_budget(settings, simulated)
    forecast, cal = tune_forecaster(
        settings, simulated=simulated, say=lambda line: print(line, file=err, flush=True))
    space = tune_space(settings, device_budget=budget)
    fitting = [c for c in space if forecast(c).fits]
    if not fitting:
        reasons = sorted({forecast(c).reason for c in space})
        raise UsageError(f"no setting of {settings.model} fits: {'; '.join(reasons)}")
    last = run_length(steps, settings_steps=settings.training.steps, fitting=len(fitting),
                      trial_steps=trial_steps)
    from tuitrain.presets import merge
    from tuitrain.tune_setup import start_fitting

    start, moved = start_fitting(settings, fitting, forecast)
    if moved is not None:
        t = settings.training
        print(f"{t.batch_size} x {t.grad_accum} does not fit; the run starts at "
              f"{moved.describe()}, the fastest forecast that fits", file=err, flush=True)
    run = merge(start, {"training.steps": last})
    return _tune(run, settings, space, forecast, budget=budget, trial_steps=trial_steps,
                 time_limit=time_limit, goes_on=steps is not None, after=after,
                 save_to=save_to, overwrite=overwrite, cal=cal, out=out, err=err)


def _tune(run: Settings, settings: Settings, space: list[Candidate], forecast,
          *, budget: int, trial_steps: int, time_limit: float | None, goes_on: bool,
          after: int, save_to: Path | None, overwrite: bool, cal: Calibration,
          out: WatchedOutput, err: WatchedOutput) -> int:
    """The search on `run`; `goes_on`: the run trains on with the best to its last step
    (--steps N), else it is stopped when the search ends. A stop request (tuitrain.
    stop_requests) leaves the search where it is: no `tuned` record, no preset."""
    from tuitrain.metrics import MetricsWriter
    from tuitrain.tune_worker import Stopped
    from tuitrain.worker import ProcessWorker

    worker = ProcessWorker(settings=run)
    failure: list[Failed] = []
    seen = RunSteps()
    requests = StopRequests((out, err))
    stopping = Stopping(requests, worker, say=lambda line: print(line, file=err, flush=True))

    def on_event(event: Event) -> None:
        seen.see(event)
        if isinstance(event, Failed):
            failure.append(event)
        elif isinstance(event, Log) and event.level != "info":
            print(f"{PROG}: {event.level}: {event.message}", file=err, flush=True)

    metrics = MetricsWriter(run.logging.metrics) if run.logging.metrics else None
    tokens = run.training.batch_size * run.training.grad_accum * run.training.seq_len
    on_trial = TrialReports(len(space), tokens, out, metrics.write if metrics else None)
    result: TuneResult | None = None
    record: dict | None = None
    last = run.training.steps
    ending = RunEnd(worker, stopping, seen, on_event, last_step=last)

    with requests.catching():
        worker.start()
        try:
            result, trainer = _search(worker, run, space, forecast, budget=budget,
                                      trial_steps=trial_steps, time_limit=time_limit,
                                      goes_on=goes_on, after=after, on_event=on_event,
                                      on_trial=on_trial, stopped=ending.stopped, out=out)
            if result is not None and result.best is not None:
                assert trainer is not None
                # The run goes on with the best where it has steps left after the search
                # took it; those before it are the search's. Else all the run made, once
                # it ended.
                held = (goes_on and trainer.holds(result.best.candidate)
                        and trainer.free_from <= last)
                if not held and goes_on:
                    ending.wait()
                elif not held:
                    ending.end()
                searched = seen.before(trainer.free_from) if held else seen.total
                record = tuned_record(result, tokens, cal.fingerprint, steps=searched)
                if metrics is not None:
                    metrics.write({"tuned": record})
                _say_tuned(result, searched, cal, out)
                if held:
                    print(f"training on with it to step {last}", file=out, flush=True)
                    if ending.wait() and isinstance(seen.end, Finished):
                        print(f"done: {seen.total} steps, the last {seen.total - searched} "
                              f"with it", file=out, flush=True)
        except Stopped:
            pass  # the search is left where it was; the run ends below, as asked
        finally:
            ending.end()
            if metrics is not None:
                metrics.close()
            if problem := seen.append_summary():
                print(f"{PROG}: {problem}", file=err)
    summary = seen.end.summary if isinstance(seen.end, Finished) else None
    # A request as the run was ending found it finished: so it ends (its summary says so).
    if (status := stopping.status()) is not None and not ran_to_its_end(summary):
        if isinstance(seen.end, Failed):  # not stopped within the wait, or failed first
            _failed(failure, worker, err)
        # A search that was over has its result, whatever became of the training after it.
        if save_to is not None and record is not None:
            _save(settings, save_to, record, overwrite=overwrite, out=out, err=err)
        unsaved = (f"; no preset saved to {save_to} (the search was cut short)"
                   if save_to is not None and record is None else "")
        print(interrupted_line(run, seen.latest, now=requests.count > 1, summary=summary)
              + unsaved, file=err, flush=True)
        return status
    if result is None or result.best is None:
        if failure or result is None:
            return _failed(failure, worker, err)
        print(f"{PROG}: no setting could be measured ({result.stopped_by})", file=err)
        return EXIT_FAILED
    if goes_on and isinstance(seen.end, Failed):  # it failed after the search
        return _failed(failure, worker, err)
    if save_to is not None and record is not None:
        return _save(settings, save_to, record, overwrite=overwrite, out=out, err=err)
    return EXIT_OK


def _say_tuned(result: TuneResult, searched: int, cal: Calibration, out: TextIO) -> None:
    best = result.best
    assert best is not None and best.measured is not None
    if learned := learn_from(result, cal):
        print(f"time model: {learned}", file=out, flush=True)
    print(f"tuned in {searched} steps ({result.stopped_by}): {best.candidate.describe()}, "
          f"{format_seconds(best.measured)}/step, forecast "
          f"{format_seconds(best.forecast.seconds)}", file=out, flush=True)


def _search(worker: ProcessWorker, run: Settings, space: list[Candidate], forecast, *,
            budget: int, trial_steps: int, time_limit: float | None, goes_on: bool,
            after: int, on_event, on_trial, stopped: Callable[[], bool],
            out: TextIO) -> tuple[TuneResult | None, WorkerTrainer | None]:
    """The search on the started worker's run, and its trainer; (None, None) when the run
    ended before it began, or was asked to stop; `stopped`: asked before each wait for the
    worker, True leaves the search where it is (tuitrain.tune_worker.Stopped)."""
    from tuitrain.tune_worker import WorkerTrainer, client_events, wait_for_start

    if not wait_for_start(worker, on_event, stopped=stopped) or worker.started is None:
        return None, None
    used = worker.started.settings.get("engine", {})
    trainer = WorkerTrainer(
        worker.send, client_events(worker, stopped), batch_size=run.training.batch_size,
        grad_accum=run.training.grad_accum,
        checkpointing=run.training.activation_checkpointing,
        policy=used.get("policy", run.engine.policy),
        margin_ratio=used.get("margin_ratio", run.engine.margin_ratio),
        device_budget=budget, on_event=on_event, last_step=run.training.steps, after=after)
    last = run.training.steps
    within = f", within steps {after + 1} to {last}" if after else f", within {last} steps"
    print(f"tuning {run.model}: {len(space)} settings, {trial_steps} measured steps a trial"
          + (f", at most {format_seconds(time_limit)}" if time_limit else "")
          + (within if goes_on else ""),
          file=out, flush=True)
    result = search(space, forecast, trainer, trial_steps=trial_steps, time_limit=time_limit,
                    on_trial=on_trial, steps_left=trainer.steps_left, keep_best=goes_on)
    return result, trainer


class TrialReports:
    """What `tuitrain tune` says of each candidate: a progress line on `out` and a
    `{"trial": ...}` record once it is decided; then, for one measured again beside the
    best, a line and a record with `"again": true` (the median of all its steps), and for
    one whose share against the best changed when the best or its median did (the search's
    run-off), a record with `"revised": true`, so that every candidate's last record says
    what the search's final table says."""

    def __init__(self, total: int, tokens: int, out: TextIO,
                 write: Callable[[dict], None] | None) -> None:
        self.total, self.tokens, self.out, self.write = total, tokens, out, write
        self.reported: dict[int, tuple[int, str | None]] = {}  # settled steps, reason

    def __call__(self, trial: Trial) -> None:
        if trial.status in (PENDING, MEASURING):
            return
        then = self.reported.get(id(trial))
        self.reported[id(trial)] = (len(trial.steps), trial.reason)
        if then is None:
            print(f"trial {len(self.reported)}/{self.total}: {trial_line(trial)}",
                  file=self.out, flush=True)
            self._record(trial)
        elif trial.status == MEASURED and len(trial.steps) > then[0]:
            print(f"measured again: {trial_line(trial)}, {len(trial.steps)} steps",
                  file=self.out, flush=True)
            self._record(trial, again=True)
        elif trial.reason != then[1]:
            self._record(trial, revised=True)

    def _record(self, trial: Trial, **flag: bool) -> None:
        if self.write is not None:
            self.write({"trial": {**trial_record(trial, self.tokens), **flag}})


def trial_record(trial: Trial, tokens: int) -> dict:
    """A candidate as the metrics file holds it: its settings, the forecast, what was
    measured, or why it was not."""
    record: dict = {"settings": trial.candidate.settings(), "status": trial.status,
                    "forecast_seconds": trial.forecast.seconds if trial.forecast.fits else None}
    if trial.reason:
        record["reason"] = trial.reason
    if trial.measured is not None:
        record["measured_seconds"] = trial.measured
        record["tokens_per_second"] = tokens / trial.measured if trial.measured > 0 else None
        record["settled_steps"] = len(trial.steps)
    return record


def tuned_record(result: TuneResult, tokens: int, fingerprint: str, *, steps: int) -> dict:
    """The search's result as the metrics file holds it; `steps`: the run's steps it took."""
    best = result.best
    assert best is not None and best.measured is not None
    tried = sum(t.tried for t in result.trials)
    return {"settings": best.candidate.settings(), "measured_seconds": best.measured,
            "tokens_per_second": tokens / best.measured if best.measured > 0 else None,
            "settled_steps": len(best.steps), "forecast_seconds": best.forecast.seconds,
            "steps": steps, "candidates": len(result.trials), "tried": tried,
            "does_not_fit": sum(t.status == DOES_NOT_FIT for t in result.trials),
            "stopped_by": result.stopped_by, "machine": fingerprint, "log": result.log}


def _save(settings: Settings, path: Path, record: dict, *, overwrite: bool,
          out: TextIO, err: TextIO) -> int:
    from tuitrain.presets import merge, run_command, save_preset

    chosen = record["settings"]
    if settings.engine.device_budget is None:  # the run's own: not pinned by the preset
        chosen = {**chosen, "engine": {k: v for k, v in chosen["engine"].items()
                                       if k != "device_budget"}}
    tuned = merge(settings, chosen)
    measured = {"step_seconds": record["measured_seconds"],
                "tokens_per_second": record["tokens_per_second"],
                "settled_steps": record["settled_steps"],
                "forecast": f"{format_seconds(record['forecast_seconds'])}/step",
                "tuned on machine": record["machine"],
                "search": f"{record['tried']} of {record['candidates']} settings tried in "
                          f"{record['steps']} steps ({record['stopped_by']}): "
                          + "; ".join(record["log"])}
    try:
        save_preset(tuned, path, command=run_command(str(path), headless=True),
                    measured=measured, overwrite=overwrite)
    except FileExistsError:
        print(f"{PROG}: {path} appeared during the tune; preset not saved", file=err)
        return EXIT_FAILED
    except OSError as error:
        print(f"{PROG}: preset not saved to {path}: {error.strerror}", file=err)
        return EXIT_FAILED
    print(f"preset saved to {path}", file=out)
    return EXIT_OK


def _failed(failure: list[Failed], worker, err: TextIO) -> int:
    event = failure[-1] if failure else worker.result
    reason = getattr(event, "reason", "the run ended before the search")
    if isinstance(event, Failed) and event.exitcode == EXIT_BAD_INPUT:
        print(f"{PROG}: error: {reason}", file=err)
        return EXIT_BAD_INPUT
    print(f"{PROG}: the run failed: {reason}", file=err)
    if worker.log_path:
        print(f"{PROG}: worker log: {worker.log_path}", file=err)
    return EXIT_FAILED
