"""The headless runner: the same worker as the TUI, with a progress line instead of a screen.

For servers, CI and cluster jobs. On a terminal a single line redraws in place; otherwise
(a log file, a pipe) plain lines are printed now and then, so logs stay readable. A reader
of the output that goes away (`| head -3`, or a `| tee` that a Ctrl-C ended first) stops the
run as Ctrl-C does, as SIGPIPE would end a Unix tool: the run still ends its metrics with
its summary, and nothing more is written to the output that went.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Callable
from typing import TextIO

from engine.telemetry import StepStats
from tuitrain import ranks
from tuitrain.closed_pipe import WatchedOutput
from tuitrain.errors import (
    EXIT_BAD_INPUT,
    EXIT_CLOSED_PIPE,
    EXIT_FAILED,
    EXIT_OK,
)
from tuitrain.events import Eval, Event, Failed, Finished, Log, Rejected, Started, Step
from tuitrain.formatting import (
    format_count,
    format_rate,
    format_seconds,
    format_size,
    format_trained,
    plural,
)
from tuitrain.run_preset import PresetPace
from tuitrain.run_summary import (
    held_out,
    interrupted_line,
    peaks_line,
    ran_to_its_end,
    record_summary,
)
from tuitrain.served import serve
from tuitrain.settings import Settings
from tuitrain.stop_requests import Stopping, StopRequests, repeats_the_stop
from tuitrain.trials import TrialBook, summary_lines
from tuitrain.worker import ProcessWorker
from tuitrain.worker_log import rank_log_path

WAIT_SECONDS = 0.1  # longest sleep between looks at the worker
REDRAW_SECONDS = 0.1  # a terminal progress line is redrawn at most this often
PLAIN_LINE_SECONDS = 2.0  # without a terminal, at least this long between progress lines
PLAIN_EVERY_STEP = 50  # runs this short print every step
BAR_WIDTH = 24
# Columns a progress line leaves free at its end: room for the terminal's `^C` echo, which
# would otherwise wrap the line and break its redraw in place.
ECHO_ROOM = 3
# Under torchrun, a rank other than 0 that found bad input waits this long before it ends,
# so that rank 0 (whose line it is to print) is not stopped before it has printed it.
QUIET_RANK_GRACE_SECONDS = 2.0


def run_headless(
    settings: Settings,
    *,
    out: TextIO = sys.stdout,
    err: TextIO = sys.stderr,
    log_path: str | None = None,
    pace: PresetPace | None = None,
    on_started: Callable[[Started], None] | None = None,
) -> int:
    """Train `settings` without a UI; returns the process exit status.

    Args:
        settings: the run, already validated (presets and flags merged).
        out: progress, the settings block and the summary.
        err: failures and warnings.
        log_path: the worker's log file; default a new file under the temporary folder.
        pace: a tuned preset's step time, to say once if the run's is far from it.
        on_started: told the worker's Started event, whose settings are those the run
            uses (the policy the plan chose, the precision and budget resolved).

    Returns 0 when training finished, 1 when it failed (the reason and the log are named on
    `err`), 2 for bad input found by the worker (one line), 130 after Ctrl-C (the worker is
    stopped cleanly first; a second Ctrl-C stops it at once, keeping nothing of the step
    under way), 141 when it stopped because the reader of `out` or `err` went away.

    Under torchrun (tuitrain.ranks) every rank runs this: rank 0 prints the progress and
    the summary and writes the metrics; the others print only their failures, each line
    starting with their rank, and every rank's worker logs to a file named after its rank.
    """
    try:
        place = ranks.from_environment()
    except ValueError as error:
        err.write(f"tuitrain: error: {error}\n")
        return EXIT_BAD_INPUT
    outputs = (WatchedOutput(out), WatchedOutput(err))
    out, err = outputs
    own_log = False  # a log named here goes after a clean end, as a default one does
    if place.parallel:
        if log_path is None:
            log_path, own_log = str(rank_log_path(place.rank)), True
        if not place.leader:
            from tuitrain.presets import merge

            settings = merge(settings, {"logging.metrics": None})  # rank 0's to write
            out, err = _Discard(), _Prefixed(err, f"rank {place.rank}: ")
    worker = ProcessWorker(settings=settings, log_path=log_path, own_log=own_log)
    # Rank 0 speaks for the run: viewers attach to it (tuitrain.served).
    served = serve(worker, settings, err=err) if place.leader else None
    worker = served or worker
    report = _Report(settings=settings, out=out, err=err, log_path=str(worker.log_path))
    report.pace = pace
    report.on_started = on_started
    # Rank 0 decides when the ranks stop (a Stop it is sent ends every rank's run).
    interrupts = StopRequests(outputs if place.leader else ())
    code: int | None = None
    with interrupts.catching():
        worker.start()
        report.starting(tentative=True)
        stopping = Stopping(interrupts, worker, report.say_err if place.leader else _quiet)
        try:
            code = _follow(worker, report, stopping)
        finally:  # a rank its launcher ended: the launcher keeps or removes its log
            stopping.end(keep_log=place.parallel and interrupts.terminated)
        for event in worker.poll():  # what came while stopping: the summary, or why not
            outcome = report.handle(event)
            code = outcome if code is None else code
        report.close_line()
        # Inside to the last line: a Ctrl-C that comes as the run ends ends nothing more.
        if served is not None:
            served.close()
        # A signal as the run was ending found it finished: so it ends (its summary says so).
        if interrupts.count and not ran_to_its_end(report.summary):
            if place.leader:  # rank 0 speaks for the ranks
                report.interrupted(now=interrupts.count > 1)
            return interrupts.status
        if interrupts.reader_gone and report.ended_early:
            report.interrupted()
            return EXIT_CLOSED_PIPE
        return EXIT_FAILED if code is None else code


def _quiet(line: str) -> None:
    """What a rank other than 0 says of a stop: nothing (rank 0 says it)."""


def _follow(worker: ProcessWorker, report: _Report, stopping: Stopping) -> int | None:
    """Relay events until the run ends or the user interrupts; returns the exit status."""
    while True:
        worker.wait(WAIT_SECONDS)
        if stopping.requests.count > 1:  # before the events: a worker SIGTERM ended is no
            return None  # failure
        for event in worker.poll():
            if not (isinstance(event, Failed) and event.exitcode == EXIT_BAD_INPUT):
                report.starting()
            if stopping.asked and repeats_the_stop(event):
                continue
            code = report.handle(event)
            if code is not None:
                return code
        # A reader gone after the last step stops nothing: the run is ending as it is.
        if stopping.look(reader_matters=not report.trained_all):
            return None


class _Report:
    """Turns events into what a person reading the terminal or the job log wants to see."""

    def __init__(self, *, settings: Settings, out: TextIO, err: TextIO, log_path: str) -> None:
        self.settings = settings
        self.log_path = log_path
        self.out = out
        self.err = err
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.total = settings.training.steps
        self.latest: StepStats | None = None
        self.trials = TrialBook()  # one per setting; a headless run keeps its first
        self.line_open = False  # a progress line is drawn and not yet ended
        self.last_drawn = 0.0
        self.said_starting = False
        self.drawn = ""  # the progress line drawn in place, while line_open
        self.pace: PresetPace | None = None
        self.on_started: Callable[[Started], None] | None = None
        self.ended_early = False  # the run's summary says it stopped before its last step
        self.summary: dict | None = None  # the run's, once it came

    def starting(self, *, tentative: bool = False) -> None:
        """Say, once, that the run is starting and where its worker logs.

        The worker refuses bad input it alone can check (a budget below the working set)
        before it says anything else, and that refusal is then the one line shown. So the
        line waits for the worker's first word; on a terminal it is drawn at once
        (`tentative`) in place, as a progress line is, and wiped if a refusal comes.
        """
        if self.said_starting:
            return
        text = f"starting {self.settings.model} (worker log: {self.log_path})"
        if not tentative:
            self.said_starting = True
            if not self.line_open:
                self.say(text)
        elif self.tty:
            self.out.write(text + "\x1b[K")
            self.out.flush()
            self.line_open, self.drawn = True, text

    def wipe_line(self) -> None:
        """Take back a line drawn in place, leaving the cursor at the start of its row."""
        if self.line_open:
            self.out.write("\r\x1b[K")
            self.out.flush()
            self.line_open = False

    def handle(self, event: Event) -> int | None:
        """Show one event; returns the exit status once the run has ended."""
        if isinstance(event, Step):
            self.step(event.stats)
            if self.pace is not None and (line := self.pace.record(event.stats)):
                self.say_err(f"warning: {line}")
        elif isinstance(event, Started):
            self.started(event)
            if self.on_started is not None:
                self.on_started(event)
        elif isinstance(event, Eval):
            self.say(
                f"eval after step {event.step}: loss {event.loss:.4f}, perplexity "
                f"{event.perplexity:.2f} on {event.tokens:,} held-out tokens "
                f"({event.seconds:.1f} s)"
            )
        elif isinstance(event, Log):
            if event.level == "info":
                self.say(f"  {event.message}")
            else:
                self.say_err(f"{event.level}: {event.message}")
        elif isinstance(event, Rejected) and not event.too_late:  # a Stop after the end: news
            self.say_err(f"rejected: {event.reason}")  # of nothing (only Stop is ever sent)
        elif isinstance(event, Finished):
            self.finished(event.summary)
            return EXIT_OK
        elif isinstance(event, Failed):
            return self.failed(event)
        return None

    # --- events ----------------------------------------------------------------------

    def started(self, event: Started) -> None:
        used = event.settings
        e, t, d, g = used["engine"], used["training"], used["data"], used["logging"]
        device_budget = e["device_budget"] or "whole device"
        accumulated = (
            f" in {t['grad_accum']} micro-batches" if t.get("grad_accum", 1) > 1 else ""
        )
        schedule = t.get("lr_schedule", "constant")
        if t.get("warmup_steps"):
            schedule += f" after {plural(t['warmup_steps'], 'warm-up step')}"
        sequences = t["batch_size"] * t.get("grad_accum", 1)
        # The labels make a column as wide as the longest, "training", and one space.
        lines = [
            f"{event.model}: {format_count(event.parameters)} parameters"
            f"{format_trained(event.parameters, event.trainable)} in {len(event.chunks)} "
            f"chunks on {event.device}",
            f"  engine   policy {e['policy']}, margin {e['margin_ratio']:.2f}, "
            f"budget {device_budget}, precision {e['precision']}"
            + (f", host budget {e['host_budget']} (the rest on disk under "
               f"{e.get('disk_dir') or 'the user cache folder'})" if e.get("host_budget") else ""),
            f"  training {plural(t['steps'], 'step')} of {sequences} x "
            f"{t['seq_len']} tokens{accumulated}, lr {t['lr']:g} {schedule}, seed {t['seed']}"
            + (", activation checkpointing" if t.get("activation_checkpointing") else ""),
            f"  data     {d['path'] or 'built-in corpus'}",
            *self._evaluation(t, d),
            f"  metrics  {g['metrics'] or 'not written (--metrics FILE.jsonl)'}",
            f"  worker   pid {event.pid}, log {event.log_path}",
        ]
        self.say("\n".join(lines))

    @staticmethod
    def _evaluation(training: dict, data: dict) -> list[str]:
        """The settings block's line about held-out text, if the run has any."""
        if data.get("eval_path"):
            held_out = data["eval_path"]
        elif data.get("eval_fraction"):
            held_out = f"{data['eval_fraction']:g} of the data's documents held out"
        else:
            return []
        every = training.get("eval_every")
        when = (f"every {plural(every, 'step')} and after the last" if every
                else "after the last step")
        sequences = training["eval_batches"] * training["batch_size"]
        sequences *= training.get("grad_accum", 1)
        return [f"  eval     {held_out}; up to {sequences} sequences, {when}"]

    def step(self, stats: StepStats) -> None:
        self.latest = stats
        self.trials.record(stats)
        now = time.monotonic()
        last = stats.step >= self.total
        if self.tty:
            if last or now - self.last_drawn >= REDRAW_SECONDS or stats.step == 1:
                # Fit to the terminal's width: a wrapped line cannot be redrawn in place.
                line = self._progress(stats, bar=True, width=_width(self.out) - ECHO_ROOM)
                self.out.write("\r" + line + "\x1b[K")
                self.out.flush()
                self.line_open = True
                self.drawn = line
                self.last_drawn = now
        elif (
            self.total <= PLAIN_EVERY_STEP
            or stats.step == 1
            or last
            or now - self.last_drawn >= PLAIN_LINE_SECONDS
        ):
            self.say(self._progress(stats, bar=False, width=None))
            self.last_drawn = now

    @property
    def trained_all(self) -> bool:
        """Whether the run's last step has been reported."""
        return self.latest is not None and self.latest.step >= self.settings.training.steps

    def finished(self, summary: dict) -> None:
        self.summary, self.ended_early = summary, bool(summary.get("stopped"))
        stopped = " (stopped early)" if self.ended_early else ""
        lines = [
            f"done{stopped}: {plural(summary['steps'], 'step')}, {summary['tokens']:,} tokens "
            f"in {format_seconds(summary['seconds'])}",
        ]
        # The pace is the trials' (medians of settled steps), printed below: one definition,
        # the one the app's table and a saved preset's header use.
        if summary.get("first_step_seconds") is not None:
            lines.append(
                f"  first step {format_seconds(summary['first_step_seconds'])} (it records "
                f"the order chunks are used in), final loss {summary['final_loss']:.4f}"
            )
        if summary.get("eval_loss") is not None:
            lines.append(f"  {held_out(summary)}")
        if peaks := peaks_line(summary):
            lines.append(f"  {peaks}")
        lines += summary_lines(self.trials.rows())
        if summary.get("metrics"):
            lines.append(f"  metrics  {summary['metrics']}")
        if problem := record_summary(summary, self.trials.rows()):
            self.say_err(problem)
        self.say("\n".join(lines))

    def failed(self, event: Failed) -> int:
        if event.exitcode == EXIT_BAD_INPUT and isinstance(self.err, _Prefixed):
            # Every rank checks the same input: rank 0 says it, once. This rank waits a
            # moment before it ends, as the launcher stops every rank when one ends badly.
            time.sleep(QUIET_RANK_GRACE_SECONDS)
            return EXIT_BAD_INPUT
        if event.exitcode == EXIT_BAD_INPUT:
            if not self.said_starting:
                self.wipe_line()
            self.say_err(f"tuitrain: error: {event.reason}")
            return EXIT_BAD_INPUT
        self.say_err(f"training failed: {event.reason}")
        # The launcher names the rank that failed first: it learns when, and whether this
        # rank's worker was killed (then the others' failures are its consequence).
        ranks.record_failure(event.reason, killed=event.exitcode is not None
                             and event.exitcode < 0, exitcode=EXIT_FAILED)
        if event.log_tail:
            self.say_err("  " + "\n  ".join(event.log_tail[-8:]))
        self.say_err(f"full log: {self.log_path}")
        if self.settings.logging.metrics:
            self.say_err(f"metrics so far: {self.settings.logging.metrics}")
        return EXIT_FAILED

    def interrupted(self, *, now: bool = False) -> None:
        """The run's last line: where it stopped and where its metrics are; `now` when a
        second Ctrl-C ended the worker at once, maybe while it wrote a checkpoint."""
        step = self.latest.step if self.latest is not None else 0
        self.say_err(interrupted_line(self.settings, step, now=now, summary=self.summary))

    # --- output ----------------------------------------------------------------------

    def _progress(self, stats: StepStats, *, bar: bool, width: int | None) -> str:
        """The progress line of `stats`, within `width` columns (None: whole). What does
        not fit is left out a field at a time, least important first, never cut mid-way."""
        fields = [  # (importance, text): 0 is kept whatever the width
            (0, f"step {stats.step}/{self.total}"),
            (1, f"loss {stats.loss:.4f}"),
            *((2, text) for text in self._pace(stats)),
            (3, f"device peak {format_size(stats.memory.device_peak)}"),
            (5, f"policy {stats.policy}"),
            (6, f"margin {stats.margin_ratio:.2f}"),
        ]
        if stats.bytes_disk_read or stats.bytes_disk_written:
            fields.append((4, f"disk read {format_size(stats.bytes_disk_read)} written "
                              f"{format_size(stats.bytes_disk_written)} waited "
                              f"{stats.disk_wait:.1f} s"))
        done = min(BAR_WIDTH, BAR_WIDTH * stats.step // max(1, self.total))
        prefix = [f"[{'#' * done}{'.' * (BAR_WIDTH - done)}]"] if bar else []
        return _fit(prefix, fields, width)

    def _pace(self, stats: StepStats) -> list[str]:
        """How fast the run goes: its trial's medians over settled steps, the figures its
        summary and a preset saved from it give; this step's time until one has settled."""
        current = self.trials.current
        trial = next((t for t in self.trials.rows() if t.setting == current), None)
        if trial is None or trial.step_seconds is None:
            return [f"{format_seconds(stats.seconds)}/step"]
        rate = trial.tokens_per_second
        return [f"{format_seconds(trial.step_seconds)}/step",
                *([f"{format_rate(rate)} tok/s"] if rate is not None else [])]

    def close_line(self) -> None:
        """End a progress line drawn in place, so what follows starts on its own line.

        The line is drawn once more first: a `^C` the terminal echoed onto it is wiped.
        """
        if self.line_open:
            self.out.write("\r" + self.drawn + "\x1b[K\n")
            self.out.flush()
            self.line_open = False

    def say(self, text: str) -> None:
        self.close_line()
        self.out.write(text + "\n")
        self.out.flush()

    def say_err(self, text: str) -> None:
        self.close_line()
        self.err.write(text + "\n")
        self.err.flush()


class _Discard:
    """Output nobody reads: a rank other than 0 keeps its progress to itself."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


class _Prefixed:
    """`stream` with every line starting with `prefix` (a rank's failures, under torchrun,
    where the ranks' output is interleaved)."""

    def __init__(self, stream: TextIO, prefix: str) -> None:
        self.stream, self.prefix = stream, prefix

    def write(self, text: str) -> int:
        lines = text.split("\n")
        body = "\n".join(self.prefix + line if line else line for line in lines)
        return self.stream.write(body)

    def flush(self) -> None:
        self.stream.flush()


def _fit(prefix: list[str], fields: list[tuple[int, str]], width: int | None) -> str:
    """`prefix` (the bar) then `fields` joined by two spaces, in their order, leaving out the least
    important fields (highest number first) until the line is at most `width` long; the
    prefix goes too when even the most important field alone does not fit beside it."""
    def line(kept: list[tuple[int, str]], head: list[str]) -> str:
        return " ".join([*head, "  ".join(text for _, text in kept)])

    kept = list(fields)
    while width is not None and len(line(kept, prefix)) > width:
        least = max(importance for importance, _ in kept)
        if least == 0:
            if prefix:
                prefix = []
                continue
            break
        drop = max(i for i, (importance, _) in enumerate(kept) if importance == least)
        del kept[drop]
    return line(kept, prefix)


def _width(stream: TextIO) -> int:
    """Columns of the terminal behind `stream`, or the usual guess."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):
        return shutil.get_terminal_size().columns

