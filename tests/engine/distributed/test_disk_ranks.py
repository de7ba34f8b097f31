"""The disk tier under data parallel: each rank applies its host budget to its own shards.

Real gloo ranks (dp_harness), each with a host budget too small for its shards' state:
their optimizer state and some payloads go to a scratch folder of the rank's own, are
read back for the update and for the gather (the shard, into its place in the chunk, before
the all-gather). In fp32, N ranks so give the losses and weights of one process on the
global batch with torch.optim.AdamW(fused=True), as without the disk
(test_data_parallel.py, the same tolerance), on two ranks and three (uneven padding), under
cpu and auto. And `plan(..., nproc=N, host_budget=B)` forecasts what each rank then holds on
disk and reads and writes there per step, byte for byte, as test_planner.py checks one
process's.

Pieces of disk I/O are made small (TINY_PIECE elements, as test_planner.py does), so that
chunks span several pieces and the I/O buffers fit the tiny models' budgets.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from dp_harness import (
    COLLECTIVE_TIMEOUT,
    TINY_VOCAB,
    build,
    make_batches,
    rank_slice,
    run_ranks,
    whole_model_relative_difference,
)

from engine.devices.disk import ALIGN
from engine.placement import disk_rules, rules
from engine.planning.planner import plan

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TINY_PIECE = 2**12  # elements per piece of disk I/O, in the ranks and in the plans
GATED_PIECE = 2**10  # GatedLM's chunks are of 4096 elements: pieces smaller still
STEPS, PER_RANK, TOL = 5, 2, 1e-5  # as test_data_parallel.py
SEQ_LEN, PLAN_STEPS = 64, 3  # the planner's scenarios (the zoo's tiny, as test_plan_ranks.py)
# Exact scenarios: a host budget that leaves every shard's state and the payloads of the
# last used half of the chunks on disk; a device budget a little above each rank's working
# set ("tight": auto evicts) or with room for the shards ("cuda": the margin keeps some
# resident, and the others' parts go where the placement for the rest puts them).
EXACT = [{"name": "cpu", "policy": "cpu", "margin": 0.0, "budget": "tight"},
         {"name": "auto", "policy": "auto", "margin": 0.0, "budget": "tight"},
         {"name": "margin", "policy": "auto", "margin": 0.5, "budget": "cuda"}]


def _payloads_on_disk(chunks: list, itemsize: int, share: float = 0.5,
                      piece: int = TINY_PIECE) -> int:
    """A host budget at which every chunk's state is on disk and the payloads of the last
    used `share` of the chunks (rules.disk_placement sends the last used first; fewer when
    the I/O buffers outweigh the payloads of the last ones)."""
    costs = [rules.disk_cost(c.home_numel, itemsize, ALIGN, piece) for c in chunks]
    order = sorted(range(len(chunks)), reverse=True)
    on_disk = order[:max(1, int(len(order) * share))]
    placement = rules.DiskPlacement(
        frozenset(order), frozenset(on_disk),
        host_bytes=sum(costs[c].host_payload for c in order if c not in on_disk),
        state_buffer=max(c.state_piece for c in costs),
        payload_buffer=max(costs[c].payload_piece for c in on_disk),
        aliased=itemsize == 4, block=ALIGN)
    return placement.host_total


def exact(rank: int, world: int, *, scratch: str) -> dict:
    """Each EXACT scenario on a tiny OPT, STEPS steps of this rank's part of the global
    batches: the losses, the disk levels of the chunks after the last step, the bytes read
    and written on disk, the rank's scratch folder and, from rank 0, the final weights."""
    from dp_scenarios import _budgets, _engine

    disk_rules.DISK_PIECE = TINY_PIECE
    model = build()
    batches = [rank_slice(b, rank, world)
               for b in make_batches(STEPS, batch_size=PER_RANK * world)]
    budgets = _budgets(model, batches[0])
    out: dict = {}
    for sc in EXACT:
        probe = _engine(model, policy="cpu", device_budget="64MiB")
        host_budget = _payloads_on_disk(probe.chunks, 4)
        probe.close()
        eng = _engine(model, policy=sc["policy"], device_budget=budgets[sc["budget"]],
                      margin_ratio=sc["margin"], host_budget=host_budget, disk_dir=scratch)
        losses, read, written, peaks_ok = [], 0, 0, True
        for batch in batches:
            stats = eng.step(batch)
            losses.append(stats.loss)
            read += stats.bytes_disk_read
            written += stats.bytes_disk_written
            peaks_ok &= stats.memory.device_peak <= stats.device_budget
        memory = eng.snapshot()
        result = {"losses": losses, "levels": [c.disk_level for c in eng.chunks],
                  "resident": [c.resident for c in eng.chunks], "read": read,
                  "written": written, "peaks_within_budget": peaks_ok,
                  "host_total": memory.host_model + memory.host_io_buffers,
                  "host_budget": host_budget,
                  "folder": str(eng.manager.spill.tier.folder.path)}
        weights = eng.model_state_dict()  # a collective: every rank reads its shards back
        result["weights"] = weights if rank == 0 else None
        eng.close()
        out[sc["name"]] = result
    return out


