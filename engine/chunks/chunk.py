"""Chunks: flat buffers that hold several parameters back to back.

A chunk owns, for its parameters:
- `payload`: the parameters in the compute dtype. Its home is the host, or the device when
  the chunk is resident. In bf16/fp16, after backward the host payload is reused for the
  gradients (the optimizer regenerates the parameters from the fp32 master), which is how
  bf16 training fits in 14 bytes per parameter on the host. In fp32 the payload *is* the
  master (one tensor, no copy after the update) and gradients land in `host_grad`, made as
  the first of them lands and, without a disk tier or sharding, freed by their update
  (engine.placement.rules.grads_land_per_step).
- `device_payload`: the device copy; parameters are views into it for the whole run and hold
  empty storage whenever it is released.
- `master`, `exp_avg`, `exp_avg_sq`: fp32 AdamW state, on the host or (resident) the device.

A *frozen* chunk holds only parameters that need no gradient (a LoRA run's base weights):
its payload alone, with no master (fp32: the payload, as for any chunk), no moments and no
gradient landing place. Trainable and frozen parameters are never packed together, so a
frozen chunk costs its payload and nothing more wherever it lives.

The layout (which parameter goes where) is a pure function of the parameter sizes, so the
planner can compute it on the meta device without allocating anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from engine.chunks.state import ACTIVITY, IllegalTransition, TensorState, check_transition
from engine.distributed.shards import Shard
from engine.placement import rules


class _Waits(Protocol):
    def wait(self, chunk: Chunk | None = None) -> None: ...


class PartsOnDisk(Protocol):
    """What a chunk's users ask of the disk tier that holds parts of it (implemented by
    engine.chunks.spill.Spill, which builds on chunks, so a chunk knows it by this only)."""

    flight: _Waits  # the update that may still be running over the chunk's parts

    def restore_payload(self, chunk: Chunk) -> None: ...


ALIGN = rules.ELEMENT_ALIGN  # keeps every parameter view 64-byte aligned for vectorised kernels


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def host_bytes_per_parameter(precision: str, *, frozen: bool = False) -> int:
    """Host bytes a non-resident chunk keeps per parameter at its most: fp32 master and two
    moments, plus the payload (fp32: the master itself) and a gradient landing place (fp32:
    from the gradients' landing to the update where engine.placement.rules.
    grads_land_per_step says so; bf16/fp16: the payload itself, reused after backward). A
    frozen chunk: its payload alone."""
    if frozen:
        return 4 if precision == "fp32" else 2
    return 16 if precision == "fp32" else 14


def pack(sizes: list[int], chunk_size: int) -> list[list[int]]:
    """Greedy packing of parameters (in use order) into chunks of `chunk_size` elements.

    A parameter larger than the chunk gets a chunk of its own. Returns the parameter
    indices of each chunk.
    """
    chunks: list[list[int]] = []
    current: list[int] = []
    used = 0
    for i, n in enumerate(sizes):
        need = _aligned(n)
        if need > chunk_size:
            if current:
                chunks.append(current)
                current, used = [], 0
            chunks.append([i])
            continue
        if used + need > chunk_size:
            chunks.append(current)
            current, used = [], 0
        current.append(i)
        used += need
    if current:
        chunks.append(current)
    return chunks


def packing_waste(sizes: list[int], chunk_size: int) -> int:
    """Elements left empty if every regular chunk were `chunk_size` long."""
    waste = 0
    for members in pack(sizes, chunk_size):
        filled = sum(_aligned(sizes[i]) for i in members)
        if filled <= chunk_size:
            waste += chunk_size - filled
    return waste


def search_chunk_size(sizes: list[int], *, candidates: int = 64,
                      max_waste: float = 0.05, runs: list[list[int]] | None = None) -> int:
    """The smallest chunk size (elements) that wastes at most `max_waste` of the model.

    Smaller chunks lower the minimum working set (a chunk and its gradient buffer must fit
    beside the activations) and let the auto policy keep finer-grained pieces; below ~1/64
    of the model they only add copies and kernel calls. So the search runs from 1/64 to 1/4
    of the model (clamped to 2^12..2^26 elements) and takes the first size that packs
    well, or the one that wastes least if none does. `runs`: the parameters (indices) of
    each run packed apart (layout's frozen and trainable ones); the waste is their sum.
    """
    runs = runs or [list(range(len(sizes)))]
    total = sum(_aligned(n) for n in sizes)
    lo = max(2**12, min(total // 64, 2**26))
    hi = max(lo, min(total // 4, 2**26))
    step = max(ALIGN, (hi - lo) // candidates // ALIGN * ALIGN)
    best, best_waste = hi, None
    for size in range(lo, hi + 1, step):
        waste = sum(packing_waste([sizes[i] for i in run], size) for run in runs)
        if waste <= max_waste * total:
            return size
        if best_waste is None or waste < best_waste:
            best, best_waste = size, waste
    return best


@dataclass(eq=False)
class Slot:
    """Where one parameter sits in its chunk."""

    name: str
    param: torch.nn.Parameter
    offset: int
    numel: int
    shape: torch.Size
    state: TensorState = TensorState.FREE
    got_grad: bool = False
    steps: int = 0  # AdamW updates this parameter has had (torch counts per parameter)

    @property
    def trainable(self) -> bool:
        return self.param.requires_grad


class DeviceCopy(str, Enum):
    """The chunk's copy on the compute device."""

    ABSENT = "ABSENT"  # storage released; the parameters hold empty storage
    FRESH = "FRESH"  # materialised and equal to the parameters
    STALE = "STALE"  # materialised, but its gradients went home and the update will change it


_C = DeviceCopy
# FRESH -> FRESH and STALE -> STALE: re-marking a copy (a refetch, a second mark) is harmless.
COPY_TRANSITIONS: dict[DeviceCopy, frozenset[DeviceCopy]] = {
    _C.ABSENT: frozenset({_C.FRESH}),
    _C.FRESH: frozenset({_C.FRESH, _C.STALE, _C.ABSENT}),
    _C.STALE: frozenset({_C.STALE, _C.FRESH, _C.ABSENT}),
}


@dataclass(eq=False)
class Chunk:
    index: int
    numel: int
    dtype: torch.dtype
    slots: list[Slot]
    payload: torch.Tensor | None = None  # home copy in the compute dtype (host unless resident)
    device_payload: torch.Tensor | None = None  # storage resized to 0 when not on the device
    grad: torch.Tensor | None = None  # device gradient buffer while backward fills it
    host_grad: torch.Tensor | None = None  # fp32 only: where gradients land on the host
    # Autograd's own gradient per parameter, keyed by the slot's offset: a resident chunk's
    # until the update, another's until they go home (rules.keeps_grad).
    slot_grads: dict[int, tuple[Slot, torch.Tensor]] = field(default_factory=dict)
    master: torch.Tensor | None = None
    exp_avg: torch.Tensor | None = None
    exp_avg_sq: torch.Tensor | None = None
    resident: bool = False  # payload and optimizer state live on the device
    copy: DeviceCopy = DeviceCopy.ABSENT  # the device copy; changed through set_copy only
    grads_pending: int = 0  # parameters whose gradient has not arrived this backward
    holds_grads: bool = False  # the home payload holds gradients, not parameters
    computing: int = 0  # parameters in COMPUTE; kept by set_state so in_use() is O(1)
    pending: object = None  # an unfinished prefetch into device_payload (CUDA only)
    # The disk tier (engine.chunks.spill): parts kept in the scratch folder instead of on the
    # host. Their tensors are None there, except while read into I/O buffers for a use.
    state_on_disk: bool = False  # optimizer state (bf16/fp16: the master too)
    payload_on_disk: bool = False  # the payload too (fp32: it is the master; and gradients)
    grad_sq: float | None = None  # squared norm of gradients that went to disk as they landed
    spill: PartsOnDisk | None = None  # the disk tier's side of this chunk, when there is one
    # Data parallel (engine.distributed): this rank's shard. Then `numel` is the padded
    # whole chunk, which `device_payload` and the gradient buffer hold while gathered, and
    # the home tensors (payload, master, moments, host_grad) hold the shard only, on the
    # host or, resident, on the device. The whole chunk is gathered for each use even when
    # resident: residency places the shard and its optimizer update.
    shard: Shard | None = None
    # Every parameter needs no gradient: the payload alone (module docstring); fixed when
    # the chunks are packed.
    frozen: bool = False

    @property
    def sharded(self) -> bool:
        return self.shard is not None

    @property
    def home_numel(self) -> int:
        """Elements of the home tensors: the shard's, or the whole chunk's."""
        return self.shard.size if self.shard is not None else self.numel

    @property
    def copy_is_home(self) -> bool:
        """The device copy is the payload itself (a resident, unsharded chunk): it is never
        released while the chunk stays resident."""
        return self.resident and self.shard is None

    @property
    def kept_grad_bytes(self) -> int:
        """Bytes of autograd's gradients the chunk keeps (`slot_grads`)."""
        return sum(g.nbytes for _, g in self.slot_grads.values())

    @property
    def on_device(self) -> bool:
        """The device payload is materialised (fresh or stale)."""
        return self.copy != DeviceCopy.ABSENT

    @property
    def stale(self) -> bool:
        """The device copy no longer matches the parameters (its gradients went home)."""
        return self.copy == DeviceCopy.STALE

    def set_copy(self, new: DeviceCopy) -> None:
        if new not in COPY_TRANSITIONS[self.copy]:
            raise IllegalTransition(
                f"chunk {self.index}: device copy {self.copy.value} -> {new.value} is not allowed")
        self.copy = new

    def mark_stale(self) -> None:
        """The update will change the parameters: a device copy, if any, is outdated."""
        if self.on_device:
            self.set_copy(DeviceCopy.STALE)

    @property
    def aliased(self) -> bool:
        """The payload is the fp32 master itself."""
        return self.dtype == torch.float32

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        """Payload bytes in the compute dtype."""
        return self.numel * self.itemsize

    @property
    def optim_nbytes(self) -> int:
        """fp32 master + two AdamW moments (none for a frozen chunk)."""
        return 0 if self.frozen else self.numel * 12

    @property
    def location(self) -> str:
        """Where its parameters are now: "device" (materialised there), "disk" (the payload
        is in the scratch folder) or "host"."""
        if self.on_device:
            return "device"
        return "disk" if self.payload_on_disk else "host"

    @property
    def disk_level(self) -> int:
        """0: nothing on disk; 1: optimizer state on disk; 2: payload too
        (engine.placement.rules.DiskPlacement.level)."""
        return 2 if self.payload_on_disk else 1 if self.state_on_disk else 0

    def set_state(self, slot: Slot, new: TensorState) -> None:
        check_transition(slot.name, slot.state, new)
        self.computing += (new == TensorState.COMPUTE) - (slot.state == TensorState.COMPUTE)
        slot.state = new

    def set_states(self, new: TensorState) -> None:
        for slot in self.slots:
            if slot.state != new:
                self.set_state(slot, new)

    def in_use(self) -> bool:
        return self.computing > 0

    def most_active(self) -> TensorState:
        present = {s.state for s in self.slots}
        return next(state for state in ACTIVITY if state in present)

    def bind_params(self) -> None:
        """Point every parameter at its slice of the device payload (permanent views)."""
        assert self.device_payload is not None
        for slot in self.slots:
            view = self.device_payload[slot.offset : slot.offset + slot.numel]
            slot.param.data = view.view(slot.shape)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[s.offset : s.offset + s.numel] for s in self.slots]


