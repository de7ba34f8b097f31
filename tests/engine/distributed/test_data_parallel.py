"""Data parallel with sharded chunks: N gloo ranks with b sequences each train as one
process on the global batch of N x b with torch.optim.AdamW(fused=True).

Not bit for bit: the reduce-scatter sums the ranks' gradients in another order than one
backward over the whole batch, so losses are compared within 1e-5 relative and weights as
one vector (see dp_harness.whole_model_relative_difference). Three ranks exercise uneven
padding (chunk sizes that are no multiple of three).
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from dp_harness import (
    GatedLM,
    build,
    make_batches,
    rank_slice,
    reference_run,
    run_ranks,
    whole_model_relative_difference,
)

from engine import Engine, EngineConfig

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 5
PER_RANK = 2
TOL = 1e-5

SCENARIOS = [
    {"name": "cpu", "policy": "cpu", "budget": "tight"},
    {"name": "auto", "policy": "auto", "budget": "tight", "margin": 0.5},
    {"name": "cuda", "policy": "cuda", "budget": "cuda"},
    {"name": "live", "policy": "auto", "budget": "tight", "changes": [
        [], [("policy", "cpu")], [("margin", 0.5)],
        [("budget", "cuda"), ("policy", "cuda")], [("policy", "auto"), ("margin", 1.0)]]},
    # The same changes made on rank 0 alone: every rank applies them at the same step.
    {"name": "steered", "policy": "auto", "budget": "tight", "rank0_only": True, "changes": [
        [], [("policy", "cpu")], [("margin", 0.5)],
        [("budget", "cuda"), ("policy", "cuda")], [("policy", "auto"), ("margin", 1.0)]]},
    # On two ranks only (the shards' arithmetic is the same on three), to keep the time.
    {"name": "clipped", "policy": "cpu", "budget": "tight", "max_grad_norm": 0.5,
     "worlds": (2,)},
    # Each rank's part in two micro-batches: gradients add up in the shards between them.
    {"name": "accumulated", "policy": "auto", "budget": "tight", "margin": 0.5,
     "grad_accum": 2, "worlds": (2,)},
    # LoRA: the base weights frozen in payload-only chunks, sharded like any other.
    {"name": "lora", "policy": "auto", "budget": "ample", "margin": 0.5, "lora": True,
     "worlds": (2,)},
]


def _matches_args(world: int) -> dict:
    scenarios = [s for s in SCENARIOS if world in s.get("worlds", (world,))]
    return {"steps": STEPS, "per_rank": PER_RANK, "scenarios": scenarios}


# One launch per world size: starting a rank costs seconds of imports on this machine.
@pytest.fixture(scope="module")
def two(tmp_path_factory):
    return run_ranks(2, "dp_scenarios.two_ranks", tmp_path_factory.mktemp("two"),
                     matches_args=_matches_args(2),
                     unused_args={"steps": len(GATES), "per_rank": PER_RANK, "gates": GATES,
                                  "policies": ["cpu", "auto"]},
                     interrupted_args={"steps": 3, "per_rank": PER_RANK},
                     dropout_args={"steps": 3, "per_rank": PER_RANK}, deadline=180.0)


@pytest.fixture(scope="module")
def three(tmp_path_factory):
    return run_ranks(3, "dp_scenarios.three_ranks", tmp_path_factory.mktemp("three"),
                     matches_args=_matches_args(3), diverging_args={"per_rank": PER_RANK},
                     deadline=180.0)


@pytest.fixture(params=[2, 3], ids=lambda n: f"{n}ranks")
def ranks(request):
    world = request.param
    launch = request.getfixturevalue("two" if world == 2 else "three")
    return world, [result["matches"] for result in launch]


# Cached: scenarios that differ only in how the ranks train compare with one run (in the
# test process, seconds of CPU each); test_disk_ranks.py compares with the same.
@functools.cache
def _reference(world: int, *, lora: bool = False, **kw):
    """One process's losses and final weights on the global batches of `world` ranks."""
    from dp_scenarios import with_lora

    model = with_lora(build()) if lora else build()
    return reference_run(model, make_batches(STEPS, batch_size=PER_RANK * world), **kw)


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS])
def test_ranks_train_as_one_process_on_the_global_batch(ranks, name):
    world, results = ranks
    scenario = next(s for s in SCENARIOS if s["name"] == name)
    if world not in scenario.get("worlds", (world,)):
        pytest.skip(f"run on {scenario['worlds']} ranks only")
    clip = scenario.get("max_grad_norm")
    ref_losses, ref_weights = _reference(world, max_grad_norm=clip,
                                         lora=scenario.get("lora", False))
    for rank, result in enumerate(results):
        got = result[name]
        assert got["losses"] == pytest.approx(ref_losses, rel=TOL), f"rank {rank}"
        assert got["tokens"] == PER_RANK * world * 16  # the global batch's
        assert got["applied"] == results[0][name]["applied"]  # the same step everywhere
    assert whole_model_relative_difference(results[0][name]["weights"], ref_weights) <= TOL
    if scenario.get("lora"):
        frozen = results[0][name]["frozen_payload_only"]
        assert frozen and all(frozen)


