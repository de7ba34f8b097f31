"""The engine's weights and optimizer state, out of the chunks and back in, chunk by chunk.

What Engine.iter_model_state, iter_optimizer_state, iter_optimizer_shard and
load_state_dict carry out: each chunk is opened in turn (its parts on disk read back, a
sharded chunk's tensors gathered whole where asked), so that a checkpoint is written or
read with one chunk's state in memory beyond the result. The update still running from
the last step (engine.chunks.flight) is waited for first.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from engine.chunks import weights
from engine.chunks.chunk import Chunk
from engine.chunks.manager import ChunkManager
from engine.step.optimizer import ChunkAdamW

__all__ = ["iter_model_state", "iter_optimizer_shard", "iter_optimizer_state",
           "load_optimizer_state"]


def _whole(manager: ChunkManager) -> weights.Whole | None:
    """How a sharded chunk's tensor is gathered whole (None unsharded)."""
    return manager.whole if manager.sharding is not None else None


def iter_model_state(model: torch.nn.Module, chunks: list[Chunk], manager: ChunkManager,
                     slot_of: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Buffers first, then every chunk's fp32 weights under the model's names (tied names
    too), each a CPU copy of its own made when asked for."""
    manager.flight.wait()
    names, buffers = weights.names_and_buffers(model, slot_of)
    yield from buffers
    for chunk in chunks:
        with manager.opened(chunk, master_only=True):
            yield from weights.chunk_weights(chunk, names, _whole(manager))


def iter_optimizer_state(chunks: list[Chunk], manager: ChunkManager
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """Master, moments and step counts by name, whole (sharded: gathered), chunk by chunk."""
    manager.flight.wait()
    for chunk in chunks:
        with manager.opened(chunk):
            yield from weights.optimizer_tensors([chunk], _whole(manager))


def iter_optimizer_shard(chunks: list[Chunk], manager: ChunkManager
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's elements of the optimizer state, with no collective, chunk by chunk."""
    manager.flight.wait()
    for chunk in chunks:
        with manager.opened(chunk):
            yield from weights.optimizer_shard([chunk])


def load_optimizer_state(chunks: list[Chunk], manager: ChunkManager, optimizer: ChunkAdamW,
                         state: dict) -> None:
    """Fill every chunk's master and moments from `state` (Engine.load_state_dict's),
    checked against the chunks before anything changes; payloads follow their master."""
    ranges = state.get("ranges")
    tensors = state.get("tensors")
    numels = (ranges.numels if ranges is not None else state.get("numels")
              or {k: v.numel() for k, v in tensors.items()})
    weights.check_optimizer_tensors(chunks, numels)
    manager.flight.wait()
    for c in chunks:
        if c.frozen:  # no optimizer state: its weights are the model's, loaded apart
            continue
        optimizer.discard(c)
        with manager.opened(c, write=True):
            if ranges is not None:
                weights.fill_optimizer_ranges([c], ranges)
            else:
                weights.fill_optimizer_tensors([c], tensors)
            if not c.aliased:
                c.payload.copy_(c.master)
        if not c.resident:
            c.mark_stale()
    manager.release_all()
