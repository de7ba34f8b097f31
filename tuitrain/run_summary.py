"""A run's summary in words: how it ended, its loss and held-out loss, its peaks, and what
each setting it ran under achieved (tuitrain.trials), from the worker's Finished summary.

The app ends a run with these lines; they use the trials' words for a pace ("median of N
settled steps"), so no second definition of a rate appears beside it. A run that writes
metrics ends them with its summary (`record_summary`), whichever UI started it. A worker
ended before it could give its summary (a second Ctrl-C) has one made for it from the steps
it reported (`StepTally`), so its metrics end the same way.
"""

from __future__ import annotations

import os
from typing import Any

from engine.telemetry import StepStats
from tuitrain.checkpoint_folder import newest_after_a_kill
from tuitrain.events import Eval
from tuitrain.formatting import format_seconds, format_size
from tuitrain.settings import Settings
from tuitrain.trials import Trial, append_summary, summary_lines


def ended_line(summary: dict) -> str:
    """ "finished: 200 steps, 102,400 tokens in 1m54s" or "stopped after step 4 of 200: ..."."""
    steps, planned = summary.get("steps", 0), summary.get("planned_steps")
    head = (
        f"stopped after step {summary.get('last_step', steps)} of {planned}"
        if summary.get("stopped") and planned
        else "finished"
    )
    done = f"{steps} step{'' if steps == 1 else 's'}, {summary.get('tokens', 0):,} tokens"
    if summary.get("seconds") is not None:
        done += f" in {format_seconds(summary['seconds'])}"
    return f"{head}: {done}"


def run_summary_lines(summary: dict, rows: list[Trial]) -> list[str]:
    """The run's summary, one fact a line (the trials' lines last)."""
    lines = [ended_line(summary)]
    losses = []
    if summary.get("final_loss") is not None:
        losses.append(f"final loss {summary['final_loss']:.4f}")
    if summary.get("first_step_seconds") is not None:
        losses.append(f"first step {format_seconds(summary['first_step_seconds'])}")
    if losses:
        lines.append("  " + ", ".join(losses))
    if summary.get("eval_loss") is not None:
        lines.append("  " + held_out(summary))
    if peaks := peaks_line(summary):
        lines.append("  " + peaks)
    lines += summary_lines(rows)
    if summary.get("metrics"):
        lines.append(f"  metrics  {summary['metrics']}")
    return lines


def ran_to_its_end(summary: dict | None) -> bool:
    """Whether `summary`, a run's, says it made every step it was to: a stop asked for as it
    ended found it finished, and it ends as finished."""
    return summary is not None and not summary.get("stopped")


def interrupted_line(settings: Settings, step: int, *, now: bool,
                     summary: dict | None = None) -> str:
    """The last line of a run stopped before its end, for the terminal: the step it stopped
    after and where its metrics are. `now` when its worker was ended at once (a second
    Ctrl-C, SIGTERM): the step under way was not kept, nor a checkpoint it was writing,
    whose temporary folder goes here, so the line names the newest complete one, the one
    `--resume` takes. `summary`, the run's, if one came: one without a metrics file says
    the worker was stopped before it began the file (ProcessWorker's report of a run it
    ended), which the line must not send the user to. The headless runner, the tuner and
    the app end a run so stopped alike."""
    if summary is not None:  # what the run says of itself, whatever was asked of it
        now = bool(summary.get("stopped_now"))
    if now and not step:
        head = "stopped before its first step; "
    elif now:
        head = f"stopped now after step {step}: the step under way was not kept"
        if settings.checkpoint.dir is not None:
            newest = newest_after_a_kill(settings.checkpoint.dir)
            head += (f"; the newest checkpoint is {newest}" if newest
                     else "; no checkpoint was written")
        head += "; "
    else:
        head = f"interrupted after step {step}; "
    where = settings.logging.metrics
    if not where:
        return head + "no metrics file was asked for"
    if summary is not None and not summary.get("metrics"):
        return head + f"nothing was written to {where}"
    return head + f"metrics in {where}"


