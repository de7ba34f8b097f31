"""TrainingRun: one training run inside the worker process, steered by commands.

It builds the model, the data and the engine from the settings, announces them with
`Started`, then trains step by step. Between steps it answers the commands waiting on the
channel; after each step it sends a `Step` event and, when asked, appends the step to a
JSONL metrics file. How it ends is its exit status: finished, failed, or bad input.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from tuitrain.events import (
    Applied,
    Checkpoint,
    Command,
    Event,
    Failed,
    Finished,
    Log,
    Pause,
    Rejected,
    Resume,
    SetBudget,
    SetMargin,
    SetPolicy,
    Started,
    Step,
    Stop,
)
from tuitrain.settings import Settings

# Exit statuses of the worker process. 2 matches the CLI's "bad input" status, so a UI can
# tell a user mistake (unknown model, budget below the working set) from a crash.
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2

LOG_TAIL_LINES = 20
# How long a paused run sleeps between looks at the command channel.
PAUSE_WAIT_SECONDS = 0.2


class EventSink(Protocol):
    def put(self, event: Event) -> None:
        """Send `event` to the UI without waiting for it to be read."""


def read_log_tail(path: str | os.PathLike, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last `lines` lines of a log file; empty when it cannot be read."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 64 * 1024))
            text = log.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]


class TrainingRun:
    """Builds the model, data and engine of `settings`, then trains step by step.

    Between steps it drains the command channel; `execute` returns the process exit status.
    """

    def __init__(
        self, *, settings: Settings, log_path: str, commands: Connection, outbox: EventSink
    ) -> None:
        self.settings = settings
        self.log_path = log_path
        self.commands = commands
        self.outbox = outbox
        self.paused = False
        self.stopping = False
        self.channel_open = True  # False once the UI has closed its end of the commands
        self.next_step = 1  # number of the step that runs next; resumed runs keep counting
        self.steps_run = 0
        self.tokens = 0
        self.step_seconds: list[float] = []
        self.peak_device = 0
        self.last_loss: float | None = None
        self.started_at = time.monotonic()
        self.metrics: Any = None  # the open metrics file
        self.save_checkpoint: Callable[..., Any] | None = None
        self.engine: Any = None
        self.checkpointed = 0  # the step of the latest checkpoint this run saved

    # --- the run -----------------------------------------------------------------------

    def execute(self) -> int:
        try:
            self._setup()
            self._train()
            self._finish()
            return EXIT_OK
        except ValueError as err:
            traceback.print_exc()
            if self.steps_run:
                return self._fail(f"{type(err).__name__}: {err}", EXIT_FAILED)
            # Raised before the first step completed: the model name, the data, a budget
            # below the working set... a mistake in the input, not a crash.
            return self._fail(str(err), EXIT_BAD_INPUT)
        except BaseException as err:  # noqa: B036 - whatever happens, the UI must hear of it
            traceback.print_exc()
            return self._fail(f"{type(err).__name__}: {err}", EXIT_FAILED)
        finally:
            self._close_metrics()

    def _setup(self) -> None:
        from tuitrain.plan import warn_if_unfit
        from tuitrain.run_build import build_run

        s = self.settings
        print(f"tuitrain worker pid {os.getpid()} started {_now()}", flush=True)
        if s.training.grad_accum != 1:
            raise ValueError(
                "grad_accum above 1 is not supported: the engine takes one optimizer step per "
                "batch; raise batch_size instead"
            )
        resume = self._checkpoint_hooks()
        self._open_metrics()

        built = build_run(s, self._say)
        self.model, self.data, self.engine = built.model, built.data, built.engine
        # The planner's forecast, once the engine has accepted the settings (so a refusal is
        # one line, not a warning and an error saying the same).
        unfit = warn_if_unfit(s)
        if unfit:
            self._say(unfit, "warning")
        if resume is not None:
            self.next_step = int(resume(self.engine, self.model, self.data, s)) + 1
            self._say(f"resumed from {s.checkpoint.resume} after step {self.next_step - 1}")

        device, used = built.device, built.settings_used
        started = Started(
            model=s.model,
            parameters=self.engine.num_parameters,
            device=device,
            chunks=self.engine.snapshot().chunks,
            settings=used,
            pid=os.getpid(),
            log_path=self.log_path,
        )
        self.outbox.put(started)
        print(f"started: {s.model}, {started.parameters} parameters, {device}", flush=True)
        if self.metrics is not None:
            header = {
                "settings": used,
                "parameters": started.parameters,
                "device": device,
                "started": _now(),
            }
            self._write_metrics(header)

    def interrupt(self) -> None:
        """Cut the running step short (a Stop is on its way); called from a signal handler."""
        if self.engine is not None:
            self.engine.interrupt()

    def _train(self) -> None:
        from engine.step.engine import StepInterrupted
        from tuitrain.checkpoint import rng_states, set_rng_states

        batches = self._batches()
        while self.next_step <= self.settings.training.steps:
            self._drain_commands()
            while self.paused and not self.stopping:
                self._wait_for_command(PAUSE_WAIT_SECONDS)
            if self.stopping:
                break
            # What an interrupted step must give back, so a checkpoint written after it (or
            # the step run again) is exactly as if it had never started.
            position = self.data.state_dict() if hasattr(self.data, "state_dict") else None
            rng = rng_states()
            try:
                stats = self.engine.step(next(batches))
            except StepInterrupted as err:
                if position is not None:
                    self.data.load_state_dict(position)
                    batches = self._batches()  # a fresh iterator, from the position restored
                set_rng_states(rng)
                self._say(f"{err}; nothing of it was kept", level="warning")
                continue  # the Stop behind the interrupt ends the loop at the top
            ended = time.time()
            self._record(stats, ended)
        self._final_checkpoint()

    def _finish(self) -> None:
        # Commands that arrived after the last step still get an answer.
        self._drain_commands(after_end=True)
        self.outbox.put(Finished(summary=self._summary()))
        print(f"finished after step {self.next_step - 1}", flush=True)

    def _fail(self, reason: str, code: int) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        self.outbox.put(Failed(reason=reason, exitcode=code, log_tail=read_log_tail(self.log_path)))
        return code

    # --- steps -------------------------------------------------------------------------

    def _batches(self) -> Iterator[dict]:
        """The data's batches, starting over at the end of each pass."""
        while True:
            empty = True
            for batch in self.data:
                empty = False
                yield batch
            if empty:
                raise ValueError("the data yields no batches")

    def _record(self, stats: Any, ended: float) -> None:
        self.steps_run += 1
        self.tokens += stats.tokens
        self.step_seconds.append(stats.seconds)
        self.peak_device = max(self.peak_device, stats.memory.device_peak)
        self.last_loss = stats.loss
        self.next_step = stats.step + 1
        # When the step ended, so a consumer can measure how late samples reach it.
        self.outbox.put(Step(stats, time=ended))
        if self.metrics is not None and stats.step % self.settings.logging.every == 0:
            self._write_metrics(dataclasses.asdict(stats))
        every = self.settings.checkpoint.every
        if every and stats.step % every == 0:
            self._periodic_checkpoint(stats.step)

    def _periodic_checkpoint(self, step: int) -> bool:
        """Save a checkpoint; a failure (a full disk) is reported and training goes on."""
        if self.save_checkpoint is None:
            return False
        try:
            path = self.save_checkpoint(self.engine, self.model, self.data, self.settings, step)
        except OSError as err:
            self._say(f"checkpoint after step {step} failed, training goes on: {err}", "error")
            return False
        self.checkpointed = step
        self._say(f"checkpoint after step {step}: {path}")
        return True

    def _final_checkpoint(self) -> None:
        """A run with a checkpoint folder ends with a checkpoint of its last step, also
        when it was stopped (Ctrl-C in a headless run) rather than finished."""
        done = self.next_step - 1
        if self.settings.checkpoint.dir and self.steps_run and self.checkpointed != done:
            self._periodic_checkpoint(done)

    def _summary(self) -> dict:
        import resource

        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if sys.platform != "darwin":  # Linux reports KiB, macOS bytes
            peak_rss *= 1024
        seconds = self.step_seconds
        # The first step traces the model (warm-up); the mean describes the steady state.
        steady = seconds[1:] or seconds
        return {
            "steps": self.steps_run,
            "last_step": self.next_step - 1,
            "planned_steps": self.settings.training.steps,
            "stopped": self.next_step <= self.settings.training.steps,
            "tokens": self.tokens,
            "seconds": time.monotonic() - self.started_at,
            "first_step_seconds": seconds[0] if seconds else None,
            "mean_step_seconds": sum(steady) / len(steady) if steady else None,
            "tokens_per_second": self.tokens / sum(seconds) if sum(seconds) > 0 else None,
            "final_loss": self.last_loss,
            "peak_device_bytes": self.peak_device,
            "peak_host_bytes": peak_rss,
            "metrics": self.settings.logging.metrics,
            "log": self.log_path,
        }

    # --- commands ----------------------------------------------------------------------

    def _drain_commands(self, after_end: bool = False) -> None:
        while (after_end or not self.stopping) and self._command_ready(0):
            self._receive(after_end)

    def _wait_for_command(self, timeout: float) -> None:
        if self._command_ready(timeout):
            self._receive(after_end=False)

    def _command_ready(self, timeout: float) -> bool:
        if not self.channel_open:
            return False
        try:
            return self.commands.poll(timeout)
        except OSError:
            self._channel_closed()
            return False

    def _channel_closed(self) -> None:
        # The UI closed its end: nobody can steer the run any more, so end it cleanly.
        self.channel_open = False
        if not self.stopping:
            self.stopping = True
            self._say("the command channel closed; stopping", level="warning")

    def _receive(self, after_end: bool) -> None:
        try:
            command = self.commands.recv()
        except (EOFError, OSError):
            self._channel_closed()
            return
        if after_end:
            self.outbox.put(Rejected(command.id, "training has finished"))
        else:
            self._handle(command)

    def _handle(self, command: Command) -> None:
        done = self.next_step - 1  # the step after which an action (pause, checkpoint) acts
        if isinstance(command, SetPolicy):
            self._change(
                command, lambda: self.engine.set_policy(command.policy), f"policy {command.policy}"
            )
        elif isinstance(command, SetMargin):
            self._change(
                command,
                lambda: self.engine.set_margin(command.margin_ratio),
                f"margin {command.margin_ratio:g}",
            )
        elif isinstance(command, SetBudget):
            self._change(
                command,
                lambda: self.engine.set_budget(command.device_budget),
                f"device budget {command.device_budget}",
            )
        elif isinstance(command, Pause):
            if self.paused:
                self.outbox.put(Rejected(command.id, "already paused"))
            else:
                self.paused = True
                self.outbox.put(Applied(command.id, done, "paused"))
        elif isinstance(command, Resume):
            if not self.paused:
                self.outbox.put(Rejected(command.id, "not paused"))
            else:
                self.paused = False
                self.outbox.put(Applied(command.id, done, "resumed"))
        elif isinstance(command, Stop):
            self.stopping = True
            self.outbox.put(Applied(command.id, done, "stop"))
        elif isinstance(command, Checkpoint):
            self._checkpoint(command, done)
        else:
            self.outbox.put(Rejected(command.id, f"unknown command {type(command).__name__}"))

    def _change(self, command: Command, apply: Callable[[], None], what: str) -> None:
        """Apply an engine setting; a bad value is refused and training goes on."""
        try:
            apply()
        except ValueError as err:
            self.outbox.put(Rejected(command.id, str(err)))
            return
        # The engine switches at the next step boundary: the next step is the first with it.
        self.outbox.put(Applied(command.id, self.next_step, what))
        print(f"applied from step {self.next_step}: {what}", flush=True)

    def _checkpoint(self, command: Command, done: int) -> None:
        if not self.settings.checkpoint.dir:
            self.outbox.put(Rejected(command.id, "checkpoints need --checkpoint-dir"))
            return
        try:
            path = self.save_checkpoint(self.engine, self.model, self.data, self.settings, done)
        except (OSError, ValueError) as err:
            traceback.print_exc()
            self.outbox.put(Rejected(command.id, f"checkpoint failed: {err}"))
            return
        self.checkpointed = done
        self.outbox.put(Applied(command.id, done, f"checkpoint {path}" if path else "checkpoint"))

    def _checkpoint_hooks(self) -> Callable[..., Any] | None:
        """Arm checkpoint saving when the settings ask for it; returns the resume function."""
        from tuitrain import checkpoint

        c = self.settings.checkpoint
        if c.dir:
            self.save_checkpoint = checkpoint.save_checkpoint
        return checkpoint.load_checkpoint if c.resume else None

    # --- output ------------------------------------------------------------------------

    def _open_metrics(self) -> None:
        path = self.settings.logging.metrics
        if not path:
            return
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            # Appended, never truncated: a metrics file the user already had is kept whole.
            self.metrics = open(path, "a", encoding="utf-8")
        except OSError as err:
            raise ValueError(f"cannot write metrics to {path}: {err.strerror or err}") from err

    def _close_metrics(self) -> None:
        if self.metrics is None:
            return
        try:
            self.metrics.close()
        except OSError:  # the write that failed is already reported; closing retries it
            pass
        self.metrics = None

    def _write_metrics(self, record: dict) -> None:
        self.metrics.write(json.dumps(record) + "\n")
        self.metrics.flush()

    def _say(self, message: str, level: str = "info") -> None:
        print(message, flush=True)
        self.outbox.put(Log(message, level))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