@pytest.mark.parametrize("name", [s["name"] for s in SCENARIOS])
def test_ranks_stay_within_their_budget(ranks, name):
    world, results = ranks
    scenario = next(s for s in SCENARIOS if s["name"] == name)
    if world not in scenario.get("worlds", (world,)):
        pytest.skip(f"run on {scenario['worlds']} ranks only")
    for rank, result in enumerate(results):
        assert result[name]["peaks_within_budget"], f"rank {rank} went over its budget"


def test_ranks_with_dropout_draw_one_process_masks(two):
    """Seeded alike, two ranks train a model with dropout on as one process seeded so on
    the global batch: each rank's masks are its rows of that process's."""
    from dp_scenarios import DROPOUT_SEED

    model, batches = build(dropout=0.1), make_batches(3, batch_size=PER_RANK * 2)
    torch.manual_seed(DROPOUT_SEED)  # after build(), which seeds its initialisation
    ref_losses, _ = reference_run(model, batches)
    torch.manual_seed(DROPOUT_SEED + 1)
    other, _ = reference_run(model, batches)
    assert other != pytest.approx(ref_losses, rel=TOL)  # the masks do matter
    for rank, result in enumerate(two):
        assert result["dropout"] == pytest.approx(ref_losses, rel=TOL), f"rank {rank}"


@pytest.mark.parametrize("name", ["live", "steered"])
def test_live_changes_take_effect_at_the_step_they_were_made_for(ranks, name):
    _, results = ranks
    for result in results:  # "steered": made on rank 0 only, applied by every rank
        applied = result[name]["applied"]
        assert "policy cpu" in applied[1] and "margin_ratio 0.5" in applied[2]
        assert "policy cuda" in applied[3] and "policy auto" in applied[4]