def planned(rank: int, world: int, *, scratch: str, precision: str,
            scenarios: list[dict]) -> list[dict]:
    """Each scenario on the zoo's tiny (the same weights on every rank), PLAN_STEPS steps
    of this rank's part of the global batches; what the last step measured."""
    from engine import Engine, EngineConfig
    from engine.models.zoo import build_model

    disk_rules.DISK_PIECE = TINY_PIECE
    batches = [rank_slice(b, rank, world) for b in make_batches(
        PLAN_STEPS, batch_size=PER_RANK * world, seq_len=SEQ_LEN, vocab=TINY_VOCAB)]
    out = []
    for sc in scenarios:
        torch.manual_seed(0)
        eng = Engine(build_model("tiny"), EngineConfig(
            policy=sc["policy"], device_budget=sc["budget"], margin_ratio=sc["margin"],
            precision=precision, simulate=True, host_budget=sc["host_budget"],
            disk_dir=scratch, collective_timeout=COLLECTIVE_TIMEOUT))
        tier = eng.manager.spill.tier
        for batch in batches:
            before = tier.bytes_read, tier.bytes_written
            stats = eng.step(batch)
            eng.manager.flight.wait()  # an update that overlaps the next step is this one's
        memory = stats.memory
        out.append({"disk_model": memory.disk_model, "host_model": memory.host_model,
                    "io_buffers": memory.host_io_buffers,
                    "tier": (tier.bytes_read - before[0], tier.bytes_written - before[1]),
                    "stats": (stats.bytes_disk_read, stats.bytes_disk_written),
                    "copied": stats.bytes_h2d + stats.bytes_d2h,
                    "gathered": stats.bytes_gathered,
                    "disk_needed": eng.manager.disk_placement(set()).disk_bytes,
                    "levels": [c.disk_level for c in eng.chunks]})
        eng.close()
    return out


def unused(rank: int, world: int, *, scratch: str) -> dict:
    """GatedLM, whose gates some ranks leave unused at some steps (test_data_parallel's
    GATES), under cpu with half the payloads on disk: a parameter one update behind its
    neighbours is updated a piece at a time, in the shard's own coordinates."""
    from dp_harness import GatedLM
    from dp_scenarios import _engine, _run
    from test_data_parallel import GATES

    disk_rules.DISK_PIECE = GATED_PIECE
    model = GatedLM()
    batches = []
    for i, b in enumerate(make_batches(len(GATES), batch_size=PER_RANK * world)):
        part = rank_slice(b, rank, world)
        part["gates"] = GATES[i][rank]
        batches.append(part)
    probe = _engine(model, policy="cpu", device_budget="64MiB", chunk_size=4096)
    host_budget = _payloads_on_disk(probe.chunks, 4, piece=GATED_PIECE)
    probe.close()
    eng = _engine(model, policy="cpu", device_budget="64MiB", chunk_size=4096,
                  host_budget=host_budget, disk_dir=scratch)
    result = _run(eng, batches, [])
    result["levels"] = [c.disk_level for c in eng.chunks]
    result["weights"] = eng.model_state_dict()
    result["steps"] = {s.name: s.steps for c in eng.chunks for s in c.slots}
    eng.close()
    return result


