"""`plan(..., nproc=N)` is what each of N data-parallel ranks then measures.

Real gloo ranks (dp_harness) train the zoo's `tiny` on the simulated device under each
policy with per-rank budgets; the plan for that many ranks, made beforehand in the test's
own process, must give each rank's device peak of a steady step, its host chunk bytes, the
bytes it copies between host and device, and the bytes it gathers and reduce-scatters
(StepStats.bytes_gathered, .bytes_reduce_scattered), as the engine reports them on every
rank. Two ranks and three (padding that does not divide the chunks evenly), fp32 and bf16.
"""

from __future__ import annotations

import pytest
import torch
from dp_harness import COLLECTIVE_TIMEOUT, TINY_VOCAB, make_batches, rank_slice, run_ranks

from engine.planning.planner import plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PER_RANK, SEQ_LEN, STEPS = 2, 64, 3
# Device bytes are exact in fp32. In bf16 the meta device keeps a layer norm's statistics
# in fp32 and the CPU in bf16: a few KiB of a 14 MB peak (2.5 KiB on tiny), nothing else.
CLOSE = {"fp32": 0.0, "bf16": 1e-3}


def _scenarios(world: int, precision: str) -> list[dict]:
    """Per-rank budgets from the plan: ample for cuda; for cpu and auto a little above the
    working set, so that auto evicts and the margin has room for a few shards. Activation
    checkpointing too: its recomputation gathers chunks inside backward."""
    p = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision=precision, simulated=True,
             batch_size=PER_RANK * world, seq_len=SEQ_LEN, nproc=world)
    tight = int(p.working_set * 1.3)
    return [
        {"policy": "cuda", "budget": 256 * 2**20, "margin": 0.0},
        {"policy": "cpu", "budget": tight, "margin": 0.0},
        {"policy": "auto", "budget": tight, "margin": 0.0},
        {"policy": "auto", "budget": tight, "margin": 0.5},
        {"policy": "cpu", "budget": tight, "margin": 0.0, "checkpointing": True},
    ]


def steps(rank: int, world: int, *, precision: str, scenarios: list[dict]) -> list[dict]:
    """Each scenario on this rank: the zoo's tiny (the same weights on every rank), STEPS
    steps on this rank's part of the global batches; the last step's figures."""
    from engine import Engine, EngineConfig
    from engine.models.zoo import build_model

    batches = [rank_slice(b, rank, world) for b in make_batches(
        STEPS, batch_size=PER_RANK * world, seq_len=SEQ_LEN, vocab=TINY_VOCAB)]
    out = []
    for sc in scenarios:
        torch.manual_seed(0)
        model = build_model("tiny")
        if sc.get("checkpointing"):
            model.activation_checkpointing_enable()
        eng = Engine(model, EngineConfig(
            policy=sc["policy"], device_budget=sc["budget"], margin_ratio=sc["margin"],
            precision=precision, simulate=True, collective_timeout=COLLECTIVE_TIMEOUT))
        for batch in batches:
            stats = eng.step(batch)
        out.append({"device_peak": stats.memory.device_peak,
                    "host_model": stats.memory.host_model,
                    "copied": stats.bytes_h2d + stats.bytes_d2h,
                    "gathered": stats.bytes_gathered,
                    "reduce_scattered": stats.bytes_reduce_scattered,
                    "working_set": eng.trace.working_set,
                    "chunks": len(eng.chunks)})
        eng.close()
    return out


@pytest.mark.parametrize(("world", "precision"), [(2, "fp32"), (3, "bf16")])
def test_each_rank_measures_what_the_plan_for_its_ranks_forecasts(tmp_path, world, precision):
    scenarios = _scenarios(world, precision)
    ranks = run_ranks(world, "test_plan_ranks.steps", tmp_path, deadline=240.0,
                      precision=precision, scenarios=scenarios)
    for i, sc in enumerate(scenarios):
        forecast = plan("tiny", device_mem=sc["budget"], host_mem="64GiB", precision=precision,
                        simulated=True, batch_size=PER_RANK * world, seq_len=SEQ_LEN,
                        margin_ratio=sc["margin"], checkpointing=sc.get("checkpointing", False),
                        nproc=world)
        row = forecast.policies[sc["policy"]]
        assert row.fits, row.reason
        for rank, measured in enumerate(r[i] for r in ranks):
            where = f"{sc} on rank {rank} of {world}"
            assert forecast.chunks == measured["chunks"], where
            close = pytest.approx(measured["working_set"], rel=CLOSE[precision], abs=0)
            assert forecast.working_set == close, where
            close = pytest.approx(measured["device_peak"], rel=CLOSE[precision], abs=0)
            assert row.device_peak == close, where
            assert row.host_model == measured["host_model"], where
            assert row.copied == measured["copied"], where
            assert row.gathered == measured["gathered"], where
            assert row.reduce_scattered == measured["reduce_scattered"], where
