"""What each rank runs in the data-parallel tests (dp_harness.run_ranks targets).

Every function here runs on every rank, with the same arguments; ranks differ only in the
slice of each global batch they train on (and, where a test says so, in which branches
their batches take).
"""

from __future__ import annotations

import copy
import os
import time

import torch
from dp_harness import COLLECTIVE_TIMEOUT, GatedLM, build, make_batches, rank_slice

from engine import Engine, EngineConfig


def with_lora(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with LoRA adapters on every linear layer (the same on every rank: the seed
    fixes them), its base weights frozen."""
    from engine.models.lora import Lora, apply_lora

    return apply_lora(copy.deepcopy(model), Lora(rank=4, alpha=8), seed=0)


def _engine(model: torch.nn.Module, **config) -> Engine:
    return Engine(copy.deepcopy(model), EngineConfig(
        precision="fp32", collective_timeout=COLLECTIVE_TIMEOUT, **config))


def _budgets(model: torch.nn.Module, batch: dict) -> dict[str, int]:
    """Per-rank budgets from one step with room to spare: `tight` is 5% over the working
    set; `cuda` 5% over what the cuda policy needs: this rank's shards resident, and the
    working set (the chunks it gathers, their gradients, activations) beside them."""
    eng = _engine(model, policy="auto", device_budget="256MiB")
    eng.step(batch)
    trace = eng.trace
    resident = sum(eng.manager.resident_cost(c) for c in eng.chunks)
    budgets = {"ample": 64 * 2**20, "tight": int(trace.working_set * 1.05),
               "cuda": int((resident + trace.working_set) * 1.05),
               "resident_shards": resident}
    eng.close()
    return budgets


def _run(eng: Engine, batches: list[dict], changes: list[list[tuple[str, object]]]
         ) -> dict:
    losses, applied, peaks_ok = [], [], True
    for i, batch in enumerate(batches):
        for kind, value in changes[i] if i < len(changes) else ():
            getattr(eng, f"set_{kind}")(value)
        stats = eng.step(batch)
        losses.append(stats.loss)
        applied.append(stats.applied)
        peaks_ok &= stats.memory.device_peak <= stats.device_budget
    snap = eng.snapshot()
    return {"losses": losses, "applied": applied, "peaks_within_budget": peaks_ok,
            "host_model": snap.host_model, "device_model": snap.device_model,
            "tokens": stats.tokens}


def matches(rank: int, world: int, *, steps: int, per_rank: int,
            scenarios: list[dict]) -> dict:
    """Each scenario (policy, budget name, margin, live changes by step, clipping) on a
    tiny OPT; returns per scenario the losses, memory figures and, from rank 0, the final
    weights (model_state_dict, which every rank calls)."""
    model = build()
    batches = [rank_slice(b, rank, world)
               for b in make_batches(steps, batch_size=per_rank * world)]
    budgets = _budgets(model, batches[0])
    out: dict = {"budgets": budgets}
    for sc in scenarios:
        changes = [[(k, budgets[v] if k == "budget" else v) for k, v in step]
                   for step in sc.get("changes", [])]
        if sc.get("rank0_only") and rank != 0:
            changes = []  # rank 0 alone is steered; the engine tells the others
        eng = _engine(with_lora(model) if sc.get("lora") else model,
                      policy=sc["policy"], device_budget=budgets[sc["budget"]],
                      margin_ratio=sc.get("margin", 0.0),
                      max_grad_norm=sc.get("max_grad_norm"), grad_accum=sc.get("grad_accum", 1))
        result = _run(eng, batches, changes)
        weights = eng.model_state_dict()
        result["weights"] = weights if rank == 0 else None
        result["chunk_numels"] = [c.numel for c in eng.chunks]
        result["shard_numels"] = [c.home_numel for c in eng.chunks]
        # Frozen chunks (LoRA's base) hold their payload's shard and no optimizer state.
        result["frozen_payload_only"] = [
            c.exp_avg is None and c.host_grad is None for c in eng.chunks if c.frozen]
        eng.close()
        out[sc["name"]] = result
    return out


def unused(rank: int, world: int, *, steps: int, per_rank: int,
           gates: list[list[tuple[bool, ...]]], policies: list[str]) -> dict:
    """GatedLM where rank r's batches at step i use the gates gates[i][r], under each of
    `policies`; per policy, what _run gives, the weights and each parameter's step count."""
    model = GatedLM()
    batches = []
    for i, b in enumerate(make_batches(steps, batch_size=per_rank * world)):
        part = rank_slice(b, rank, world)
        part["gates"] = gates[i][rank]
        batches.append(part)
    out = {}
    for policy in policies:
        eng = _engine(model, policy=policy, device_budget="64MiB", chunk_size=4096)
        result = _run(eng, batches, [])
        result["weights"] = eng.model_state_dict()
        result["steps"] = {s.name: s.steps for c in eng.chunks for s in c.slots}
        eng.close()
        out[policy] = result
    return out


def diverging(rank: int, world: int, *, per_rank: int) -> dict:
    """Rank 1 skips a whole block on the second step (a module the others run): the
    ranks issue different collectives, which must be an error naming a rank, not a hang."""
    model = GatedLM(blocks=3)
    batches = [rank_slice(b, rank, world)
               for b in make_batches(2, batch_size=per_rank * world)]
    eng = Engine(copy.deepcopy(model), EngineConfig(
        precision="fp32", policy="cpu", device_budget="64MiB", chunk_size=4096,
        collective_timeout=2.0))
    eng.step(batches[0])
    if rank == 1:
        batches[1]["skip"] = 1
    try:
        eng.step(batches[1])
    except Exception as error:  # noqa: BLE001 - the test reads what was raised
        return {"raised": type(error).__name__, "message": str(error)}
    return {"raised": None, "message": ""}


def dying(rank: int, world: int, *, per_rank: int) -> dict:
    """Rank 1 dies (an abrupt exit, as kill -9 would end it) before the second step; the
    others' second step must fail, naming their rank, well within the timeout."""
    model = GatedLM()
    batches = [rank_slice(b, rank, world)
               for b in make_batches(2, batch_size=per_rank * world)]
    eng = _engine(model, policy="auto", device_budget="64MiB", chunk_size=4096)
    eng.step(batches[0])
    if rank == 1:
        os._exit(1)
    start = time.perf_counter()
    try:
        eng.step(batches[1])
    except Exception as error:  # noqa: BLE001 - the test reads what was raised
        return {"raised": type(error).__name__, "message": str(error),
                "seconds": time.perf_counter() - start}
    return {"raised": None, "message": "", "seconds": time.perf_counter() - start}


def interrupted(rank: int, world: int, *, steps: int, per_rank: int) -> dict:
    """Rank 0 alone interrupts the second step: every rank's step stops (StepInterrupted)
    at the same boundary; each runs it again, and the run goes on as if it never stopped."""
    from engine.step.engine import StepInterrupted

    model = GatedLM()
    batches = [rank_slice(b, rank, world)
               for b in make_batches(steps, batch_size=per_rank * world)]
    eng = _engine(model, policy="auto", device_budget="64MiB", chunk_size=4096)
    losses, raised = [], []
    i = 0
    while i < steps:
        if i == 1 and rank == 0 and not raised:
            eng.interrupt()
        try:
            losses.append(eng.step(batches[i]).loss)
            i += 1
        except StepInterrupted as error:
            raised.append(str(error))
    weights = eng.model_state_dict()
    eng.close()
    try:  # a host budget below what the rank's shards need: refused before anything moves
        _engine(model, policy="cpu", device_budget="64MiB", host_budget="4KiB")
        refused = ""
    except ValueError as error:
        refused = str(error)
    return {"losses": losses, "raised": raised, "weights": weights, "refused": refused}


DROPOUT_SEED = 11


def dropout(rank: int, world: int, *, steps: int, per_rank: int) -> list[float]:
    """A model with dropout on, every rank seeded alike before its engine is built, as a
    run seeds: the losses of the global batch (each rank draws its rows of its masks)."""
    model = build(dropout=0.1)
    torch.manual_seed(DROPOUT_SEED)
    eng = _engine(model, policy="auto", device_budget="64MiB")
    batches = make_batches(steps, batch_size=per_rank * world)
    losses = [eng.step(rank_slice(batch, rank, world)).loss for batch in batches]
    eng.close()
    return losses


# --- one launch per world size (each start of a rank costs seconds of imports) ------------


def two_ranks(rank: int, world: int, *, matches_args: dict, unused_args: dict,
              interrupted_args: dict, dropout_args: dict) -> dict:
    """What the tests run on two ranks, in one launch: matches, unused, interrupted,
    dropout."""
    return {"matches": matches(rank, world, **matches_args),
            "unused": unused(rank, world, **unused_args),
            "interrupted": interrupted(rank, world, **interrupted_args),
            "dropout": dropout(rank, world, **dropout_args)}


def three_ranks(rank: int, world: int, *, matches_args: dict, diverging_args: dict) -> dict:
    """What the tests run on three ranks, in one launch: matches, then diverging (last:
    it leaves the process group broken)."""
    return {"matches": matches(rank, world, **matches_args),
            "diverging": diverging(rank, world, **diverging_args)}