def ranks_main(rank: int, world: int, *, scratch: str, precision: str,
               scenarios: list[dict]) -> dict:
    """What the tests run on `world` ranks, in one launch (each start costs seconds)."""
    return {"exact": exact(rank, world, scratch=scratch),
            "unused": unused(rank, world, scratch=scratch) if world == 2 else None,
            "planned": planned(rank, world, scratch=scratch, precision=precision,
                               scenarios=scenarios)}


# --- the plans, made in this process beforehand ---------------------------------------------

PRECISION = {2: "fp32", 3: "bf16"}


def _plan(world: int, **kw):
    return plan("tiny", host_mem="64GiB", precision=PRECISION[world], simulated=True,
                batch_size=PER_RANK * world, seq_len=SEQ_LEN, nproc=world, **kw)


def _scenarios(world: int) -> list[dict]:
    """Per-rank budgets from the plan: the device a little above the working set (auto
    evicts, the margin keeps some shards resident); the host a share of the rank's
    shards' state with nothing resident: 30% leaves every chunk's state and payloads on
    disk (the embedding's chunk is most of tiny), 60% the state only, and with the margin
    the update of the chunks on the host overlaps the next step's forward."""
    base = _plan(world, device_mem="6GiB")
    tight, state = int(base.working_set * 1.3), base.cpu.host_model
    return [
        {"policy": "cpu", "budget": tight, "margin": 0.0, "host_budget": int(0.3 * state)},
        {"policy": "auto", "budget": tight, "margin": 0.0, "host_budget": int(0.3 * state)},
        {"policy": "auto", "budget": tight, "margin": 0.5, "host_budget": int(0.6 * state)},
    ]


@pytest.fixture(scope="module", params=[2, 3], ids=lambda n: f"{n}ranks")
def launch(request, tmp_path_factory):
    world = request.param
    tmp = tmp_path_factory.mktemp(f"ranks{world}")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(disk_rules, "DISK_PIECE", TINY_PIECE)
        scenarios = _scenarios(world)
        forecasts = [_plan(world, device_mem=sc["budget"], margin_ratio=sc["margin"],
                           host_budget=sc["host_budget"], disk_dir=tmp / "scratch")
                     for sc in scenarios]
    results = run_ranks(world, "test_disk_ranks.ranks_main", tmp, deadline=280.0,
                        scratch=str(tmp / "scratch"), precision=PRECISION[world],
                        scenarios=scenarios)
    return world, tmp, scenarios, forecasts, results


@pytest.mark.parametrize("name", [s["name"] for s in EXACT])
def test_ranks_spilling_their_shards_train_as_one_process_on_the_global_batch(launch, name):
    from test_data_parallel import _reference  # the same run: STEPS and PER_RANK alike

    world, _, _, _, results = launch
    ref_losses, ref_weights = _reference(world)
    for rank, result in enumerate(r["exact"][name] for r in results):
        where = f"{name} on rank {rank} of {world}"
        assert result["losses"] == pytest.approx(ref_losses, rel=TOL), where
        # The shards' state and some of their payloads were on disk, read and written.
        # Under the margin, shards came from disk to be resident on the device from the
        # second step (and those left on the host may then fit it: on three ranks they do).
        on_host = [level for level, resident
                   in zip(result["levels"], result["resident"], strict=True) if not resident]
        if name == "margin":
            assert any(result["resident"]), where
        else:
            assert min(on_host) >= 1 and 2 in on_host, where
        assert result["read"] > 0 and result["written"] > 0, where
        assert result["host_total"] <= result["host_budget"], where
        assert result["peaks_within_budget"], where
    weights = results[0]["exact"][name]["weights"]
    assert whole_model_relative_difference(weights, ref_weights) <= TOL


