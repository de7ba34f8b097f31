"""TrainingRun: one training run inside the worker process, steered by commands.

It builds the model, the data and the engine from the settings, announces them with
`Started`, then trains step by step. Between steps it answers the commands waiting on the
channel; after each step it sends a `Step` event and, when asked, appends the step to a
JSONL metrics file. When the run holds text out, it measures the loss on it every so many
steps and after the last (an `Eval` event and a metrics line of its own). How it ends is
its exit status: finished, failed, or bad input.

Data parallel (tuitrain.ranks), the UI steers rank 0 alone. Rank 0 decides at each step
boundary (paused or not, the changes and checkpoints it was asked for) and every rank
carries out that decision before the same step: a change is checked by every rank's engine
and staged only when none refuses, so its answer names one step for all of them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import datetime, timezone
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

from tuitrain import ranks
from tuitrain.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from tuitrain.events import (
    STEP_NOT_KEPT,
    Eval,
    Event,
    Failed,
    Finished,
    Log,
    Started,
    Step,
)
from tuitrain.metrics import MetricsWriter
from tuitrain.run_commands import RunCommands
from tuitrain.settings import Settings
from tuitrain.worker_log import read_log_tail

# exp() of a loss past this overflows a float; a perplexity that large is reported as e^700.
_MAX_LOG_PERPLEXITY = 700.0


class EventSink(Protocol):
    def put(self, event: Event) -> None:
        """Send `event` to the UI without waiting for it to be read."""


class TrainingRun:
    """Builds the model, data and engine of `settings`, then trains step by step.

    Between steps its RunCommands (tuitrain.run_commands) answers the command channel;
    `execute` returns the process exit status.
    """

    def __init__(
        self, *, settings: Settings, log_path: str, commands: Connection, outbox: EventSink
    ) -> None:
        self.settings = settings
        self.log_path = log_path
        self.outbox = outbox
        self.commands = RunCommands(run=self, channel=commands)
        self.next_step = 1  # number of the step that runs next; resumed runs keep counting
        self.steps_run = 0
        self.tokens = 0
        self.first_step_seconds: float | None = None  # it also records the chunks' order
        self.peak_device = 0
        # The host peak is the steps' (each step's VmHWM, see engine.devices.host_memory):
        # the figure the trials, the app and a saved preset show, so no second one appears.
        self.peak_host = 0
        self.disk_read = self.disk_written = 0  # bytes, the last step's update included
        self.last_loss: float | None = None
        self.started_at = time.monotonic()
        self.metrics: MetricsWriter | None = None
        self.save_checkpoint: Callable[..., Any] | None = None
        self.engine: Any = None
        self.eval_data: Any = None  # fixed held-out batches, when the run evaluates
        self.last_eval: Eval | None = None
        self.checkpointed = 0  # the step of the latest checkpoint this run saved
        self.ranks = ranks.Ranks()  # data parallel under torchrun (tuitrain.ranks)

    @property
    def stopping(self) -> bool:
        """Whether a Stop (or a closed channel) is ending the run at the step boundary."""
        return self.commands.stopping

    @property
    def collectives(self) -> Any:
        """The engine's collectives, which carry the ranks' own agreements too (bounded by
        engine.collective_timeout); None for a single process."""
        return getattr(self.engine, "collectives", None)

    # --- the run -----------------------------------------------------------------------

    def execute(self) -> int:
        """Build, train, report; returns the process exit status (see tuitrain.errors): a
        ValueError before the first step is a mistake in the input, not a crash."""
        try:
            self._setup()
            self._train()
            self._finish()
            ranks.leave(self.ranks)  # after a failure the group may not answer: exit leaves it
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
            if self.metrics is not None:
                self.metrics.close()
            self._close_engine()

    def _close_engine(self) -> None:
        """However the run ends, the engine's last update lands and its scratch folder
        goes (the process exits without the interpreter's cleanup, tuitrain.worker_main)."""
        if self.engine is None:
            return
        try:
            self.engine.close(keep_weights=False)
        except BaseException:  # noqa: B036 - the run's outcome is already decided
            traceback.print_exc()

    def _setup(self) -> None:
        import torch

        from engine.devices.device import uses_cuda
        from engine.devices.host_memory import steady_heap
        from tuitrain.fit import settle
        from tuitrain.run_build import build_run

        s = self.settings
        print(f"tuitrain worker pid {os.getpid()} started {_now()}", flush=True)
        self.ranks = ranks.from_environment()
        backend = ranks.join(self.ranks, cuda=uses_cuda(),
                             timeout=s.engine.collective_timeout)
        if backend:
            print(f"joined as {self.ranks.label()} ({backend})", flush=True)
        self.ranks.check_batch(s.training.batch_size)
        # What runs is what its settings line and Started record: as many ranks as joined
        # (each rank of `--nproc N` is started without the flag, so its settings say 1).
        s = s.model_copy(update={"training": s.training.model_copy(
            update={"nproc": self.ranks.world})})
        # Before anything is built or written: what the user left to the defaults is chosen
        # so that the plan says the run fits, and what they chose and cannot fit is refused.
        # Data parallel, every rank settles here on the same per-rank plan (one collective).
        s = self.settings = settle(s, self.say, nproc=self.ranks.world,
                                   local=ranks.on_this_machine(self.ranks))
        # Every run keeps glibc's heap steady, so that its host peak is the plan's, tight or
        # not; the simulated device keeps its chunk buffers, which makes that cost nothing
        # measurable (engine.devices.host_memory, engine.devices.buffer_pool).
        steady_heap()
        resume = self._checkpoint_hooks()
        if s.logging.metrics and self.ranks.leader:
            self.metrics = MetricsWriter(s.logging.metrics)

        built = build_run(s, self.say)
        self.model, self.data, self.engine = built.model, built.data, built.engine
        # Every random number training draws (dropout masks) comes from here on, from the
        # run's seed: building, planning and evaluating draw none of them (engine/), so
        # the same command gives the same losses whatever the placement. Every rank seeds
        # alike and draws the masks of the whole batch (engine.step.dropout). A resumed run
        # takes the checkpoint's state instead.
        torch.manual_seed(s.training.seed)
        self.eval_data = built.eval_data
        if resume is not None:
            done = int(resume(self.engine, self.model, self.data, s))
            if done >= s.training.steps:  # a mistake in the input: not a run of no steps
                from tuitrain.resume import nothing_left

                raise ValueError(nothing_left(s.checkpoint.resume, done, s.training.steps))
            self.next_step = done + 1
            self.say(f"resumed from {s.checkpoint.resume} after step {done}")
            self._say_schedule_changes()

        device, used = built.device, built.settings.model_dump(mode="json")
        if self.ranks.parallel:
            device += f" per rank, {self.ranks.world} ranks ({backend})"
        started = Started(
            model=s.model,
            parameters=self.engine.num_parameters,
            device=device,
            chunks=self.engine.snapshot().chunks,
            settings=used,
            pid=os.getpid(),
            log_path=self.log_path,
            device_budget=built.device_budget,
            ranks=self.ranks.world,
            trainable=sum(p.numel() for p in self.model.parameters() if p.requires_grad),
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
            self.metrics.write(header)

    def interrupt(self) -> None:
        """Cut the running step short (a Stop is on its way); called from a signal handler.
        With several ranks the engine stops the step on every rank at a boundary they
        agree on, and the Stop ends the run at the step boundary they agree on."""
        if self.engine is not None:
            self.engine.interrupt()

    def _train(self) -> None:
        from engine.placement.rules import BudgetTooSmall
        from engine.step.engine import StepInterrupted
        from tuitrain.checkpoint import rng_states, set_rng_states

        batches = self._batches()
        while self.next_step <= self.settings.training.steps:
            self.commands.step_boundary()
            if self.stopping:
                break
            # What an interrupted step must give back, so a checkpoint written after it (or
            # the step run again) is exactly as if it had never started.
            position = self.data.state_dict() if hasattr(self.data, "state_dict") else None
            rng = rng_states()
            try:
                stats = self.engine.step(next(batches))
            except (StepInterrupted, BudgetTooSmall) as err:
                if isinstance(err, BudgetTooSmall) and not self.commands.untried:
                    raise
                if position is not None:
                    self.data.load_state_dict(position)
                    batches = self._batches()  # a fresh iterator, from the position restored
                set_rng_states(rng)
                if isinstance(err, BudgetTooSmall):
                    # and the step runs again without them
                    self.commands.refuse_untried(str(err))
                else:
                    self.say(f"{err}{STEP_NOT_KEPT}", level="warning")
                continue  # the Stop behind an interrupt ends the loop at the top
            self.commands.first_step_ran(stats.step)
            ended = time.time()
            self._record(stats, ended)
            if self._evaluates_after(stats.step):
                self._evaluate(stats.step)
        # The last step's update may still be writing (state on disk): counted once done.
        read, written, _ = self.engine.finish_update()
        self.disk_read, self.disk_written = self.disk_read + read, self.disk_written + written
        self._final_checkpoint()

    def _finish(self) -> None:
        self.commands.finish()
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
                # A global batch; each rank trains on its part of each micro-batch.
                yield self.ranks.slice(batch, self.settings.training.grad_accum)
            if empty:
                raise ValueError("the data yields no batches")

    def _record(self, stats: Any, ended: float) -> None:
        self.steps_run += 1
        self.tokens += stats.tokens
        if self.first_step_seconds is None:
            self.first_step_seconds = stats.seconds
        self.peak_device = max(self.peak_device, stats.memory.device_peak)
        self.peak_host = max(self.peak_host, stats.memory.process_rss)
        self.last_loss = stats.loss
        self.next_step = stats.step + 1
        self.disk_read += stats.bytes_disk_read
        self.disk_written += stats.bytes_disk_written
        # When the step ended, so a consumer can measure how late samples reach it.
        self.outbox.put(Step(stats, time=ended))
        if self.metrics is not None and stats.step % self.settings.logging.every == 0:
            self.metrics.write(dataclasses.asdict(stats))
        every = self.settings.checkpoint.every
        if every and stats.step % every == 0:
            self._periodic_checkpoint(stats.step)

    # --- evaluation --------------------------------------------------------------------

    def _evaluates_after(self, step: int) -> bool:
        every = self.settings.training.eval_every
        last = step == self.settings.training.steps
        return self.eval_data is not None and (last or bool(every and step % every == 0))

    def _evaluate(self, step: int) -> None:
        """The loss on the held-out batches after `step`: their mean over every predicted
        token. A Stop that arrives meanwhile ends it without a result."""
        started = time.perf_counter()
        total = weight = 0.0
        for batch in self.eval_data.batches:
            self.commands.drain()
            # With several ranks every one finishes it: a Stop waits for the step boundary.
            if self.stopping and not self.ranks.parallel:
                self.say(f"evaluation after step {step} left unfinished: stopping")
                return
            rows, columns = batch["input_ids"].shape
            predicted = rows * (columns - 1)  # the model predicts each token from the ones before
            # Data parallel: each rank scores its part; the parts' losses add up by weight.
            part, counted = self.ranks.eval_part(batch)
            loss = self.engine.evaluate(part)
            total += ranks.sum_over_ranks(self.collectives, loss * counted * (columns - 1))
            weight += predicted
        loss = total / weight
        result = Eval(
            step=step,
            loss=loss,
            perplexity=math.exp(min(loss, _MAX_LOG_PERPLEXITY)),
            tokens=self.eval_data.tokens,
            seconds=time.perf_counter() - started,
        )
        self.last_eval = result
        self.outbox.put(result)
        print(f"eval after step {step}: loss {loss:.4f}, perplexity {result.perplexity:.2f}",
              flush=True)
        if self.metrics is not None:
            self.metrics.write({"eval": dataclasses.asdict(result)})

    def _periodic_checkpoint(self, step: int) -> bool:
        """Save a checkpoint; a failure (a full disk) is reported and training goes on."""
        if self.save_checkpoint is None:
            return False
        try:
            path = self.checkpoint_at(step)
        except OSError as err:
            self.say(f"checkpoint after step {step} failed, training goes on: {err}", "error")
            return False
        self.say(f"checkpoint after step {step}: {path}")
        return True

    def checkpoint_at(self, step: int) -> str | None:
        """Save a checkpoint of the run as it is after `step`; its path. OSError or
        ValueError when it cannot be written."""
        assert self.save_checkpoint is not None, "a run with a checkpoint folder"
        path = self.save_checkpoint(self.engine, self.model, self.data, self.settings, step)
        self.checkpointed = step
        return path

    def _final_checkpoint(self) -> None:
        """A run with a checkpoint folder ends with a checkpoint of its last step, also
        when it was stopped (Ctrl-C in a headless run) rather than finished."""
        done = self.next_step - 1
        if self.settings.checkpoint.dir and self.steps_run and self.checkpointed != done:
            self._periodic_checkpoint(done)

    def _summary(self) -> dict:
        """How the run ended. Its pace is the trials' (tuitrain.trials, medians of settled
        steps), which the UI measures from the steps: not a second figure here."""
        return {
            "steps": self.steps_run,
            "last_step": self.next_step - 1,
            "planned_steps": self.settings.training.steps,
            "stopped": self.next_step <= self.settings.training.steps,
            "tokens": self.tokens,
            "seconds": time.monotonic() - self.started_at,
            "first_step_seconds": self.first_step_seconds,
            "final_loss": self.last_loss,
            "peak_device_bytes": self.peak_device,
            "peak_host_bytes": self.peak_host if self.steps_run else None,
            "bytes_disk_read": self.disk_read,
            "bytes_disk_written": self.disk_written,
            "metrics": self.settings.logging.metrics,
            "log": self.log_path,
            **self._eval_summary(),
        }

    def _eval_summary(self) -> dict:
        """The latest held-out loss, for a run that evaluates."""
        if self.eval_data is None:
            return {}
        e = self.last_eval
        return {
            "eval_step": e.step if e else None,
            "eval_loss": e.loss if e else None,
            "eval_perplexity": e.perplexity if e else None,
            "eval_tokens": e.tokens if e else None,
        }

    def _checkpoint_hooks(self) -> Callable[..., Any] | None:
        """Arm checkpoint saving when the settings ask for it; returns the resume function."""
        from tuitrain import checkpoint

        c = self.settings.checkpoint
        if c.dir:
            # Data parallel, every rank saves: its own shard of the optimizer state.
            self.save_checkpoint = checkpoint.save_checkpoint
        return checkpoint.load_checkpoint if c.resume else None

    def _say_schedule_changes(self) -> None:
        """A resumed run that sets the learning rate's course otherwise than the run that
        saved it goes on with its own, and says so once (tuitrain.resume)."""
        from tuitrain.checkpoint_folder import find_checkpoint, read_state
        from tuitrain.resume import schedule_changes

        folder = find_checkpoint(Path(self.settings.checkpoint.resume).expanduser())
        changed = schedule_changes(folder, read_state(folder), self.settings)
        if changed and self.ranks.leader:
            self.say(changed, level="warning")

    # --- output ------------------------------------------------------------------------

    def say(self, message: str, level: str = "info") -> None:
        """A line in the worker's log and on the UI's."""
        print(message, flush=True)
        self.outbox.put(Log(message, level))


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
