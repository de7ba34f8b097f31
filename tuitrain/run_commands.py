"""Steering a training run: the commands from the UI, answered between steps.

A change (policy, margin, budget) is checked by the engine and staged for the next step; a
pause, resume or stop acts at the step boundary; a checkpoint saves after the last step.
A change of the steps' shape (SetShape: micro-batches, activation checkpointing) and the
changes that come with it are checked by the plan once the commands waiting are staged
(tuitrain.step_shape), and answered once a step has run with them: that step traces the new
shape, and one that overruns the budget is taken back (refuse_untried) and runs again.
Data parallel, rank 0 alone hears the UI: it decides at each step boundary, and every rank
carries out that decision before the same step (`_agree`), so a change's answer names one
step for all of them.

The training run holds a RunCommands and asks it, at each step boundary, what to do; it
sees the run through SteeredRun, what it reads of it and the two things it asks of it.
"""

from __future__ import annotations

import dataclasses
import traceback
from multiprocessing.connection import Connection
from typing import Any, Protocol

from tuitrain import ranks
from tuitrain.events import (
    TRAINING_FINISHED,
    Applied,
    Checkpoint,
    Command,
    Pause,
    Rejected,
    Resume,
    SetBudget,
    SetMargin,
    SetPolicy,
    SetShape,
    Stop,
)
from tuitrain.step_shape import Shape, check_fits, global_batch, resolve, shaped

# How long a paused run sleeps between looks at the command channel.
PAUSE_WAIT_SECONDS = 0.2


class SteeredRun(Protocol):
    """What the commands read of the training run they steer, and ask of it."""

    settings: Any  # tuitrain.settings.Settings, as settled
    engine: Any  # the engine.step engine, once built
    ranks: ranks.Ranks
    next_step: int  # the step that runs next
    steps_run: int
    outbox: Any  # the EventSink events go out on

    @property
    def collectives(self) -> Any:
        """The engine's, which the ranks agree over; None for a single process."""

    def checkpoint_at(self, step: int) -> str | None:
        """Save a checkpoint of the run after `step`; OSError or ValueError when it fails."""

    def say(self, message: str, level: str = "info") -> None:
        """A line in the worker's log and on the UI's."""


