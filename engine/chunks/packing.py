"""Packing a model's parameters into chunks: use order, layout, and the one copy in.

After `build_chunks` every parameter is a view into its chunk's device payload, and the
storage the model was built with has been freed parameter by parameter, so the peak is
one model plus the chunks, never two models.
"""

from __future__ import annotations

import torch

from engine.chunks.chunk import Chunk, Slot, chunk_numel, layout
from engine.devices.device import ComputeDevice


def first_use_order(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Unique parameters in the order a forward pass first touches them.

    Found with a two-token forward under no_grad; registration order if the model cannot
    run that way (it is the same for the usual decoder stacks).
    """
    order: list[torch.nn.Parameter] = []
    seen: set[int] = set()

    def note(module: torch.nn.Module, _args: object) -> None:
        for p in module.parameters(recurse=False):
            if id(p) not in seen:
                seen.add(id(p))
                order.append(p)

    handles = [m.register_forward_pre_hook(note) for m in model.modules()]
    try:
        with torch.no_grad():
            device = next(model.parameters()).device
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=device))
    except Exception:
        order.clear()
        seen.clear()
    finally:
        for h in handles:
            h.remove()
    for p in model.parameters():  # parameters the dry run did not reach
        if id(p) not in seen:
            seen.add(id(p))
            order.append(p)
    return order


def build_chunks(model: torch.nn.Module, *, dtype: torch.dtype, device: ComputeDevice,
                 chunk_size: int | None = None) -> tuple[int, list[Chunk]]:
    """(chunk size, chunks) holding every unique parameter of `model`, in first-use order."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    params = first_use_order(model)
    sizes = [p.numel() for p in params]
    size, groups = layout(sizes, chunk_size)
    chunks = []
    for index, members in enumerate(groups):
        slots, offset = [], 0
        for i in members:
            p = params[i]
            slots.append(Slot(names[id(p)], p, offset, p.numel(), p.shape))
            offset += chunk_numel(sizes, [i])
        chunk = Chunk(index, chunk_numel(sizes, members), dtype, slots)
        fill(chunk, device)
        chunks.append(chunk)
    return size, chunks


def fill(chunk: Chunk, dev: ComputeDevice) -> None:
    """Copy the chunk's parameters in, then free their original storage one by one."""
    chunk.master = dev.host_empty(chunk.numel, torch.float32).zero_()
    for slot in chunk.slots:
        src = slot.param.detach().reshape(-1)
        chunk.master[slot.offset:slot.offset + slot.numel].copy_(src)
        slot.param.data = torch.empty(0, dtype=chunk.dtype, device=dev.torch_device)
    if chunk.aliased:
        chunk.payload = chunk.master
        chunk.host_grad = dev.host_empty(chunk.numel, torch.float32)
    else:
        chunk.payload = dev.host_empty(chunk.numel, chunk.dtype)
        chunk.payload.copy_(chunk.master)
    chunk.exp_avg = dev.host_empty(chunk.numel, torch.float32).zero_()
    chunk.exp_avg_sq = dev.host_empty(chunk.numel, torch.float32).zero_()
    chunk.step = torch.zeros((), dtype=torch.float32)
    chunk.device_payload = dev.empty(chunk.numel, chunk.dtype)
    chunk.bind_params()  # views first: a view cannot be made of empty storage
    chunk.device_payload.untyped_storage().resize_(0)
