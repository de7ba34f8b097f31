"""The running worker as the tuner's `Trainer`: a setting goes to the worker as commands
(SetShape for its micro-batch, accumulation and activation checkpointing; SetBudget,
SetMargin, SetPolicy), all applied at the same step boundary, and a trial step is the next
step the run reports under it. No restart, no reload: the run goes on at its global batch,
and every trial step is one of its steps. A run of a known length (`last_step`) ends the
search when its steps run out (tuitrain.tune.Ended), not a trial.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from tuitrain.events import (
    Applied,
    Command,
    Event,
    Failed,
    Finished,
    Rejected,
    SetBudget,
    SetMargin,
    SetPolicy,
    SetShape,
    Step,
)
from tuitrain.tune import Candidate, Ended, Refused, StepResult
from tuitrain.tune import Failed as TrialFailed

if TYPE_CHECKING:
    from tuitrain.worker import ProcessWorker

WAIT_SECONDS = 0.05  # longest sleep between looks at the worker


class WorkerTrainer:
    """Trials in the run a worker trains.

    Args:
        send: sends a command to the worker; returns its id.
        events: the worker's events since the last call, waiting a moment for some.
        batch_size, grad_accum, checkpointing, policy, margin_ratio, device_budget: the
            run's setting now (what it started with).
        on_event: every event read while waiting, so the caller still shows the run.
        stopped: asked while waiting; True makes the wait end as a failed step.
        last_step: the number of the run's last step (its training.steps); None: a run
            that is not counted on to end (the trainer learns of its end when it comes).
        after: the step the run resumed after (its checkpoint's); 0: a run from its start.
            The run's steps are counted from there before it reports one.
    """

    def __init__(self, send: Callable[[Command], int], events: Callable[[], list[Event]], *,
                 batch_size: int, grad_accum: int,
                 checkpointing: bool, policy: str, margin_ratio: float,
                 device_budget: int | None,
                 on_event: Callable[[Event], None] = lambda event: None,
                 stopped: Callable[[], bool] = lambda: False,
                 last_step: int | None = None, after: int = 0) -> None:
        self.send = send
        self.events = events
        self.current: dict[str, object] = {
            "shape": (batch_size, grad_accum, checkpointing), "policy": policy,
            "margin_ratio": margin_ratio, "device_budget": device_budget}
        self.on_event = on_event
        self.stopped = stopped
        self.first_step = 0  # the first step of the run under the setting applied last
        self.last_step = last_step
        self.newest = after  # the number of the latest step read
        self.taken = after  # the number of the latest step handed out, or passed over
        self.answers: dict[int, Applied | Rejected] = {}
        self.steps: list[Step] = []
        self.ended: str | None = None  # why the run will give no more steps
        self.finished = False  # it ended as runs end, not failed

    def apply(self, candidate: Candidate) -> None:
        c = candidate
        shape = (c.batch_size, c.grad_accum, c.activation_checkpointing)
        wanted = {"shape": shape, "policy": c.policy, "margin_ratio": c.margin_ratio,
                  "device_budget": c.device_budget}
        commands = {"shape": SetShape(batch_size=c.batch_size, grad_accum=c.grad_accum,
                                      activation_checkpointing=c.activation_checkpointing),
                    "policy": SetPolicy(policy=c.policy),
                    "margin_ratio": SetMargin(margin_ratio=c.margin_ratio),
                    "device_budget": SetBudget(device_budget=c.device_budget)}
        # All sent before any answer is awaited, so that the worker applies them at the
        # same step: no step runs under half of the change (a setting of its own). The
        # shape first: the worker then checks the rest with it, by the plan, not against a
        # trace of the old shape, and takes all of them back if its first step overruns.
        sent = {key: self.send(commands[key]) for key in ("shape", "device_budget",
                                                          "margin_ratio", "policy")
                if wanted[key] != self.current[key] and wanted[key] is not None}
        refused = None
        for key, command_id in sent.items():
            answer = self._answer(command_id)
            if isinstance(answer, Rejected):
                refused = refused or answer.reason
                continue
            self.current[key] = wanted[key]
            self.first_step = max(self.first_step, answer.step)
        if refused is not None:
            if self._at_end():  # the commands came after the last step
                raise Ended(f"the run ended before the change: {refused}")
            raise Refused(refused)

    def step(self) -> StepResult:
        passed = 0  # steps that ran before the change took effect
        while True:
            while self.steps:
                step = self.steps.pop(0)
                self.taken = step.stats.step
                if step.stats.step >= self.first_step:
                    return StepResult(step.stats.seconds, earlier=passed)
                passed += 1
            if self.last_step is not None and self.taken >= self.last_step:
                raise Ended("the run made its last step")
            if self.stopped():  # not for a step that may take long; answers come at once
                raise TrialFailed("stopped")
            self._read()

    def steps_left(self) -> int | None:
        """Steps the run will still make after a change asked for now: those after the one
        under way (the change waits for its end); None when the run's length is not known."""
        if self.finished:
            return 0
        if self.last_step is None:
            return None
        return max(0, self.last_step - self.newest - 1)

    def holds(self, candidate: Candidate) -> bool:
        """Whether the run's setting now is `candidate`."""
        c = candidate
        return self.current == {
            "shape": (c.batch_size, c.grad_accum, c.activation_checkpointing),
            "policy": c.policy, "margin_ratio": c.margin_ratio,
            "device_budget": c.device_budget}

    @property
    def free_from(self) -> int:
        """The first step of the run under the setting now that no trial took: where the
        run goes on with it once the search is over."""
        return max(self.first_step, self.taken + 1)

    def _at_end(self) -> bool:
        """Whether the run has made its last step, by its number or by its Finished."""
        return self.finished or (self.last_step is not None and self.newest >= self.last_step)

    def _answer(self, command_id: int) -> Applied | Rejected:
        while command_id not in self.answers:
            self._read()
        return self.answers.pop(command_id)

    def _read(self) -> None:
        """Wait for the worker's next events; Ended when the run finished, TrialFailed when
        it failed."""
        if self.ended is not None:
            raise Ended(self.ended) if self.finished else TrialFailed(self.ended)
        for event in self.events():
            self.on_event(event)
            if isinstance(event, (Applied, Rejected)):
                self.answers[event.id] = event
            elif isinstance(event, Step):
                self.steps.append(event)
                self.newest = max(self.newest, event.stats.step)
            elif isinstance(event, Failed):
                self.ended = f"the run failed: {event.reason}"
            elif isinstance(event, Finished):
                self.ended, self.finished = "the run ended before the trial did", True
        if self.ended is not None and not self.steps and not self.answers:
            raise Ended(self.ended) if self.finished else TrialFailed(self.ended)


class Stopped(Exception):
    """The run was asked to stop (tuitrain.stop_requests): what waited for the worker ends
    where it is, a search in the middle of a trial."""


def client_events(client: ProcessWorker, stopped: Callable[[], bool] = lambda: False
                  ) -> Callable[[], list[Event]]:
    """`events` for a WorkerTrainer that reads the worker itself (no UI polls it); it
    raises Stopped once `stopped()`, asked before each wait, says the run is stopping."""

    def events() -> list[Event]:
        found = _next_events(client, stopped)
        if found is None:
            raise Stopped
        return found

    return events


def _next_events(client: ProcessWorker, stopped: Callable[[], bool]) -> list[Event] | None:
    """The worker's events after one wait, or None once `stopped()` says the run is
    stopping: asked before the wait and after it, so that a SIGTERM to the whole job that
    came during the wait stops the run before the worker's death by it reads as a failure."""
    if stopped():
        return None
    client.wait(WAIT_SECONDS)
    return None if stopped() else client.poll()


def wait_for_start(client: ProcessWorker, on_event: Callable[[Event], None],
                   timeout: float | None = None,
                   stopped: Callable[[], bool] = lambda: False) -> bool:
    """Relay events until the run has started (True), or ended first, or `stopped()`,
    asked before each wait, said it is stopping (False)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while client.started is None:
        if client.result is not None or (deadline is not None and time.monotonic() > deadline):
            return False
        if (found := _next_events(client, stopped)) is None:
            return False
        for event in found:
            on_event(event)
    return True


def wait_for_end(client: ProcessWorker, on_event: Callable[[Event], None],
                 stopped: Callable[[], bool] = lambda: False) -> bool:
    """Relay events until the run has ended, Finished or Failed (True: a run of --steps N
    that goes on after the search, or one asked to stop), or `stopped()`, asked before
    each wait, says to wait no more (False)."""
    while client.result is None:
        if (found := _next_events(client, stopped)) is None:
            return False
        for event in found:
            on_event(event)
    return True