def record_summary(summary: dict, rows: list[Trial]) -> str | None:
    """Append the run's summary and its trials to its metrics file, the file's last line,
    when the run writes one: the headless runner and the app end a run alike, so
    `tuitrain attach FILE` shows it as it ended. Returns the line to show when the file
    cannot be written (the run itself went well), else None."""
    if not summary.get("metrics"):
        return None
    try:
        _end_last_line(summary["metrics"])
        append_summary(summary["metrics"], summary, rows)
    except ValueError as error:
        return f"summary not added to the metrics: {error}"
    return None


def _end_last_line(path: str) -> None:
    """End the file's last line if it has no newline: a worker ended at once may have been
    writing a step's line, and the summary must be a line of its own, not the end of that
    one (readers skip a line that is not JSON)."""
    try:
        with open(path, "rb") as file:
            if file.seek(0, os.SEEK_END) == 0:
                return
            file.seek(-1, os.SEEK_END)
            if file.read(1) == b"\n":
                return
        with open(path, "ab") as file:
            file.write(b"\n")
    except OSError:
        pass  # append_summary says why the file cannot be written


class StepTally:
    """What the steps (and evaluations) a worker reported add up to, kept as they come: the
    summary of a run whose worker was ended before it gave its own, in the same shape as
    the worker's (tuitrain.training_run), its disk figures the steps' alone."""

    def __init__(self) -> None:
        self.steps = 0
        self.last_step: int | None = None  # unknown until a step is reported (a resumed run)
        self.tokens = 0
        self.first_step_seconds: float | None = None
        self.final_loss: float | None = None
        self.peak_device = self.peak_host = 0
        self.disk_read = self.disk_written = 0
        self.last_eval: Eval | None = None

    def record(self, stats: StepStats) -> None:
        self.steps += 1
        self.last_step = stats.step
        self.tokens += stats.tokens
        if self.first_step_seconds is None:
            self.first_step_seconds = stats.seconds
        self.final_loss = stats.loss
        self.peak_device = max(self.peak_device, stats.memory.device_peak)
        self.peak_host = max(self.peak_host, stats.memory.process_rss)
        self.disk_read += stats.bytes_disk_read
        self.disk_written += stats.bytes_disk_written

    def summary(self, settings: Any, *, seconds: float, log: str) -> dict:
        """The summary of the run of `settings` (tuitrain.settings.Settings) as far as its
        steps went, `seconds` after it started, with "stopped_now": it did not end by
        itself."""
        planned = settings.training.steps
        summary: dict = {
            "steps": self.steps,
            "planned_steps": planned,
            "stopped": self.last_step is None or self.last_step < planned,
            "stopped_now": True,
            "tokens": self.tokens,
            "seconds": seconds,
            "first_step_seconds": self.first_step_seconds,
            "final_loss": self.final_loss,
            "peak_device_bytes": self.peak_device,
            "peak_host_bytes": self.peak_host if self.steps else None,
            "bytes_disk_read": self.disk_read,
            "bytes_disk_written": self.disk_written,
            "metrics": settings.logging.metrics,
            "log": log,
        }
        if self.last_step is not None:
            summary["last_step"] = self.last_step
        if settings.data.eval_path or settings.data.eval_fraction:
            e = self.last_eval
            summary.update(eval_step=e.step if e else None, eval_loss=e.loss if e else None,
                           eval_perplexity=e.perplexity if e else None,
                           eval_tokens=e.tokens if e else None)
        return summary


def held_out(summary: dict) -> str:
    """The latest evaluation: "held-out loss 3.7140, perplexity 41.01 after step 200"."""
    return (
        f"held-out loss {summary['eval_loss']:.4f}, perplexity "
        f"{summary['eval_perplexity']:.2f} after step {summary['eval_step']}"
    )


def peaks_line(summary: dict) -> str:
    """ "peak device 2.0 GiB, peak host RSS 3.0 GiB": the highest of the run's steps, as
    the trials and a saved preset give them (the host's is each step's VmHWM); "" before a
    step ran."""
    peaks = []
    if summary.get("peak_device_bytes"):
        peaks.append(f"peak device {format_size(summary['peak_device_bytes'])}")
    if summary.get("peak_host_bytes"):
        peaks.append(f"peak host RSS {format_size(summary['peak_host_bytes'])}")
    return ", ".join(peaks)
