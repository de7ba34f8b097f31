"""Weights and optimizer state in and out of chunks, by parameter name.

By name rather than by chunk, so a checkpoint survives a different chunk layout (another
chunk size or precision, or another world size: a sharded chunk's state is gathered whole
on the way out and each rank takes its own shard on the way in) and loads with
safetensors, never unpickling anything.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.chunks.chunk import Chunk, Slot
from engine.distributed.shards import overlap

KINDS = ("master", "exp_avg", "exp_avg_sq")

# (chunk, one of its home tensors) -> that tensor for the whole chunk: the tensor itself
# unsharded, else every rank's shard gathered (a collective; ChunkManager.whole).
Whole = Callable[[Chunk, torch.Tensor], torch.Tensor]


def _as_is(chunk: Chunk, tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _whole_of(whole: Whole | None) -> Callable[[Chunk, str], torch.Tensor]:
    """`kind` of a chunk for the whole chunk, each chunk's gathered once."""
    whole = whole or _as_is
    seen: dict[tuple[int, str], torch.Tensor] = {}

    def get(chunk: Chunk, kind: str) -> torch.Tensor:
        key = (id(chunk), kind)
        if key not in seen:
            tensor = getattr(chunk, kind)
            seen[key] = whole(chunk, tensor) if chunk.sharded else tensor
        return seen[key]

    return get


def model_state_dict(model: torch.nn.Module, slot_of: dict[int, tuple[Chunk, Slot]],
                     whole: Whole | None = None) -> dict[str, torch.Tensor]:
    """Full-precision weights on the CPU under the model's own names (tied names too).
    Sharded chunks need `whole`, and every rank calls this alike."""
    get = _whole_of(whole)
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        hit = slot_of.get(id(value))
        if hit is None:  # a buffer
            out[name] = value.detach().cpu().clone()
        else:
            chunk, slot = hit
            flat = get(chunk, "master")[slot.offset:slot.offset + slot.numel]
            out[name] = flat.detach().cpu().clone().view(slot.shape)
    return out


def optimizer_tensors(chunks: list[Chunk], whole: Whole | None = None
                      ) -> dict[str, torch.Tensor]:
    """`{kind}/{parameter name}` -> fp32 CPU tensor, for master, moments and step. Sharded
    chunks need `whole`, and every rank calls this alike."""
    get = _whole_of(whole)
    tensors: dict[str, torch.Tensor] = {}
    for c in chunks:
        for s in c.slots:
            sl = slice(s.offset, s.offset + s.numel)
            for kind in KINDS:
                tensors[f"{kind}/{s.name}"] = get(c, kind)[sl].cpu().clone()
            tensors[f"step/{s.name}"] = torch.tensor([float(s.steps)])
    return tensors


def _held(chunk: Chunk, slot: Slot) -> tuple[slice, slice] | None:
    """(where in the chunk's home tensors, which of the parameter's elements) this rank
    holds of `slot`: all of it unsharded, the part in its shard otherwise, if any."""
    if chunk.shard is None:
        return slice(slot.offset, slot.offset + slot.numel), slice(0, slot.numel)
    lo, hi = chunk.shard.lo, chunk.shard.hi
    part = overlap(slot.offset, slot.numel, lo, hi)
    if part is None:
        return None
    a, b = part
    return slice(a - lo, b - lo), slice(a - slot.offset, b - slot.offset)


def load_optimizer_tensors(chunks: list[Chunk], tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of optimizer_tensors(); checks every name and size before changing anything.
    A sharded chunk takes the part of each tensor in its shard."""
    for c in chunks:
        for s in c.slots:
            for kind in (*KINDS, "step"):
                key = f"{kind}/{s.name}"
                if key not in tensors:
                    raise ValueError(f"state has no {key}")
                want = 1 if kind == "step" else s.numel
                if tensors[key].numel() != want:
                    raise ValueError(f"{key}: {tensors[key].numel()} elements, expected {want}")
    for c in chunks:
        for s in c.slots:
            held = _held(c, s)
            if held is not None:
                home, values = held
                for kind in KINDS:
                    getattr(c, kind)[home].copy_(tensors[f"{kind}/{s.name}"].reshape(-1)[values])
            s.steps = int(tensors[f"step/{s.name}"].reshape(-1)[0])
