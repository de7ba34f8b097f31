"""The running worker as the tuner's `Trainer`: a setting goes to the worker as commands
(SetShape for its micro-batch, accumulation and activation checkpointing; SetBudget,
SetMargin, SetPolicy), all applied at the same step boundary, and a trial step is the next
step the run reports under it. No restart, no reload: the run goes on at its global batch,
and every trial step is one of its steps.
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
from tuitrain.tune import Candidate, Refused, StepResult
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
    """

    def __init__(self, send: Callable[[Command], int], events: Callable[[], list[Event]], *,
                 batch_size: int, grad_accum: int,
                 checkpointing: bool, policy: str, margin_ratio: float,
                 device_budget: int | None,
                 on_event: Callable[[Event], None] = lambda event: None,
                 stopped: Callable[[], bool] = lambda: False) -> None:
        self.send = send
        self.events = events
        self.current: dict[str, object] = {
            "shape": (batch_size, grad_accum, checkpointing), "policy": policy,
            "margin_ratio": margin_ratio, "device_budget": device_budget}
        self.on_event = on_event
        self.stopped = stopped
        self.first_step = 0  # the first step of the run under the setting applied last
        self.answers: dict[int, Applied | Rejected] = {}
        self.steps: list[Step] = []
        self.ended: str | None = None  # why the run will give no more steps

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
            raise Refused(refused)

    def step(self) -> StepResult:
        while True:
            while self.steps:
                step = self.steps.pop(0)
                if step.stats.step >= self.first_step:
                    return StepResult(step.stats.seconds)
            if self.stopped():  # not for a step that may take long; answers come at once
                raise TrialFailed("stopped")
            self._read()

    def _answer(self, command_id: int) -> Applied | Rejected:
        while command_id not in self.answers:
            self._read()
        return self.answers.pop(command_id)

    def _read(self) -> None:
        """Wait for the worker's next events; TrialFailed when the run gives no more."""
        if self.ended is not None:
            raise TrialFailed(self.ended)
        for event in self.events():
            self.on_event(event)
            if isinstance(event, (Applied, Rejected)):
                self.answers[event.id] = event
            elif isinstance(event, Step):
                self.steps.append(event)
            elif isinstance(event, Failed):
                self.ended = f"the run failed: {event.reason}"
            elif isinstance(event, Finished):
                self.ended = "the run ended before the trial did"
        if self.ended is not None and not self.steps and not self.answers:
            raise TrialFailed(self.ended)


def client_events(client: ProcessWorker) -> Callable[[], list[Event]]:
    """`events` for a WorkerTrainer that reads the worker itself (no UI polls it)."""

    def events() -> list[Event]:
        client.wait(WAIT_SECONDS)
        return client.poll()

    return events


def wait_for_start(client: ProcessWorker, on_event: Callable[[Event], None],
                   timeout: float | None = None) -> bool:
    """Relay events until the run has started (True) or ended first (False)."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while client.started is None:
        if client.result is not None or (deadline is not None and time.monotonic() > deadline):
            return False
        client.wait(WAIT_SECONDS)
        for event in client.poll():
            on_event(event)
    return True
