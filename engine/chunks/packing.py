"""Packing a model's parameters into chunks: use order, layout, and the one copy in.

After `build_chunks` every parameter is a view into its chunk's device payload, and the
storage the model was built with has been freed parameter by parameter, so the peak is
one model plus the chunks, never two models. A model made on the meta device has no
storage at all: each chunk is filled from a WeightSource (engine.models.weight_source)
a few tensors at a time, so the host holds the chunks and one tensor read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from engine.chunks.chunk import Chunk, Slot, chunk_numel, layout
from engine.devices.device import ComputeDevice
from engine.distributed.shards import Shard, overlap, padded_numel
from engine.models.training import untouched
from engine.models.weight_source import WeightSource


@dataclass
class FirstUse:
    """What a dry forward pass shows about where parameters are used."""

    order: list[torch.nn.Parameter]  # unique parameters in the order they are first used
    # id(module) -> parameters its own forward reads but does not own (torch's
    # TransformerEncoderLayer hands `self_attn.out_proj.weight` to a function, so out_proj's
    # forward never runs): the module's hooks must fetch them too.
    borrowed: dict[int, list[torch.nn.Parameter]] = field(default_factory=dict)


class Reads(TorchFunctionMode):
    """Notes the parameters each torch function is handed, for the innermost module running."""

    def __init__(self, running: list[torch.nn.Module], note: Callable) -> None:
        super().__init__()
        self.running, self.note = running, note

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.running and not _bookkeeping(func):
            for arg in (*args, *kwargs.values()):
                for value in arg if isinstance(arg, list | tuple) else (arg,):
                    if isinstance(value, torch.nn.Parameter):
                        self.note(self.running[-1], value)
        return func(*args, **kwargs)


# Attribute reads that hand out a view of the data: a use of the parameter like any op.
_VIEWS = frozenset({"T", "mT", "H", "mH", "real", "imag"})


def _bookkeeping(func: Callable) -> bool:
    """Whether `func` sets or reads a tensor attribute without using its data
    (`param.data = ...` when a chunk binds its views, `param.requires_grad`, `param.grad`):
    the engine's own hooks do so for every parameter of a chunk, and a model's forward
    asking `weight.dtype` uses nothing."""
    name = getattr(func, "__name__", "")
    if name == "__set__":
        return True
    return name == "__get__" and getattr(getattr(func, "__self__", None), "__name__", "") \
        not in _VIEWS


def first_uses(model: torch.nn.Module) -> FirstUse:
    """Parameters in first-use order, and who borrows whose, from a two-token forward under
    no_grad; registration order and no borrowing if the model cannot run that way (the
    order is the same for the usual decoder stacks, and the first traced step finds the
    borrowing then, engine.step.borrowing).

    The trial forward is invisible to the run (models.training.untouched): it runs in eval
    mode (no dropout mask drawn, no BatchNorm statistic updated) and leaves the random
    state and every module's mode as they were, so a script that seeds before building the
    engine draws the masks plain PyTorch would."""
    found = FirstUse([])
    seen: set[int] = set()
    running: list[torch.nn.Module] = []
    own = {id(m): {id(p) for p in m.parameters(recurse=False)} for m in model.modules()}

    def first(p: torch.nn.Parameter) -> None:
        if id(p) not in seen:
            seen.add(id(p))
            found.order.append(p)

    def enter(module: torch.nn.Module, _args: object) -> None:
        running.append(module)
        for p in module.parameters(recurse=False):
            first(p)

    def leave(module: torch.nn.Module, _args: object, _out: object) -> None:
        running.pop()

    def read(module: torch.nn.Module, p: torch.nn.Parameter) -> None:
        if id(p) not in own[id(module)]:
            borrowed = found.borrowed.setdefault(id(module), [])
            if all(q is not p for q in borrowed):
                borrowed.append(p)
        first(p)

    handles = [h for m in model.modules()
               for h in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    try:
        with torch.no_grad(), untouched(model), Reads(running, read):
            model.eval()
            device = next(model.parameters()).device
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device))
    except Exception:
        found = FirstUse([])
        seen.clear()
    finally:
        for h in handles:
            h.remove()
    for p in model.parameters():  # parameters the dry run did not reach
        first(p)
    return found


def first_use_order(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Unique parameters in the order a forward pass first touches them (see first_uses)."""
    return first_uses(model).order


