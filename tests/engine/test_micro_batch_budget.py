"""With several micro-batches a step's device peak is its highest micro-batch's: a later one
runs its forward beside the gradients the one before left on the device (under cuda every
chunk's). The plan says so, and the engine holds a budget to the same rule: one the plan
says fits runs, a byte less is refused by both, and the engine refuses it with the numbers
(BudgetTooSmall) once the first micro-batch has traced, never by running out of room in a
later one (DeviceOutOfMemory)."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, format_size
from engine.models.zoo import build_model
from engine.placement.rules import BudgetTooSmall
from engine.planning.planner import plan

SHAPE = {"batch_size": 2, "seq_len": 64}  # one micro-batch's
ACCUM = 2


def forecast(budget: int | str, *, grad_accum: int = ACCUM):
    # fp32: the plan's bytes are the engine's to the byte (bf16 keeps layer-norm statistics
    # in fp32 on the meta device, a few KiB above the engine's).
    return plan("tiny", device_mem=budget, host_mem="64GiB", precision="fp32", simulated=True,
                grad_accum=grad_accum, **SHAPE)


def tiny_engine(policy: str, budget: int) -> Engine:
    return Engine(build_model("tiny"), EngineConfig(policy=policy, device_budget=budget,
                                                    precision="fp32", simulate=True,
                                                    grad_accum=ACCUM))


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 512, (ACCUM * SHAPE["batch_size"], SHAPE["seq_len"]),
                        generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def least_budget(policy: str) -> int:
    """The least device budget the plan gives `policy`: cuda's peak, where every chunk stays;
    cpu's and auto's, the working set."""
    roomy = forecast("6GiB")
    return roomy.cuda.device_peak if policy == "cuda" else roomy.working_set


@pytest.mark.parametrize("policy", ["cuda", "cpu", "auto"])
def test_the_least_budget_the_plan_gives_runs_and_a_byte_less_is_refused_by_both(policy):
    need = least_budget(policy)
    assert forecast(need).policies[policy].fits
    refused = forecast(need - 1).policies[policy]
    assert not refused.fits and refused.reason

    with tiny_engine(policy, need) as eng:
        peaks = [eng.step(batch(seed)).memory.device_peak for seed in range(2)]
    assert max(peaks) <= need
    with tiny_engine(policy, need - 1) as eng, pytest.raises(BudgetTooSmall):
        eng.step(batch())


def test_cuda_needs_more_with_micro_batches_than_with_one():
    """The gradients meet the activations only from the second micro-batch on."""
    assert forecast("6GiB").cuda.device_peak > forecast("6GiB", grad_accum=1).cuda.device_peak


def test_cuda_between_one_micro_batchs_peak_and_the_steps_is_refused_with_the_numbers():
    """The first micro-batch fits and traces; the step is refused before the second runs,
    naming what cuda needs, and nothing of it is kept: the engine goes on under auto."""
    one = forecast("6GiB", grad_accum=1).cuda.device_peak
    need = least_budget("cuda")
    budget = (one + need) // 2
    with tiny_engine("cuda", budget) as eng:
        before = eng.model_state_dict()
        with pytest.raises(BudgetTooSmall) as refused:
            eng.step(batch())
        message = str(refused.value)
        assert message.startswith(f"policy cuda needs {format_size(need)} on the device")
        assert f"the budget is {format_size(budget)}" in message
        after = eng.model_state_dict()
        assert all(torch.equal(before[name], after[name]) for name in before)

        eng.set_policy("auto")
        stats = eng.step(batch())
    assert stats.step == 1 and stats.policy == "auto" and stats.micro_batches == ACCUM
    assert stats.memory.device_peak <= budget