def test_each_rank_holds_its_shard_of_the_chunk_state(ranks):
    world, results = ranks
    single = Engine(build(), EngineConfig(policy="cpu", device_budget="64MiB",
                                          data_parallel=False))
    # fp32: 16 bytes per element on the host, of which the gradients' landing place (4) is
    # there from their landing to the update in one process (rules.grads_land_per_step);
    # a shard keeps it.
    whole = single.snapshot().host_model + 4 * sum(c.numel for c in single.chunks)
    unsharded_resident = sum(single.manager.resident_cost(c) for c in single.chunks)
    single.close()
    for rank, result in enumerate(results):
        cpu = result["cpu"]
        # Every chunk padded to a multiple of the world size, split evenly.
        assert all(n % world == 0 for n in cpu["chunk_numels"])
        assert cpu["shard_numels"] == [n // world for n in cpu["chunk_numels"]]
        # The cpu policy keeps no chunk on the device between steps: the host holds the
        # shard's master, moments and gradient, 1/N of one process's (plus padding).
        assert cpu["host_model"] == 16 * sum(cpu["shard_numels"])
        assert whole / world <= cpu["host_model"] <= 1.02 * whole / world
        assert cpu["device_model"] == 0
        # Under cuda every shard is resident: 1/N of the state on the device, none on the
        # host, in a budget too small for one process's whole model under cuda.
        cuda = result["cuda"]
        assert cuda["host_model"] == 0
        assert cuda["device_model"] == result["budgets"]["resident_shards"]
        assert result["budgets"]["cuda"] < unsharded_resident
        assert cuda["device_model"] <= 1.02 * unsharded_resident / world, f"rank {rank}"


# --- a parameter unused on some rank ---------------------------------------------------------

GATES = [  # per step, per rank: which of the three blocks use their gate
    [(True, True, True), (True, True, True)],
    [(True, True, True), (True, False, True)],  # rank 1 leaves block 1's gate unused
    [(True, True, False), (True, True, False)],  # no rank uses block 2's gate
    [(False, True, True), (True, True, True)],  # rank 0 leaves block 0's gate unused
]


def _ddp_loss(world: int, step_of: dict):
    """The loss whose gradient DDP (find_unused_parameters=True) averages: each rank's
    loss on its slice with its own branches, averaged over the ranks."""
    def loss_of(model, batch):
        i = step_of[id(batch)]
        parts = [model(**rank_slice(batch, r, world), gates=GATES[i][r]).loss
                 for r in range(world)]
        return sum(parts) / world
    return loss_of


@functools.cache
def _unused_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """DDP's losses and final weights over GATES on two ranks (both policies compare with
    it, and test_disk_ranks.py with the shards on disk)."""
    world = 2
    batches = make_batches(len(GATES), batch_size=PER_RANK * world)
    return reference_run(
        GatedLM(), batches, loss_of=_ddp_loss(world, {id(b): i for i, b in enumerate(batches)}))


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_a_parameter_unused_on_one_rank_gives_ddps_result(policy, two):
    results = [result["unused"][policy] for result in two]
    ref_losses, ref_weights = _unused_reference()
    for result in results:
        assert result["losses"] == pytest.approx(ref_losses, rel=TOL)
        assert whole_model_relative_difference(result["weights"], ref_weights) <= TOL
        # A gate no rank used at a step missed that update, as torch.optim.AdamW skips a
        # parameter whose .grad is None; one some rank used was updated everywhere.
        steps = result["steps"]
        assert steps["blocks.2.gate"] == len(GATES) - 1
        assert steps["blocks.0.gate"] == steps["blocks.1.gate"] == len(GATES)
    # Where the gradient is exactly zero on one rank, the weights still agree per tensor.
    for name in ("blocks.0.gate", "blocks.1.gate", "blocks.2.gate"):
        ours, theirs = results[0]["weights"][name], ref_weights[name]
        assert float((ours - theirs).norm() / theirs.norm()) <= TOL


def test_ranks_that_run_different_modules_fail_with_a_message_not_a_hang(three):
    for rank, result in enumerate(r["diverging"] for r in three):
        assert result["raised"] == "CollectiveError", (rank, result)
        assert f"rank {rank} of 3" in result["message"]


def test_a_rank_that_dies_is_an_error_on_the_others_within_the_timeout(tmp_path):
    from dp_harness import COLLECTIVE_TIMEOUT

    survivor, dead = run_ranks(2, "dp_scenarios.dying", tmp_path, per_rank=PER_RANK,
                               may_die=(1,), deadline=60.0)
    assert dead is None
    assert survivor["raised"] == "CollectiveError", survivor
    assert survivor["message"].startswith("rank 0 of 2: ")
    assert survivor["seconds"] < COLLECTIVE_TIMEOUT


@pytest.fixture(scope="module")
def interrupted_runs(two):
    return [result["interrupted"] for result in two]


def test_an_interrupt_on_one_rank_stops_the_step_on_every_rank(interrupted_runs):
    world, steps = 2, 3
    ref_losses, ref_weights = reference_run(
        GatedLM(), make_batches(steps, batch_size=PER_RANK * world))
    for result in interrupted_runs:
        assert len(result["raised"]) == 1 and "step 2 was interrupted" in result["raised"][0]
        assert result["losses"] == pytest.approx(ref_losses, rel=TOL)
        assert whole_model_relative_difference(result["weights"], ref_weights) <= TOL
    assert interrupted_runs[0]["raised"] == interrupted_runs[1]["raised"]  # same boundary


def test_a_host_budget_too_small_for_a_ranks_shards_is_refused_with_the_numbers(
        interrupted_runs):
    for result in interrupted_runs:
        assert result["refused"].startswith("host budget 4.0 KiB is below the ")


def test_without_torch_distributed_the_engine_trains_alone():
    model = build()
    eng = Engine(copy.deepcopy(model), EngineConfig(policy="cpu", device_budget="64MiB"))
    assert eng.collectives is None and not any(c.sharded for c in eng.chunks)
    eng.close()
    with pytest.raises(ValueError, match="data_parallel=True needs torch.distributed"):
        Engine(copy.deepcopy(model), EngineConfig(policy="cpu", device_budget="64MiB",
                                                  data_parallel=True))
    assert not torch.distributed.is_initialized()