def build_chunks(model: torch.nn.Module, *, dtype: torch.dtype, device: ComputeDevice,
                 chunk_size: int | None = None, order: list[torch.nn.Parameter] | None = None,
                 ranks: tuple[int, int] | None = None, filled: bool = True,
                 weights: WeightSource | None = None) -> tuple[int, list[Chunk]]:
    """(chunk size, chunks) holding every unique parameter of `model`, in first-use order
    (`order`, found with a dry forward pass when not given).

    `weights`: where the values come from (`fill`), required when the model's parameters
    are on the meta device; else the parameters' own.

    `ranks` (rank, world size): data parallel; each chunk is padded to a multiple of the
    world size and this rank keeps only its shard (engine.distributed.shards). Every rank
    must start from the same weights: the layout is the same everywhere by construction."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    params = order if order is not None else first_use_order(model)
    meta = [names[id(p)] for p in params if p.is_meta]
    if meta and weights is None:
        raise ValueError(f"{len(meta)} parameters are on the meta device ({meta[0]}, ...): "
                         f"give the engine the weights to fill them from")
    sizes = [p.numel() for p in params]
    frozen = [not p.requires_grad for p in params]
    size, groups = layout(sizes, chunk_size, frozen)
    chunks = []
    for index, members in enumerate(groups):
        slots, offset = [], 0
        for i in members:
            p = params[i]
            slots.append(Slot(names[id(p)], p, offset, p.numel(), p.shape))
            offset += chunk_numel(sizes, [i])
        numel = chunk_numel(sizes, members)
        shard = None
        if ranks is not None:
            numel = padded_numel(numel, ranks[1])
            shard = Shard(ranks[0], ranks[1], numel)
        chunk = Chunk(index, numel, dtype, slots, shard=shard,
                      frozen=all(frozen[i] for i in members))
        if filled:  # else the caller fills each chunk (`fill`), placing it before the next
            fill(chunk, device, weights)
        chunks.append(chunk)
    return size, chunks


def fill(chunk: Chunk, dev: ComputeDevice, weights: WeightSource | None = None) -> None:
    """Copy the chunk's parameters in (a sharded chunk: the part in its shard), then free
    their original storage one by one. `weights`: the values come from there, one tensor
    at a time (a meta parameter gets a body without storage, its identity kept)."""
    home = chunk.home_numel
    lo, hi = (chunk.shard.lo, chunk.shard.hi) if chunk.shard else (0, chunk.numel)
    # A frozen chunk's weights go straight into its payload: it has no master (fp32: the
    # payload is the master, as for any chunk).
    dtype = chunk.dtype if chunk.frozen else torch.float32
    home_values = dev.host_empty(home, dtype).zero_()
    params = [slot.param for slot in chunk.slots]
    values = weights.tensors(params) if weights is not None else (p.detach() for p in params)
    for slot in chunk.slots:
        value = next(values)
        part = overlap(slot.offset, slot.numel, lo, hi)
        if part is not None:
            src = value.reshape(-1)[part[0] - slot.offset:part[1] - slot.offset]
            home_values[part[0] - lo:part[1] - lo].copy_(src)
        del value  # before the next is read: one tensor at a time
        if slot.param.is_meta:
            torch.utils.swap_tensors(slot.param, torch.nn.Parameter(
                torch.empty(0, dtype=chunk.dtype), requires_grad=slot.param.requires_grad))
        slot.param.data = torch.empty(0, dtype=chunk.dtype, device=dev.torch_device)
    if chunk.frozen:
        chunk.payload = home_values
        chunk.master = home_values if chunk.aliased else None
    else:
        _fill_state(chunk, dev, home_values)
    chunk.device_payload = dev.empty(chunk.numel, chunk.dtype)
    chunk.bind_params()  # views first: a view cannot be made of empty storage
    chunk.device_payload.untyped_storage().resize_(0)


def _fill_state(chunk: Chunk, dev: ComputeDevice, master: torch.Tensor) -> None:
    """A trainable chunk's home tensors around its fp32 `master`: payload, moments and, for
    a shard, its gradient landing place."""
    home = chunk.home_numel
    chunk.master = master
    if chunk.aliased:
        chunk.payload = chunk.master
        if chunk.sharded:  # else made as the gradients land (Gradients.grad_home)
            chunk.host_grad = dev.host_empty(home, torch.float32)
    else:
        chunk.payload = dev.host_empty(home, chunk.dtype)
        chunk.payload.copy_(chunk.master)
    chunk.exp_avg = dev.host_empty(home, torch.float32).zero_()
    chunk.exp_avg_sq = dev.host_empty(home, torch.float32).zero_()


def move_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """The model's buffers (RoPE's frequencies, BatchNorm's statistics) onto the compute
    device: they are no chunk's, and the modules read them there."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.device != device:
                module._buffers[name] = buf.to(device)
