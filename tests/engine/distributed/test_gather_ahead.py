"""Data-parallel ranks gather the next module's chunks ahead of use.

At a module boundary the ranks agree, besides what to gather now, on which of the next
module's chunks to gather while this module computes: those every rank has room for (by
the agreed trace's forecast, never evicting) and some rank lacks. Real gloo ranks
(dp_harness) train the zoo's `tiny` on the simulated device; the same steps with no gather
ahead are the reference: the same losses bit for bit, the same bytes gathered and copied.
"""

from __future__ import annotations

import pytest
import torch
from dp_harness import COLLECTIVE_TIMEOUT, TINY_VOCAB, make_batches, rank_slice, run_ranks

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

PER_RANK, SEQ_LEN, STEPS = 2, 64, 3
POLICIES = [("cpu", 32 * 2**20), ("auto", 64 * 2**20), ("cuda", 256 * 2**20)]


def steps(rank: int, world: int, *, ahead: str) -> dict:
    """Each policy on this rank, STEPS steps; per step the loss, bytes gathered and
    copied, and the gathers ahead started. `ahead`: "all" ranks offer what they have room
    for, "none" offers nothing, "rank0" only rank 0 does (rank 1 finds no room)."""
    from engine.chunks.manager import ChunkManager
    from engine.chunks.sharding import ShardedChunks

    started: list[tuple[int, int]] = []  # (boundary, chunk)
    used_in_flight: list[int] = []  # chunks used while their gather ahead was not done
    at = [-1]
    offer, start, materialise = (ChunkManager._gather_offer, ShardedChunks.start_gather,
                                 ChunkManager.materialise)

    def offering(self, needed, pos, phase):
        at[0] = pos
        silent = ahead == "none" or (ahead == "rank0" and rank != 0)
        return [] if silent else offer(self, needed, pos, phase)

    def starting(self, chunk):
        started.append((at[0], chunk.index))
        start(self, chunk)

    def materialising(self, chunk, pos, protect=(), gather=False):
        materialise(self, chunk, pos, protect, gather)
        if self.sharding is not None and chunk.index in self.sharding._ahead:
            used_in_flight.append(chunk.index)

    ChunkManager._gather_offer = offering
    ShardedChunks.start_gather = starting
    ChunkManager.materialise = materialising
    try:
        return _each_policy(rank, world, started, used_in_flight)
    finally:  # the next `ahead` in this process wraps the engine's own methods, not these
        ChunkManager._gather_offer = offer
        ShardedChunks.start_gather = start
        ChunkManager.materialise = materialise


def _each_policy(rank: int, world: int, started: list, used_in_flight: list) -> dict:
    from engine import Engine, EngineConfig
    from engine.models.zoo import build_model

    batches = [rank_slice(b, rank, world) for b in make_batches(
        STEPS, batch_size=PER_RANK * world, seq_len=SEQ_LEN, vocab=TINY_VOCAB)]
    out = {}
    for policy, budget in POLICIES:
        torch.manual_seed(0)
        eng = Engine(build_model("tiny"), EngineConfig(
            policy=policy, device_budget=budget, precision="fp32", simulate=True,
            collective_timeout=COLLECTIVE_TIMEOUT))
        runs = []
        for batch in batches:
            started.clear()
            stats = eng.step(batch)
            runs.append({"loss": stats.loss, "gathered": stats.bytes_gathered,
                         "copied": stats.bytes_h2d + stats.bytes_d2h,
                         "peak": stats.memory.device_peak, "budget": stats.device_budget,
                         "started": list(started)})
        out[policy] = {"steps": runs, "used_in_flight": list(used_in_flight),
                       "next_points": [p.chunks for p in eng.trace.points[1:]]}
        eng.close()
    return out


def every_ahead(rank: int, world: int, *, aheads: list[str]) -> dict:
    """`steps` for each of `aheads` in turn, in one process per rank."""
    return {ahead: steps(rank, world, ahead=ahead) for ahead in aheads}


AHEADS = ["all", "none", "rank0"]


# One launch for the three: starting ranks costs seconds of imports each time.
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    ranks = run_ranks(2, "test_gather_ahead.every_ahead", tmp_path_factory.mktemp("ahead"),
                      deadline=230.0, aheads=AHEADS)
    return {ahead: [rank[ahead] for rank in ranks] for ahead in AHEADS}


@pytest.mark.parametrize("policy", [p for p, _ in POLICIES])
def test_the_next_modules_chunks_are_gathered_while_one_computes(runs, policy):
    for rank, (got, plain) in enumerate(zip(runs["all"], runs["none"], strict=True)):
        steps, reference = got[policy]["steps"], plain[policy]["steps"]
        assert not steps[0]["started"], "the warm-up step has no forecast to trust"
        for step in steps[1:]:
            assert step["started"], f"rank {rank}: nothing gathered ahead"
            for boundary, chunk in step["started"]:
                # A chunk of the trace's next module, never one this module runs on.
                assert chunk in got[policy]["next_points"][boundary]
        assert not got[policy]["used_in_flight"]
        for step, ref in zip(steps, reference, strict=True):
            # The same arithmetic, and no byte the step would not move anyway.
            assert step["loss"] == ref["loss"]
            assert step["gathered"] == ref["gathered"]
            assert step["copied"] == ref["copied"]
            assert step["peak"] <= step["budget"]
    # Collectives pair by issue order: every rank starts the same gathers, in one order.
    rank0, rank1 = (r[policy]["steps"] for r in runs["all"])
    assert [s["started"] for s in rank0] == [s["started"] for s in rank1]


@pytest.mark.parametrize("policy", [p for p, _ in POLICIES])
def test_a_chunk_one_rank_has_no_room_for_is_gathered_ahead_by_none(runs, policy):
    rank0, rank1 = runs["rank0"]
    assert not any(s["started"] for s in rank0[policy]["steps"] + rank1[policy]["steps"])
    plain = runs["none"][0][policy]["steps"]
    assert [s["loss"] for s in rank0[policy]["steps"]] == [s["loss"] for s in plain]
