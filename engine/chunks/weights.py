"""Weights and optimizer state in and out of chunks, by parameter name.

By name rather than by chunk, so a checkpoint survives a different chunk layout (another
chunk size or precision, or another world size) and loads with safetensors, never
unpickling anything. Data parallel, the state leaves a rank either gathered whole
(optimizer_tensors) or as this rank's pieces alone (optimizer_shard, with shard_layout
saying which elements of each parameter every rank holds); on the way in each rank reads
only the elements its own shard needs (fill_optimizer_ranges), whatever world wrote them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

import torch

from engine.chunks.chunk import Chunk, Slot
from engine.distributed.shards import Shard, overlap

KINDS = ("master", "exp_avg", "exp_avg_sq")


def _trained(chunks: list[Chunk]) -> list[Chunk]:
    """The chunks with optimizer state: a frozen chunk (its payload alone) has none."""
    return [c for c in chunks if not c.frozen]

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


def names_and_buffers(model: torch.nn.Module, slot_of: dict[int, tuple[Chunk, Slot]]
                      ) -> tuple[dict[int, list[str]], list[tuple[str, torch.Tensor]]]:
    """(id of each chunked parameter -> its names in the model's state_dict, tied names
    too; every entry that is not in a chunk, a buffer, as a CPU copy)."""
    names: dict[int, list[str]] = {}
    buffers: list[tuple[str, torch.Tensor]] = []
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in slot_of:
            names.setdefault(id(value), []).append(name)
        else:
            buffers.append((name, value.detach().cpu().clone()))
    return names, buffers


def chunk_weights(chunk: Chunk, names: dict[int, list[str]], whole: Whole | None = None
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """One chunk's full-precision weights as CPU tensors of their own, one at a time, under
    every name of each of its parameters (`names`, from names_and_buffers), in the chunk's
    order. A sharded chunk needs `whole`, and every rank calls this alike."""
    # A frozen chunk's weights are its payload (bf16/fp16: it has no master).
    master = _whole_of(whole)(chunk, "payload" if chunk.frozen else "master")
    for s in chunk.slots:
        flat = master[s.offset:s.offset + s.numel]
        for name in names.get(id(s.param), ()):
            yield name, flat.detach().to("cpu", torch.float32, copy=True).view(s.shape)


def optimizer_tensors(chunks: list[Chunk], whole: Whole | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """(`{kind}/{parameter name}`, fp32 CPU tensor of its own) for master, moments and
    step, one at a time. Sharded chunks need `whole`, and every rank calls this alike."""
    get = _whole_of(whole)
    for c in _trained(chunks):
        for s in c.slots:
            sl = slice(s.offset, s.offset + s.numel)
            for kind in KINDS:
                yield f"{kind}/{s.name}", get(c, kind)[sl].cpu().clone()
            yield f"step/{s.name}", torch.tensor([float(s.steps)])


def _held(chunk: Chunk, slot: Slot, shard: Shard | None = None
          ) -> tuple[slice, slice] | None:
    """(where in the chunk's home tensors, which of the parameter's elements) this rank
    holds of `slot`, or the rank of `shard` if given: all of it unsharded, the part in its
    shard otherwise, if any."""
    shard = shard or chunk.shard
    if shard is None:
        return slice(slot.offset, slot.offset + slot.numel), slice(0, slot.numel)
    lo, hi = shard.lo, shard.hi
    part = overlap(slot.offset, slot.numel, lo, hi)
    if part is None:
        return None
    a, b = part
    return slice(a - lo, b - lo), slice(a - slot.offset, b - slot.offset)


def check_optimizer_tensors(chunks: list[Chunk], numels: Mapping[str, int]) -> None:
    """Raise ValueError unless `numels` (name -> element count) has every tensor
    optimizer_tensors() gives for `chunks`, each of the right size."""
    for c in _trained(chunks):
        for s in c.slots:
            for kind in (*KINDS, "step"):
                key = f"{kind}/{s.name}"
                if key not in numels:
                    raise ValueError(f"state has no {key}")
                want = 1 if kind == "step" else s.numel
                if numels[key] != want:
                    raise ValueError(f"{key}: {numels[key]} elements, expected {want}")


def fill_optimizer_tensors(chunks: list[Chunk], tensors: Mapping[str, torch.Tensor]) -> None:
    """Inverse of optimizer_tensors(): copy `tensors` (check_optimizer_tensors first, for
    every chunk, so that nothing changes if one does not match) into `chunks`, reading each
    tensor once, chunk by chunk, so a lazy mapping holds one tensor at a time. A sharded
    chunk takes the part of each tensor in its shard."""
    fill_optimizer_ranges(chunks, _WholeTensors(tensors))


class _WholeTensors:
    """Ranges of whole tensors by name (fill_optimizer_ranges from a mapping)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    @property
    def numels(self) -> Mapping[str, int]:
        return {name: t.numel() for name, t in self.tensors.items()}

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor:
        return self.tensors[name].reshape(-1)[lo:hi]


