"""The warm-up trace is recorded again whenever the step changes, not only its shape: a
switch away from the cuda policy, activation checkpointing turned on, a layer unfrozen.
A change the engine cannot run is refused when asked, and training goes on as before."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import Engine, EngineConfig
from tests.engine.conftest import build, make_batches, max_relative_difference, reference_run

MODEL = build("opt", layers=4, hidden=64)
BATCHES = make_batches(6)


def engine(policy: str = "auto", budget: str | int = "64MiB", model=None) -> Engine:
    return Engine(copy.deepcopy(model or MODEL),
                  EngineConfig(policy=policy, device_budget=budget, simulate=True))


def test_a_cuda_trace_tells_what_cpu_needs_so_the_switch_runs_at_that_budget():
    eng = engine("cuda")
    for batch in BATCHES[:2]:
        eng.step(batch)
    need = int(1.05 * eng.min_working_set())  # the margin every tight-budget test leaves
    eng.set_policy("cpu")
    eng.set_budget(need)
    losses = [eng.step(b) for b in BATCHES[2:]]
    assert all(s.memory.device_peak <= need for s in losses)
    ref_losses, ref = reference_run(MODEL, BATCHES)
    assert [s.loss for s in losses] == pytest.approx(ref_losses[2:], rel=1e-5)
    assert max_relative_difference(eng.model_state_dict(), ref) <= 1e-5


def test_a_budget_the_new_policy_cannot_run_is_refused_and_training_goes_on():
    eng = engine("cuda")
    eng.step(BATCHES[0])
    too_small = eng.min_working_set() - 4096
    eng.set_policy("cpu")
    with pytest.raises(ValueError, match="minimum working set"):
        eng.set_budget(too_small)
    stats = [eng.step(b) for b in BATCHES[1:]]
    assert [s.policy for s in stats] == ["cpu"] * len(stats)
    assert all(s.device_budget == 64 * 2**20 for s in stats)
    ref_losses, _ = reference_run(MODEL, BATCHES)
    assert [s.loss for s in stats] == pytest.approx(ref_losses[1:], rel=1e-5)


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_checkpointing_turned_on_mid_run_is_traced_again(policy):
    fresh = engine(policy)
    fresh.model.gradient_checkpointing_enable()
    fresh.step(BATCHES[0])
    tight = int(1.05 * fresh.min_working_set())

    eng = engine(policy)
    for batch in BATCHES[:2]:
        eng.step(batch)
    eng.model.gradient_checkpointing_enable()
    eng.step(BATCHES[2])  # traced again, now with the recomputation
    assert eng.trace.key != () and eng.min_working_set() == fresh.min_working_set()
    eng.set_budget(tight)
    stats = [eng.step(b) for b in BATCHES[3:]]
    assert all(s.memory.device_peak <= tight for s in stats)
    ref_losses, ref = reference_run(MODEL, BATCHES)
    assert [s.loss for s in stats] == pytest.approx(ref_losses[3:], rel=1e-5)


def test_unfreezing_a_layer_records_a_new_trace_with_its_gradients():
    model = copy.deepcopy(MODEL)
    for p in model.model.decoder.layers[1:].parameters():
        p.requires_grad_(False)
    eng = engine("cpu", model=model)
    eng.step(BATCHES[0])
    frozen = eng.trace
    for p in eng.model.model.decoder.layers[1:].parameters():
        p.requires_grad_(True)
    before = eng.model_state_dict()
    eng.step(BATCHES[1])
    assert eng.trace is not frozen and eng.trace.key != frozen.key
    after = eng.model_state_dict()
    name = "model.decoder.layers.2.fc1.weight"
    assert not torch.equal(after[name], before[name])  # it trained
    assert all(p.grad is None for p in eng.model.parameters())
