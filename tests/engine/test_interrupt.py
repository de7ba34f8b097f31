"""Engine.interrupt(): a step cut short leaves the engine as it was before that step, so the
run goes on exactly as if the step had never started."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build, make_batches

from engine import Engine, EngineConfig, TensorState
from engine.step.engine import StepInterrupted

MODEL = build("opt", layers=4, hidden=64)
BATCHES = make_batches(4)
INTERRUPTED_STEP = 2  # the third step, so the engine has a trace and optimizer state


def interrupt_at(eng: Engine, boundary: int) -> None:
    """Ask for an interrupt just as the step reaches its `boundary`-th module boundary."""
    point = eng.runner._point
    seen = 0

    def counting(key: int, phase: str, *fetch: bool) -> None:
        nonlocal seen
        if seen == boundary:
            eng.interrupt()
        seen += 1
        point(key, phase, *fetch)

    eng.runner._point = counting


def run(config: EngineConfig, boundary: int | None) -> tuple[list[float], dict]:
    eng = Engine(copy.deepcopy(MODEL), config)
    losses = []
    for i, batch in enumerate(BATCHES):
        if i == INTERRUPTED_STEP and boundary is not None:
            before = eng.manager.device_bytes
            interrupt_at(eng, boundary)
            with pytest.raises(StepInterrupted):
                eng.step(batch)
            del eng.runner._point  # the class's own again
            assert eng.step_count == i
            assert eng.manager.grad_bytes == 0 and eng.manager.device_bytes == before
            assert all(c.computing == 0 and not c.holds_grads for c in eng.chunks)
            assert all(s.state in (TensorState.FREE, TensorState.HOLD)
                       for c in eng.chunks for s in c.slots)
        losses.append(eng.step(batch).loss)
    return losses, eng.model_state_dict()


def boundaries() -> tuple[int, int]:
    """(a boundary in the forward, the last in the backward) of a step of MODEL: by the
    last, most chunks' gradients have gone home, into the bf16 payload."""
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(device_budget="64MiB"))
    eng.step(BATCHES[0])
    phases = [p.phase for p in eng.trace.points]
    return phases.index("forward") + 3, len(phases) - 1


FORWARD, BACKWARD = boundaries()


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("policy,precision,margin", [
    ("auto", "fp32", 0.0), ("cpu", "bf16", 0.0), ("auto", "bf16", 1.0), ("cuda", "fp32", 0.0),
])
def test_an_interrupted_step_changes_nothing(policy, precision, margin, where):
    config = EngineConfig(policy=policy, precision=precision, margin_ratio=margin,
                          device_budget="64MiB")
    boundary = FORWARD if where == "forward" else BACKWARD
    losses, weights = run(config, boundary)
    ref_losses, ref_weights = run(config, None)
    assert losses == ref_losses
    assert weights.keys() == ref_weights.keys()
    assert all(torch.equal(weights[k], ref_weights[k]) for k in weights)


def test_an_interrupt_between_steps_stops_the_next_step_at_its_first_module():
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(device_budget="64MiB"))
    eng.step(BATCHES[0])
    eng.interrupt()
    with pytest.raises(StepInterrupted, match="step 2 was interrupted in the forward"):
        eng.step(BATCHES[1])
    assert eng.step(BATCHES[1]).step == 2  # the flag is spent
