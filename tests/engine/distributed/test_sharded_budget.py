"""A sharded rank keeps the device budget the engine accepts, under every policy, down to
the least one it accepts; in one process, as rank 0 of two twins (twin_rank), so that
the bytes are a real rank's without launching one.

Under cuda a rank keeps its shards resident and gathers each chunk whole for its use: the
gathered copies come and go as auto's device copies do, and must make room for the
activations to come as those do, or the activations land beside idle copies.
"""

from __future__ import annotations

import copy

import pytest
import torch
from dp_harness import build, make_batches
from twin_rank import TwinCollectives

from engine import Engine, EngineConfig
from engine.placement import rules
from engine.placement.policy import Policy
from engine.placement.rules import BudgetTooSmall
from engine.placement.trace import Trace, TracePoint


@pytest.fixture
def twin(monkeypatch):
    monkeypatch.setattr("engine.step.engine.join", lambda *a, **k: TwinCollectives())


def _engine(model, **config) -> Engine:
    return Engine(copy.deepcopy(model), EngineConfig(precision="fp32", **config))


@pytest.fixture
def least(twin):
    """The model, batches, and the least budgets the engine accepts once it has traced a
    step: the working set, and under cuda the resident shards beside it."""
    model, batches = build(), make_batches(3, batch_size=2)
    eng = _engine(model, policy="auto", device_budget="64MiB")
    assert all(c.sharded for c in eng.chunks)
    eng.step(batches[0])
    working_set = eng.trace.working_set
    resident = sum(eng.manager.resident_cost(c) for c in eng.chunks)
    eng.close()
    return model, batches, {"cpu": working_set, "auto": working_set,
                            "cuda": resident + working_set}


@pytest.mark.parametrize("policy", ["cuda", "auto", "cpu"])
def test_a_rank_keeps_the_least_budget_its_engine_accepts(least, policy):
    model, batches, budgets = least
    budget = budgets[policy]
    eng = _engine(model, policy=policy, device_budget=budget,
                  margin_ratio=0.5 if policy == "auto" else 0.0)
    peaks = []
    for batch in batches:
        peaks.append(eng.step(batch).memory.device_peak)
        eng.set_budget(budget)  # accepted with the trace too
    with pytest.raises(BudgetTooSmall):
        eng.set_budget(budget - 1)
    eng.close()
    assert max(peaks) <= budget, (peaks, budget)


def test_under_cuda_a_sharded_chunk_gathered_for_use_makes_room_for_the_activations():
    """The term the cuda policy missed with shards: room for the non-model bytes the trace
    says are to come, which only evicting an idle gathered copy can make."""
    trace = Trace(points=[TracePoint((0,), "forward", non_model_peak=500)])
    trace.finish()
    assert rules.rules_for(Policy.CUDA).forecast(trace, 0, 200) == 300
    # While a step is traced there is no forecast: idle gathered copies go before each use.
    assert rules.rules_for(Policy.CUDA, tracing=True).release_before_use([0, 1, 2], [1]) \
        == [0, 2]


def test_before_its_first_step_a_sharded_cuda_budget_holds_the_largest_module_gathered():
    shards, module_bytes = [100, 100], [300, 500]
    rules.check_budget(1200, Policy.CUDA, trace=None, module_bytes=module_bytes,
                       resident_costs=shards)
    with pytest.raises(BudgetTooSmall, match="policy cuda needs 1.2 KiB"):
        rules.check_budget(1199, Policy.CUDA, trace=None, module_bytes=module_bytes,
                           resident_costs=shards, sharded=True)
    rules.check_budget(1200, Policy.CUDA, trace=None, module_bytes=module_bytes,
                       resident_costs=shards, sharded=True)


def test_the_plan_for_two_ranks_says_the_peak_a_rank_measures_at_the_least_cuda_budget(twin):
    """The planner replays the same rules: at the least budget the engine accepts for cuda,
    the plan says it fits, and a rank's steady step peaks where the plan says."""
    import torch
    from dp_harness import TINY_VOCAB, rank_slice

    from engine.models.zoo import build_model
    from engine.planning.planner import plan

    batches = [rank_slice(b, 0, 2) for b in make_batches(3, batch_size=4, seq_len=64,
                                                          vocab=TINY_VOCAB)]

    def engine(policy: str, budget: int) -> Engine:
        torch.manual_seed(0)
        return Engine(build_model("tiny"), EngineConfig(
            policy=policy, device_budget=budget, precision="fp32", simulate=True))

    eng = engine("auto", 2**30)
    eng.step(batches[0])
    least = eng.trace.working_set + sum(eng.manager.resident_cost(c) for c in eng.chunks)
    eng.close()
    forecast = plan("tiny", device_mem=least, host_mem="64GiB", precision="fp32",
                    simulated=True, batch_size=4, seq_len=64, nproc=2).policies["cuda"]
    assert forecast.fits, forecast.reason
    eng = engine("cuda", least)
    for batch in batches:
        peak = eng.step(batch).memory.device_peak
    eng.close()
    assert peak <= least
    assert forecast.device_peak == peak


def test_a_sharded_cuda_step_in_micro_batches_is_not_held_to_the_bound_above_its_peak(twin):
    """Sharded, cuda's need (the shards beside the whole working set) is a bound above a
    rank's peak, which the plan holds a run to before it starts. The engine refuses no
    budget a rank's micro-batches fit in: the check one process makes after its first
    micro-batch is not a sharded rank's, which on its own could also refuse on one rank
    while the others wait in the next micro-batch's collectives. tiny in bf16, a rank's
    two micro-batches of 1 x 128 tokens: the bound is 19,325,964 bytes, the peak
    18,932,108."""
    from engine.models.zoo import build_model

    torch.manual_seed(0)
    budget = 19_000_000
    eng = Engine(build_model("tiny"), EngineConfig(policy="cuda", device_budget=budget,
                                                   precision="bf16", grad_accum=2))
    for seed in range(2):
        ids = torch.randint(0, 8192, (2, 128), generator=torch.Generator().manual_seed(seed))
        assert eng.step({"input_ids": ids, "labels": ids}).memory.device_peak <= budget
    need = sum(rules.cuda_need([eng.manager.resident_cost(c) for c in eng.chunks],
                               trace=eng.trace, working_set=eng.trace.working_set,
                               sharded=True))
    eng.close()
    assert need > budget  # the bound the engine no longer holds a rank to
