"""The engine's chunk layout and the bytes of a chunk, for the planner's replay.

`model_layout` lays a model's parameters out in chunks as engine.chunks.chunk does;
`sharded_layout` pads them as `world` data-parallel ranks hold them. `ChunkBytes` says how
many bytes a chunk's parts take and where they live, `resident_chunks` which chunks stay on
the device: the same rules engine.chunks carries out on tensors, in numbers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.chunks.chunk import chunk_numel, layout
from engine.distributed.shards import padded_numel
from engine.placement import rules
from engine.placement.policy import Policy
from engine.placement.trace import Trace
from engine.planning.recording import Event

__all__ = [
    "ChunkBytes",
    "DiskPayloads",
    "Layout",
    "model_layout",
    "resident_chunks",
    "sharded_layout",
]


@dataclass
class Layout:
    """engine.chunks.chunk.layout over the full model, with who owns which parameter."""

    chunk_size: int
    numel: list[int]  # elements per chunk
    params: list[list[str]]  # parameter names per chunk
    chunk_of: dict[str, int]
    module_params: dict[str, list[str]]  # module name -> parameters it owns directly
    module_chunks: dict[str, tuple[int, ...]]
    sizes: dict[str, int]  # parameter -> elements
    # Per chunk: its parameters need no gradient (a payload-only chunk, Chunk.frozen).
    frozen: list[bool] = field(default_factory=list)

    def is_frozen(self, chunk: int) -> bool:
        return bool(self.frozen) and self.frozen[chunk]

    def trainable(self, chunk: int) -> int:
        """Parameters of `chunk` that get a gradient (the engine's grads_pending)."""
        return 0 if self.is_frozen(chunk) else len(self.params[chunk])


def model_layout(model: torch.nn.Module, events: list[Event], chunk_size: int | None) -> Layout:
    canonical = {id(p): name for name, p in model.named_parameters()}
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    module_params = {}
    for name, module in model.named_modules():
        own = list(dict.fromkeys(canonical[id(p)] for p in module.parameters(recurse=False)))
        if own:
            module_params[name] = own
    # First-use order, as engine.step.engine.first_use_order finds it with a forward pass.
    order: dict[str, None] = {}
    for event in events:
        if event[0] == "backward":
            break
        if event[0] == "point":
            order.update(dict.fromkeys(module_params[event[1]]))
    order.update(dict.fromkeys(sizes))
    names = list(order)
    size_list = [sizes[n] for n in names]
    size, groups = layout(size_list, chunk_size, [n in frozen for n in names])
    params = [[names[i] for i in members] for members in groups]
    chunk_of = {p: c for c, members in enumerate(params) for p in members}
    return Layout(
        chunk_size=size,
        numel=[chunk_numel(size_list, members) for members in groups],
        params=params,
        chunk_of=chunk_of,
        module_params=module_params,
        module_chunks={
            m: tuple(dict.fromkeys(chunk_of[p] for p in ps)) for m, ps in module_params.items()
        },
        sizes=sizes,
        frozen=[all(p in frozen for p in members) for members in params],
    )


def sharded_layout(lay: Layout, world: int) -> Layout:
    """`lay` as `world` ranks hold it: every chunk padded to split into `world` shards
    (engine.chunks.packing.build_chunks with ranks); the parameters stay where they are."""
    if world == 1:
        return lay
    return dataclasses.replace(lay, numel=[padded_numel(n, world) for n in lay.numel])


@dataclass(frozen=True)
class ChunkBytes:
    """Bytes per chunk element and where they live (engine.chunks.packing.fill, ChunkManager).

    Data parallel (`world` ranks), one rank's: a chunk's home tensors hold its shard only
    (`home`), and `numel` is the padded whole chunk (sharded_layout)."""

    itemsize: int  # compute dtype
    world: int = 1

    @property
    def aliased(self) -> bool:
        """fp32: the payload is the master itself; gradients land in a host buffer."""
        return self.itemsize == 4

    @property
    def sharded(self) -> bool:
        return self.world > 1

    def home(self, numel: int) -> int:
        """Elements of a chunk's home tensors: this rank's shard (Chunk.home_numel)."""
        return numel // self.world

    def host(self, numel: int, frozen: bool = False) -> int:
        """A chunk at home on the host: payload, master, landed gradients, two moments (a
        frozen chunk: its payload alone)."""
        if frozen:
            return self.itemsize * self.home(numel)
        payload = 0 if self.aliased else self.itemsize
        return (payload + 4 + 8) * self.home(numel) + self.landed(numel)

    def landed(self, numel: int, frozen: bool = False) -> int:
        """fp32: the host buffer a non-resident chunk's gradients land in (Chunk.host_grad;
        bf16/fp16: they land in the payload)."""
        return 0 if frozen or not self.aliased else 4 * self.home(numel)

    def resident(self, numel: int, frozen: bool = False) -> int:
        """A resident chunk's device bytes between steps: payload, master, two moments;
        sharded, in fp32 also the gradients' landing place (ChunkManager._move_shard). A
        frozen chunk: its payload alone."""
        if frozen:
            return self.itemsize * self.home(numel)
        landed = 4 if self.aliased and self.sharded else 0
        return (self.itemsize + (0 if self.aliased else 4) + 8 + landed) * self.home(numel)

    def resident_cost(self, numel: int, frozen: bool = False) -> int:
        """Resident bytes plus room for its gradients (rules.resident_cost, of the shard)."""
        return rules.resident_cost(self.home(numel), self.itemsize, frozen=frozen)


@dataclass(frozen=True)
class DiskPayloads:
    """Chunks whose payload is in the scratch folder, as the step's read-ahead sees them."""

    chunks: frozenset[int] = frozenset()
    pieces: Sequence[int] = field(default_factory=tuple)  # pieces per chunk (rules.disk_cost)
    slots: int = 0  # payload pieces that may be read ahead at once



def resident_chunks(
    lay: Layout,
    cost: ChunkBytes,
    policy: Policy,
    margin_ratio: float,
    capacity: int,
    trace: Trace | None,
) -> set[int]:
    """Chunks whose payload and optimizer state live on the device (rules.resident_chunks)."""
    return rules.resident_chunks(policy, [cost.resident_cost(n, lay.is_frozen(c))
                                          for c, n in enumerate(lay.numel)],
                                 trace=trace, capacity=capacity, margin_ratio=margin_ratio)
