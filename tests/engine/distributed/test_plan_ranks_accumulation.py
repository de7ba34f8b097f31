"""`plan(..., nproc=N, grad_accum=K)`: what each rank copies, gathers and reduce-scatters
in a step of K micro-batches, each of which gathers what it needs again and reduces its
gradients into the shards, is what the rank then reports for its step (StepStats
.bytes_h2d + .bytes_d2h, .bytes_gathered, .bytes_reduce_scattered)."""

from __future__ import annotations

import pytest
import torch
from dp_harness import COLLECTIVE_TIMEOUT, TINY_VOCAB, make_batches, rank_slice, run_ranks

from engine.planning.planner import plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WORLD, PER_RANK, SEQ_LEN, STEPS, ACCUM = 2, 2, 64, 3, 2


def _scenarios(precision: str) -> list[dict]:
    p = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision=precision, simulated=True,
             batch_size=PER_RANK * WORLD, seq_len=SEQ_LEN, nproc=WORLD)
    tight = int(p.working_set * 1.3)  # auto evicts
    return [{"policy": "cpu", "budget": tight}, {"policy": "auto", "budget": tight}]


def steps(rank: int, world: int, *, precision: str, scenarios: list[dict]) -> list[dict]:
    """Each scenario on this rank, STEPS steps of ACCUM micro-batches on its part of the
    global batches; the last step's figures."""
    from engine import Engine, EngineConfig
    from engine.models.zoo import build_model

    batches = [rank_slice(b, rank, world) for b in make_batches(
        STEPS, batch_size=PER_RANK * world * ACCUM, seq_len=SEQ_LEN, vocab=TINY_VOCAB)]
    out = []
    for sc in scenarios:
        torch.manual_seed(0)
        eng = Engine(build_model("tiny"), EngineConfig(
            policy=sc["policy"], device_budget=sc["budget"], precision=precision,
            simulate=True, grad_accum=ACCUM, collective_timeout=COLLECTIVE_TIMEOUT))
        for batch in batches:
            stats = eng.step(batch)
        out.append({"copied": stats.bytes_h2d + stats.bytes_d2h,
                    "gathered": stats.bytes_gathered,
                    "reduce_scattered": stats.bytes_reduce_scattered,
                    "micro_batches": stats.micro_batches})
        eng.close()
    return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_each_rank_moves_what_the_plan_forecasts_for_every_micro_batch(tmp_path, precision):
    scenarios = _scenarios(precision)
    ranks = run_ranks(WORLD, "test_plan_ranks_accumulation.steps", tmp_path, deadline=240.0,
                      precision=precision, scenarios=scenarios)
    for i, sc in enumerate(scenarios):
        row = plan("tiny", device_mem=sc["budget"], host_mem="64GiB", precision=precision,
                   simulated=True, batch_size=PER_RANK * WORLD, seq_len=SEQ_LEN, nproc=WORLD,
                   grad_accum=ACCUM).policies[sc["policy"]]
        assert row.fits, row.reason
        for rank, measured in enumerate(r[i] for r in ranks):
            where = f"{sc} on rank {rank}"
            assert measured["micro_batches"] == ACCUM, where
            assert (row.copied, row.gathered, row.reduce_scattered) == (
                measured["copied"], measured["gathered"], measured["reduce_scattered"]), where
