"""How a step is built changes between steps like a placement setting: the micro-batches a
batch is split into and activation checkpointing. The math does not: in fp32 a run whose
shape changed mid-run gives the losses and weights of plain AdamW on the whole batches,
within the tolerance of gradient accumulation (its sums round differently)."""

from __future__ import annotations

import copy

import pytest
from conftest import build, engine_run, make_batches, reference_run, whole_model_relative_difference

from engine import Engine, EngineConfig
from engine.placement.rules import BudgetTooSmall

STEPS = 5
TOL = 1e-5
MODEL = build("opt", layers=4)
BATCHES = make_batches(STEPS, batch_size=4, seed=7)
REF_LOSSES, REF_WEIGHTS = reference_run(MODEL, BATCHES)
AMPLE = 64 * 2**20
# Each step its own shape: 4 x 1, then 2 x 2, then checkpointed, then 1 x 4, then 4 x 1.
SHAPES = [(), (("grad_accum", 2),), (("checkpointing", True),),
          (("grad_accum", 4), ("checkpointing", False)), (("grad_accum", 1),)]


def working_set(grad_accum: int) -> int:
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(device_budget="1GiB", grad_accum=grad_accum))
    eng.step(BATCHES[0])
    return eng.trace.working_set


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_a_run_whose_shape_changes_mid_run_matches_adamw_on_the_whole_batches(policy):
    eng, losses = engine_run(MODEL, BATCHES, changes=SHAPES, policy=policy,
                             device_budget=AMPLE, margin_ratio=0.5)
    assert losses == pytest.approx(REF_LOSSES, rel=TOL)
    assert whole_model_relative_difference(eng.model_state_dict(), REF_WEIGHTS) <= TOL
    assert eng.settings.grad_accum == 1 and not eng.settings.activation_checkpointing


def test_each_change_is_reported_at_the_step_it_took_effect_and_that_step_traces_anew():
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(device_budget=AMPLE))
    eng.step(BATCHES[0])
    first = eng.trace
    assert eng.set_grad_accum(2) == "grad_accum 2"
    assert eng.set_checkpointing(True) == "activation_checkpointing on"
    assert eng.settings.grad_accum == 1  # staged: the next step is the first with them
    stats = eng.step(BATCHES[1])
    assert stats.applied == ["grad_accum 2", "activation_checkpointing on"]
    assert stats.micro_batches == 2 and eng.trace is not first
    assert eng.trace.key[0] == (2, BATCHES[1]["input_ids"].shape[1]) and eng.trace.key[1]
    assert eng.state_meta()["grad_accum"] == 2
    assert eng.state_meta()["activation_checkpointing"] is True


def test_a_split_the_batch_does_not_allow_is_refused_and_nothing_is_staged():
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(device_budget=AMPLE))
    eng.step(BATCHES[0])
    with pytest.raises(ValueError, match="does not split into 3"):
        eng.set_grad_accum(3)
    with pytest.raises(ValueError, match="at least 1"):
        eng.set_grad_accum(0)
    assert eng.staged == eng.settings
    assert eng.step(BATCHES[1]).micro_batches == 1


def test_a_micro_batch_that_overruns_the_budget_fails_its_first_step_and_the_run_goes_back():
    """A larger micro-batch is traced at its first step: over the budget, that step is
    BudgetTooSmall and nothing of it is kept; restore_settings() goes back and the run's
    losses are still AdamW's."""
    budget = int(working_set(2) * 1.05)
    assert budget < working_set(1)
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy="auto", device_budget=budget,
                                                    grad_accum=2, precision="fp32"))
    losses = [eng.step(BATCHES[0]).loss]
    before = eng.settings
    eng.set_grad_accum(1)
    with pytest.raises(BudgetTooSmall):
        eng.step(BATCHES[1])
    assert eng.step_count == 1
    eng.restore_settings(before)
    losses += [eng.step(b).loss for b in BATCHES[1:]]
    assert losses == pytest.approx(REF_LOSSES, rel=TOL)
    assert whole_model_relative_difference(eng.model_state_dict(), REF_WEIGHTS) <= TOL
