"""Placement decisions: is a budget big enough, and which chunks are resident.

A resident chunk keeps its payload, gradients and optimizer state on the device, so it is
never moved and its AdamW update runs there. The cuda policy makes every chunk resident;
the other policies make resident what the margin pays for.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.chunks.chunk import Chunk
from engine.chunks.manager import ChunkManager
from engine.config import format_size
from engine.placement.policy import Policy
from engine.placement.trace import Trace


class BudgetTooSmall(ValueError):
    """The device budget cannot hold the minimum working set; says what it needs."""


def minimum_working_set(trace: Trace | None, module_chunks: Iterable[tuple[Chunk, ...]]) -> int:
    """Least device bytes a step needs under any placement.

    With a trace: its measured peak of chunks in use, gradient buffers and activations.
    Before the first step: the chunks of the largest module, with gradient buffers.
    """
    if trace is not None:
        return trace.working_set
    return max((2 * sum(c.nbytes for c in cs) for cs in module_chunks), default=0)


def cuda_policy_bytes(chunks: list[Chunk], manager: ChunkManager, trace: Trace | None) -> int:
    """Device bytes the cuda policy needs: every chunk resident, plus the activations."""
    return sum(manager.resident_cost(c) for c in chunks) + (trace.non_model_peak if trace else 0)


def check_budget(budget: int, policy: Policy, *, chunks: list[Chunk], manager: ChunkManager,
                 trace: Trace | None, module_chunks: Iterable[tuple[Chunk, ...]]) -> None:
    """Raise BudgetTooSmall, with the numbers, when `budget` cannot run `policy`."""
    need = minimum_working_set(trace, module_chunks)
    if budget < need:
        raise BudgetTooSmall(
            f"device budget {format_size(budget)} is below the minimum working set "
            f"{format_size(need)} (largest chunks in use at once"
            f"{', plus activations' if trace else ''})")
    if policy == Policy.CUDA:
        need = cuda_policy_bytes(chunks, manager, trace)
        if budget < need:
            model = sum(manager.resident_cost(c) for c in chunks)
            raise BudgetTooSmall(
                f"policy cuda needs {format_size(need)} on the device (model data "
                f"{format_size(model)} + activations {format_size(need - model)}) but the "
                f"budget is {format_size(budget)}; use policy auto or cpu")


def resident_set(chunks: list[Chunk], manager: ChunkManager, *, trace: Trace | None,
                 capacity: int, margin_ratio: float) -> set[Chunk]:
    """The chunks to keep resident.

    cuda: all of them. Otherwise `margin_ratio` of the margin (capacity minus the traced
    peak of a step that keeps nothing resident), filled in use order. Unlike a one-time
    choice at the first step, the engine calls this whenever the policy, margin or budget
    changes, and after each new trace.
    """
    if manager.policy == Policy.CUDA:
        return set(chunks)
    want: set[Chunk] = set()
    if trace is None or margin_ratio <= 0:
        return want
    room = margin_ratio * max(0, capacity - trace.working_set)
    for chunk in chunks:
        cost = manager.resident_cost(chunk)
        if cost <= room:
            want.add(chunk)
            room -= cost
    return want


def apply_residency(chunks: list[Chunk], manager: ChunkManager, want: set[Chunk]) -> None:
    """Move chunks to match `want`: leavers first, so their bytes make room for joiners."""
    for chunk in chunks:
        if chunk.resident and chunk not in want:
            manager.set_resident(chunk, False)
    manager.release_all()
    for chunk in chunks:
        if chunk in want:
            manager.set_resident(chunk, True)
