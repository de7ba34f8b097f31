"""A change asked for before the first step is applied at step 1 or refused, never fatal:
nothing can check it until a step has measured the activations, so the first step tries
it, and one that does not fit is refused with its numbers while the run goes on as it
started (the step runs again, nothing of the failed try kept)."""

from __future__ import annotations

import dataclasses
from multiprocessing import Pipe

from tuitrain.events import Failed, Rejected, SetPolicy, Step
from tuitrain.settings import Settings
from tuitrain.training_run import TrainingRun


class Outbox(list):
    def put(self, event: object) -> None:
        self.append(event)


def run_with(tmp_path, *commands, budget: str = "30MiB", grad_accum: int = 1
             ) -> tuple[int, Outbox]:
    settings = Settings(
        model="tiny",
        engine={"precision": "fp32", "policy": "auto", "device_budget": budget},
        training={"steps": 2, "batch_size": 2, "seq_len": 128, "grad_accum": grad_accum},
    )
    ui, worker = Pipe()
    for i, command in enumerate(commands, start=1):
        ui.send(dataclasses.replace(command, id=i))
    outbox = Outbox()
    run = TrainingRun(settings=settings, log_path=str(tmp_path / "log"), commands=worker,
                      outbox=outbox)
    status = run.execute()
    if run.engine is not None:
        run.engine.close()
    return status, outbox


def test_cuda_asked_before_the_first_step_that_cannot_fit_is_refused_and_the_run_goes_on(
    tmp_path,
):
    status, events = run_with(tmp_path, SetPolicy(policy="cuda"))
    assert status == 0 and not [e for e in events if isinstance(e, Failed)]
    (refused,) = [e for e in events if isinstance(e, Rejected)]
    assert refused.id == 1 and "policy cuda" in refused.reason
    assert "(2, 128)" not in refused.reason
    steps = [e.stats for e in events if isinstance(e, Step)]
    assert [(s.step, s.policy) for s in steps] == [(1, "auto"), (2, "auto")]


def test_cuda_asked_before_the_first_step_that_a_later_micro_batch_overruns_is_refused(
    tmp_path,
):
    """Two micro-batches: under cuda the first fits (34 MiB, above tiny's 33.2 MiB at one
    micro-batch) and traces, but the second would run beside every gradient of the first
    (35.7 MiB). Refused before it runs, not a run that fails mid-step."""
    status, events = run_with(tmp_path, SetPolicy(policy="cuda"), budget="34MiB", grad_accum=2)
    assert status == 0 and not [e for e in events if isinstance(e, Failed)]
    (refused,) = [e for e in events if isinstance(e, Rejected)]
    assert refused.id == 1 and refused.reason.startswith("policy cuda needs ")
    assert "the budget is 34.0 MiB" in refused.reason
    steps = [e.stats for e in events if isinstance(e, Step)]
    assert [(s.step, s.policy, s.micro_batches) for s in steps] == [(1, "auto", 2),
                                                                     (2, "auto", 2)]