def optimizer_shard(chunks: list[Chunk]) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's part of optimizer_tensors(), with no collective: for every parameter with
    elements in this rank's shard, (`{kind}/{parameter name}`, those elements as an fp32
    CPU tensor of its own, flat) for master and moments, then its step count (every rank
    holding a piece of it gives the count). Unsharded, the same as optimizer_tensors()."""
    for c in _trained(chunks):
        for s in c.slots:
            held = _held(c, s)
            if held is None:
                continue
            for kind in KINDS:
                yield f"{kind}/{s.name}", getattr(c, kind)[held[0]].cpu().clone()
            yield f"step/{s.name}", torch.tensor([float(s.steps)])


def shard_layout(chunks: list[Chunk]) -> dict[str, list[tuple[int, int, int]]]:
    """Which elements of each tensor optimizer_shard() gives on each rank of this world:
    `{kind}/{parameter name}` -> [(rank, lo, hi)] (the rank's tensor holds elements
    [lo, hi) of the parameter, flattened), in rank order; `step/{name}` -> [(rank, 0, 1)]
    for each rank that gives the count. From the chunk layout alone: no collective."""
    layout: dict[str, list[tuple[int, int, int]]] = {}
    for c in _trained(chunks):
        world = c.shard.world if c.shard is not None else 1
        for rank in range(world):
            shard = Shard(rank, world, c.shard.numel) if c.shard is not None else None
            for s in c.slots:
                held = _held(c, s, shard)
                if held is None:
                    continue
                values = held[1]
                for kind in KINDS:
                    layout.setdefault(f"{kind}/{s.name}", []).append(
                        (rank, values.start, values.stop))
                layout.setdefault(f"step/{s.name}", []).append((rank, 0, 1))
    return layout


class Ranges(Protocol):
    """Optimizer state read by element ranges: `numels` (name -> elements of the whole
    tensor), and `read(name, lo, hi)`, elements [lo, hi) of the tensor flattened, reading
    no more than those (a checkpoint's files, however many ranks wrote them)."""

    numels: Mapping[str, int]

    def read(self, name: str, lo: int, hi: int) -> torch.Tensor: ...


def fill_optimizer_ranges(chunks: list[Chunk], ranges: Ranges) -> None:
    """fill_optimizer_tensors() from `ranges` (check_optimizer_tensors first, with its
    numels): each chunk reads only the elements its shard holds of each parameter."""
    for c in _trained(chunks):
        for s in c.slots:
            held = _held(c, s)
            if held is not None:
                home, values = held
                for kind in KINDS:
                    part = ranges.read(f"{kind}/{s.name}", values.start, values.stop)
                    getattr(c, kind)[home].copy_(part.reshape(-1))
            s.steps = int(ranges.read(f"step/{s.name}", 0, 1).reshape(-1)[0])
