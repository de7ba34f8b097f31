"""SetShape: a running run changes how it splits its global batch into micro-batches, and
activation checkpointing, between steps. The global batch, the data order and the math do
not change: the losses are an unchanged run's (fp32, within the accumulation tolerance). A
shape that does not fit is refused with the plan's reason, or, when only its first step
finds out, taken back and that step run again; a checkpoint records the shape in force and
resumes at the exact data position."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from tuitrain import run_commands
from tuitrain.checkpoint import find_checkpoint
from tuitrain.events import Applied, Failed, Rejected, SetPolicy, SetShape, Step
from tuitrain.run_commands import RunCommands
from tuitrain.settings import Settings
from tuitrain.training_run import TrainingRun

TOL = 1e-5  # the engine's accumulation tolerance (tests/engine/test_invariant.py)
# A budget where micro-batches of 2 sequences of tiny fit, and of 4 do not.
TIGHT = "12MiB"


class Outbox(list):
    def put(self, event: object) -> None:
        self.append(event)


class Scheduled:
    """A command channel that hands each command over once the run is about to run the
    step it is scheduled before."""

    def __init__(self, schedule: dict[int, list]) -> None:
        numbered = iter(range(1, 1000))
        self.waiting = [(step, dataclasses.replace(c, id=next(numbered)))
                        for step, commands in sorted(schedule.items()) for c in commands]
        self.run: TrainingRun | None = None

    def _due(self) -> bool:
        return bool(self.waiting) and self.waiting[0][0] <= self.run.next_step

    def poll(self, timeout: float = 0.0) -> bool:
        return self._due()

    def recv(self):
        return self.waiting.pop(0)[1]


def settings(budget: str = "256MiB", checkpoint: dict | None = None, **training) -> Settings:
    return Settings(model="tiny",
                    engine={"precision": "fp32", "policy": "cpu", "device_budget": budget},
                    training={"steps": 4, "batch_size": 2, "grad_accum": 2, "seq_len": 32,
                              **training},
                    checkpoint=checkpoint or {})


def run(tmp_path, s: Settings, schedule: dict[int, list] | None = None
        ) -> tuple[int, Outbox, TrainingRun]:
    channel = Scheduled(schedule or {})
    outbox = Outbox()
    training = TrainingRun(settings=s, log_path=str(tmp_path / "log"), commands=channel,
                           outbox=outbox)
    channel.run = training
    status = training.execute()
    return status, outbox, training


def steps(events: list) -> list:
    return [e.stats for e in events if isinstance(e, Step)]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[float]:
    """The losses of the run with no change."""
    status, events, _ = run(tmp_path_factory.mktemp("plain"), settings())
    assert status == 0
    return [s.loss for s in steps(events)]


def test_a_run_whose_shape_changes_every_step_has_the_losses_of_one_that_never_changed(
        tmp_path, plain):
    """A split that is not of the global batch is refused at once; the others are
    answered with the step that ran with them first."""
    schedule = {2: [SetShape(batch_size=3), SetShape(batch_size=4)],
                3: [SetShape(batch_size=1, activation_checkpointing=True),
                    SetShape(batch_size=2, grad_accum=1)],
                4: [SetShape(activation_checkpointing=False)]}
    status, events, training = run(tmp_path, settings(), schedule)
    assert status == 0
    answers = [e for e in events if isinstance(e, Applied | Rejected)]
    assert [(type(a), a.id) for a in answers] == [
        (Rejected, 1), (Applied, 2), (Rejected, 4), (Applied, 3), (Applied, 5)]
    assert [a.step for a in answers if isinstance(a, Applied)] == [2, 3, 4]
    assert [a.reason for a in answers if isinstance(a, Rejected)] == [
        "3 x 1 sequences is not the run's global batch of 4, which a run keeps",
        "2 x 1 sequences is not the run's global batch of 4, which a run keeps"]
    assert answers[3].what == "batch_size 1 x grad_accum 4, activation_checkpointing on"
    ran = steps(events)
    assert [(s.micro_batches, s.activation_checkpointing) for s in ran] == [
        (2, False), (1, False), (4, True), (4, False)]
    assert [s.loss for s in ran] == pytest.approx(plain, rel=TOL)
    t = training.settings.training  # what a checkpoint of the run records
    assert (t.batch_size, t.grad_accum, t.activation_checkpointing) == (1, 4, False)


def test_a_shape_the_plan_says_does_not_fit_is_refused_with_its_reason_before_any_step(
        tmp_path):
    status, events, _ = run(tmp_path, settings(TIGHT, steps=2),
                            {2: [SetShape(batch_size=4), SetPolicy(policy="auto")]})
    assert status == 0 and not [e for e in events if isinstance(e, Failed)]
    refused = [e for e in events if isinstance(e, Rejected)]
    # The policy came with the shape: it goes with it.
    assert [r.id for r in refused] == [1, 2]
    assert refused[0].reason.startswith("micro-batches of 4 sequences without activation "
                                        "checkpointing do not fit: ")
    ran = steps(events)
    assert [(s.micro_batches, s.policy) for s in ran] == [(2, "cpu")] * 2


def test_a_shape_whose_first_step_overruns_is_taken_back_and_the_step_runs_again(
        tmp_path, plain, monkeypatch):
    """What the plan let through and the traced step still finds too big: that step is
    refused, nothing of it kept, and the run's losses are still the unchanged run's."""
    monkeypatch.setattr(run_commands, "check_fits", lambda *args: None)
    status, events, _ = run(tmp_path, settings(TIGHT, steps=3), {2: [SetShape(batch_size=4)]})
    assert status == 0
    (refused,) = [e for e in events if isinstance(e, Rejected)]
    assert refused.id == 1 and refused.reason.startswith("device budget 12.0 MiB is below ")
    assert refused.reason.endswith("; the run keeps its settings")
    ran = steps(events)
    assert [(s.step, s.micro_batches) for s in ran] == [(1, 2), (2, 2), (3, 2)]
    assert [s.loss for s in ran] == pytest.approx(plain[:3], rel=TOL)


def test_a_checkpoint_records_the_shape_in_force_and_resumes_at_the_exact_data_position(
        tmp_path, plain):
    folder = tmp_path / "ck"
    status, _, _ = run(tmp_path, settings(steps=2, checkpoint={"dir": str(folder)}),
                       {2: [SetShape(batch_size=4)]})
    assert status == 0
    saved = find_checkpoint(folder)
    state = json.loads((saved / "state.json").read_text())
    assert state["settings"]["training"]["batch_size"] == 4
    assert state["settings"]["training"]["grad_accum"] == 1
    assert state["engine"]["grad_accum"] == 1
    # Resumed with the flags the run started with (2 x 2): the same global batch, the data
    # where it was, the losses of a run that never stopped.
    status, events, _ = run(tmp_path, settings(checkpoint={"resume": str(saved)}))
    assert status == 0
    assert [s.step for s in steps(events)] == [3, 4]
    assert [s.loss for s in steps(events)] == pytest.approx(plain[2:], rel=TOL)


def test_a_data_parallel_run_refuses_a_new_shape():
    outbox = Outbox()
    channel = Scheduled({1: [SetShape(batch_size=4)]})
    steered = SimpleNamespace(settings=settings(), ranks=SimpleNamespace(parallel=True),
                              next_step=1, outbox=outbox)
    channel.run = steered
    RunCommands(run=steered, channel=channel).drain()
    (refused,) = outbox
    assert isinstance(refused, Rejected)
    assert refused.reason == "a data-parallel run keeps the shape it started with"