def squared_norm(t: torch.Tensor) -> float:
    """Squared L2 norm, accumulated in fp32 (gradient clipping and fp16's overflow check)."""
    return float(torch.linalg.vector_norm(t, dtype=torch.float32)) ** 2


def layout(sizes: list[int], chunk_size: int | None, frozen: list[bool] | None = None
           ) -> tuple[int, list[list[int]]]:
    """(chunk size, parameter indices per chunk) for parameters of `sizes` in use order.

    `frozen`: which parameters need no gradient. Those and the trainable ones are packed
    apart (each kind in use order), so that a frozen chunk keeps no optimizer state; the
    chunks are numbered by the first use of their first parameter, as they would be
    otherwise. The chunk size is searched over the two packings together."""
    if not frozen or all(frozen) or not any(frozen):
        size = chunk_size or search_chunk_size(sizes)
        return size, pack(sizes, size)
    kinds = [[i for i, f in enumerate(frozen) if f == kind] for kind in (False, True)]
    if chunk_size is None:
        chunk_size = search_chunk_size(sizes, runs=kinds)
        # The trainable parameters (LoRA's adapters: a percent of the model, spread over
        # every layer) in chunks of their own size: one of the model's would hold every
        # layer's adapters, needed, fetched and its gradients open from the first layer to
        # the last.
        trainable = search_chunk_size([sizes[i] for i in kinds[0]])
    else:
        trainable = chunk_size
    groups = [[kind[i] for i in members]
              for kind, size in zip(kinds, (trainable, chunk_size), strict=True)
              for members in pack([sizes[i] for i in kind], size)]
    return chunk_size, sorted(groups, key=lambda members: members[0])



def chunk_numel(sizes: list[int], members: list[int]) -> int:
    """Elements a chunk holding `members` needs (each parameter aligned)."""
    return sum(_aligned(sizes[i]) for i in members)