class RunCommands:
    """The commands from the UI to one training run, answered between its steps.

    Args:
        run: the run they steer.
        channel: the read end of the UI -> worker channel.
    """

    def __init__(self, *, run: SteeredRun, channel: Connection) -> None:
        self.run = run
        self.channel = channel
        self.channel_open = True  # False once the UI has closed its end
        self.paused = False
        self.stopping = False
        # Data parallel, rank 0: changes and checkpoints asked for since the last step
        # boundary, carried out by every rank at the next one.
        self.proposed: list[Command] = []
        # Changes no step has checked yet (any asked for before the first step; a new shape,
        # and what comes with it): answered once a step ran with them, or refused if it
        # could not. With the shapes they set, which the run's settings take then.
        self.untried: list[tuple[int, str, Shape | None]] = []
        self.settings_before: Any = None  # the engine's staged ones, before the first of those

    # --- what the run asks, at its step boundaries -----------------------------------------

    def step_boundary(self) -> None:
        """Between steps: answer the commands, and wait here while paused. With several
        ranks, every rank then carries out what rank 0 decided (see _agree)."""
        self.drain()
        if not self.run.ranks.parallel:
            while self.paused and not self.stopping:
                self._wait_for_command(PAUSE_WAIT_SECONDS)
            self._plan_shape()
            return
        self._agree()
        while self.paused and not self.stopping:
            # Every rank waits, agreeing again each time: rank 0 may resume, any may stop.
            self._wait_for_command(PAUSE_WAIT_SECONDS)
            self._agree()

    def _plan_shape(self) -> None:
        """A new shape, and what came with it, checked by the plan as it will run (the
        engine checks none of it against a trace of the old shape); refused before any
        step runs with it if it does not fit."""
        shapes = [shape for _, _, shape in self.untried if shape is not None]
        if not shapes:
            return
        try:
            check_fits(self.run.settings, self.run.engine.staged, shapes[-1])
        except ValueError as err:
            self.refuse_untried(str(err))
        except Exception:  # noqa: BLE001 - a model the planner cannot read: the step checks
            traceback.print_exc()

    def first_step_ran(self, step: int) -> None:
        """Step `step` ran with the changes asked for before it: each is answered."""
        for command_id, what, shape in self.untried:
            if shape is not None:  # a checkpoint or a preset of the run records it
                self.run.settings = shaped(self.run.settings, shape)
            self._answer(Applied(command_id, step, what))
            print(f"applied from step {step}: {what}", flush=True)
        self.untried.clear()
        self.settings_before = None

    def finish(self) -> None:
        """Training has finished: commands that arrived after the last step still get an
        answer."""
        self.drain(after_end=True)
        for command in self.proposed:
            self.run.outbox.put(Rejected(command.id, TRAINING_FINISHED))
        self.proposed = []

    def _agree(self) -> None:
        """Data parallel, at a step boundary (every rank calls it at the same point): rank
        0's decision (paused or not, the changes and checkpoints asked for) is every
        rank's, and the run stops when any rank asks to (Ctrl-C under torchrun reaches
        every rank, not always in the same step)."""
        decision = None
        if self.run.ranks.leader:
            decision = [self.paused, [_command_record(c) for c in self.proposed]]
        said = ranks.gather_from_ranks(self.run.collectives, [decision, self.stopping])
        (self.paused, records), self.proposed = said[0][0], []
        proposed = [_command_from_record(r) for r in records]
        self.stopping = any(stop for _, stop in said)
        for command in proposed:
            if isinstance(command, Checkpoint):
                self._checkpoint(command, self.run.next_step - 1)
            elif self.stopping:
                self._answer(Rejected(command.id, "the run is stopping"))
            else:
                self._change_on_every_rank(command)

    # --- commands ----------------------------------------------------------------------

    def drain(self, after_end: bool = False) -> None:
        """Answer every command waiting on the channel (after the end: refuse each)."""
        while (after_end or not self.stopping) and self._command_ready(0):
            self._receive(after_end)

    def _wait_for_command(self, timeout: float) -> None:
        if self._command_ready(timeout):
            self._receive(after_end=False)

    def _command_ready(self, timeout: float) -> bool:
        if not self.channel_open:
            return False
        try:
            return self.channel.poll(timeout)
        except OSError:
            self._channel_closed()
            return False

    def _channel_closed(self) -> None:
        # The UI closed its end: nobody can steer the run any more, so end it cleanly.
        self.channel_open = False
        if not self.stopping:
            self.stopping = True
            self.run.say("the command channel closed; stopping", level="warning")

    def _receive(self, after_end: bool) -> None:
        try:
            command = self.channel.recv()
        except (EOFError, OSError):
            self._channel_closed()
            return
        if after_end:
            self.run.outbox.put(Rejected(command.id, TRAINING_FINISHED))
        else:
            self._handle(command)

    def _handle(self, command: Command) -> None:
        done = self.run.next_step - 1  # the step after which a pause or a checkpoint acts
        change = isinstance(command, SetPolicy | SetMargin | SetBudget | SetShape)
        saves = isinstance(command, Checkpoint) and bool(self.run.settings.checkpoint.dir)
        if isinstance(command, SetShape) and self.run.ranks.parallel:
            # Each rank's part of every micro-batch is cut before the step (ranks.slice).
            self.run.outbox.put(Rejected(command.id, "a data-parallel run keeps the shape it "
                                                     "started with"))
        elif self.run.ranks.parallel and (change or saves):
            self.proposed.append(command)  # every rank carries it out at the step boundary
        elif change:
            self._change(command)
        elif isinstance(command, Pause):
            if self.paused:
                self.run.outbox.put(Rejected(command.id, "already paused"))
            else:
                self.paused = True
                self.run.outbox.put(Applied(command.id, done, "paused"))
        elif isinstance(command, Resume):
            if not self.paused:
                self.run.outbox.put(Rejected(command.id, "not paused"))
            else:
                self.paused = False
                self.run.outbox.put(Applied(command.id, done, "resumed"))
        elif isinstance(command, Stop):
            self.stopping = True
            self.run.outbox.put(Applied(command.id, done, "stop"))
        elif isinstance(command, Checkpoint):
            self._checkpoint(command, done)
        else:
            self.run.outbox.put(Rejected(command.id, f"unknown command {type(command).__name__}"))

    def _change(self, command: Command) -> bool:
        """Apply an engine setting, worded as the engine words it; a bad value is refused
        and training goes on. Whether it was taken."""
        before = self.run.engine.staged
        try:
            what, shape = self._stage(command)
        except ValueError as err:
            self._answer(Rejected(command.id, str(err)))
            return False
        # Data parallel, every rank's first step tries what rank 0 staged (no shape).
        if not self.run.ranks.parallel and (self.run.steps_run == 0 or self.untried
                                            or shape is not None):
            if not self.untried:
                self.settings_before = before
            self.untried.append((command.id, what, shape))
            return True
        # The engine switches at the next step boundary: the next step is the first with it.
        self._answer(Applied(command.id, self.run.next_step, what))
        print(f"applied from step {self.run.next_step}: {what}", flush=True)
        return True

    def refuse_untried(self, reason: str) -> None:
        """The step could not run with the changes no step had checked: each is refused,
        and the run goes back to the settings it had before them (the step runs again)."""
        self.run.engine.restore_settings(self.settings_before)
        for command_id, _, _ in self.untried:
            self._answer(Rejected(command_id, f"{reason}; the run keeps its settings"))
        self.untried.clear()
        self.settings_before = None
        self.run.say(f"step {self.run.next_step} runs with the settings it had before")

    def _stage(self, command: Command) -> tuple[str, Shape | None]:
        """Hand a setting to the engine for the next step (ValueError: it refuses it); how
        it is worded, and the shape it sets, if it is one."""
        engine = self.run.engine
        if isinstance(command, SetPolicy):
            return engine.set_policy(command.policy), None
        if isinstance(command, SetMargin):
            return engine.set_margin(command.margin_ratio), None
        if isinstance(command, SetBudget):
            return engine.set_budget(command.device_budget), None
        assert isinstance(command, SetShape)
        staged = engine.staged
        shape = resolve(command, global_batch=global_batch(self.run.settings),
                        grad_accum=staged.grad_accum,
                        checkpointing=staged.activation_checkpointing)
        engine.set_grad_accum(shape.grad_accum)
        engine.set_checkpointing(shape.activation_checkpointing)
        return shape.describe(), shape

    def _change_on_every_rank(self, command: Command) -> None:
        """Data parallel: every rank's engine checks the change, and rank 0 stages it when
        none refused (its own check last), then tells the others how it went. Only rank
        0's staged settings count: the engine makes them every rank's at the next step, so
        a refused change leaves every rank as it was, whatever the others staged to check
        it."""
        refusal = what = None
        if not self.run.ranks.leader:
            try:
                what, _ = self._stage(command)
            except ValueError as err:
                refusal = str(err)
        said = ranks.gather_from_ranks(self.run.collectives, refusal)
        refused = [(rank, why) for rank, why in enumerate(said) if why is not None]
        if refused:
            rank, why = refused[0]
            self._answer(Rejected(command.id, f"rank {rank}: {why}"))
            print(f"refused by rank {rank}: {why}", flush=True)
            return
        taken = self._change(command) if self.run.ranks.leader else False
        if ranks.gather_from_ranks(self.run.collectives, taken)[0] and not self.run.ranks.leader:
            print(f"applied from step {self.run.next_step}: {what}", flush=True)

    def _answer(self, event: Applied | Rejected) -> None:
        """Answer a command: rank 0 does, the UI steers it alone."""
        if self.run.ranks.leader:
            self.run.outbox.put(event)

    def _checkpoint(self, command: Command, done: int) -> None:
        if not self.run.settings.checkpoint.dir:
            self._answer(Rejected(command.id, "checkpoints need --checkpoint-dir"))
            return
        try:
            path = self.run.checkpoint_at(done)
        except (OSError, ValueError) as err:
            traceback.print_exc()
            self._answer(Rejected(command.id, f"checkpoint failed: {err}"))
            return
        self._answer(Applied(command.id, done, f"checkpoint {path}" if path else "checkpoint"))


# The commands rank 0 decides for every rank at a step boundary (RunCommands._agree), by
# the name each travels under.
_AGREED_COMMANDS = {kind.__name__: kind for kind in (SetPolicy, SetMargin, SetBudget, Checkpoint)}


def _command_record(command: Command) -> dict:
    """`command` as JSON data, for the other ranks (ranks.gather_from_ranks)."""
    return {"kind": type(command).__name__, **dataclasses.asdict(command)}


def _command_from_record(record: dict) -> Command:
    """The command _command_record wrote."""
    fields = dict(record)
    return _AGREED_COMMANDS[fields.pop("kind")](**fields)