def test_a_parameter_unused_on_one_rank_gives_ddps_result_with_its_shard_on_disk(launch):
    from test_data_parallel import GATES, _unused_reference

    world, _, _, _, results = launch
    if world != 2:
        pytest.skip("GATES are for two ranks")
    ref_losses, ref_weights = _unused_reference()
    for result in (r["unused"] for r in results):
        assert 2 in result["levels"]
        assert result["losses"] == pytest.approx(ref_losses, rel=TOL)
        assert whole_model_relative_difference(result["weights"], ref_weights) <= TOL
        assert result["steps"]["blocks.2.gate"] == len(GATES) - 1
        for name in ("blocks.0.gate", "blocks.1.gate", "blocks.2.gate"):
            ours, theirs = result["weights"][name], ref_weights[name]
            assert float((ours - theirs).norm() / theirs.norm()) <= TOL


def test_each_rank_has_a_scratch_folder_of_its_own_and_leaves_nothing_behind(launch):
    world, tmp, _, _, results = launch
    folders = [Path(r["exact"]["cpu"]["folder"]) for r in results]
    for rank, folder in enumerate(folders):
        assert folder.parent == tmp / "scratch" / f"rank-{rank}"
        assert not folder.exists()  # removed when the engine closed
    assert len(set(folders)) == world


def test_each_rank_measures_the_disk_tier_the_plan_for_its_ranks_forecasts(launch):
    world, _, scenarios, forecasts, results = launch
    for i, (sc, forecast) in enumerate(zip(scenarios, forecasts, strict=True)):
        row = forecast.policies[sc["policy"]]
        assert row.fits, row.reason
        assert row.host_model + row.io_buffers <= sc["host_budget"]
        assert row.host_peak > forecast.host_budget  # the runtime and the simulated device
        for rank, measured in enumerate(r["planned"][i] for r in results):
            where = f"{sc} on rank {rank} of {world}"
            assert max(measured["levels"]) >= 1, where  # parts on disk, on every rank
            assert row.disk_bytes == measured["disk_model"] > 0, where
            assert row.host_model == measured["host_model"], where
            assert row.io_buffers == measured["io_buffers"], where
            assert (row.disk_read, row.disk_written) == measured["tier"], where
            assert (row.disk_read, row.disk_written) == measured["stats"], where
            assert row.disk_read > 0 and row.disk_written > 0, where
            assert row.copied == measured["copied"], where
            assert row.gathered == measured["gathered"], where
            assert forecast.disk_needed == measured["disk_needed"], where


def test_a_host_budget_with_ranks_is_each_ranks_own(monkeypatch, tmp_path):
    """The plan's disk figures are one rank's: each of N ranks holds its shards' share, in
    a folder of its own on the machine's disk."""
    monkeypatch.setattr(disk_rules, "DISK_PIECE", TINY_PIECE)
    shape = {"device_mem": "6GiB", "host_mem": "64GiB", "precision": "fp32",
             "simulated": True, "batch_size": 4, "seq_len": SEQ_LEN, "host_budget": "2MiB",
             "disk_dir": tmp_path}
    one, two = plan("tiny", **shape), plan("tiny", nproc=2, **shape)
    assert two.uses_disk and one.disk_needed > two.disk_needed > 0
    assert two.cpu.host_model + two.cpu.io_buffers <= 2 * 2**20
    assert two.to_dict()["nproc"] == 2 and two.to_dict()["host_budget"] == 2 * 2**20


def test_with_ranks_cuda_under_a_host_budget_needs_the_disks_room_as_the_others_do(
        monkeypatch, tmp_path):
    """A change of policy reaches every rank at a step boundary, where one whose folder
    lacked room could only fail the step: so each rank opens its disk tier as it starts,
    whatever the policy, and the plan asks the disk's room of cuda's row too."""
    monkeypatch.setattr(disk_rules, "DISK_PIECE", TINY_PIECE)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=2**16))
    shape = {"device_mem": "6GiB", "host_mem": "64GiB", "precision": "fp32",
             "simulated": True, "batch_size": 4, "seq_len": SEQ_LEN, "host_budget": "2MiB",
             "disk_dir": tmp_path}
    alone, ranks = plan("tiny", **shape), plan("tiny", nproc=2, **shape)
    assert alone.cuda.fits, alone.cuda.reason  # one process: its tier opens with cpu or auto
    for row in (ranks.cuda, ranks.cpu, ranks.auto):
        assert not row.fits and "free" in row.reason, row.reason
