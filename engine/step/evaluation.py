"""A loss with no gradient and no update (Engine.evaluate)."""

from __future__ import annotations

import math

import torch

from engine.chunks.manager import ChunkManager
from engine.devices.device import ComputeDevice
from engine.models.training import untouched
from engine.placement.trace import Trace

__all__ = ["evaluate_loss", "room_for_activations"]


def evaluate_loss(model: torch.nn.Module, manager: ChunkManager, device: ComputeDevice,
                  batch: dict[str, torch.Tensor]) -> float:
    """The model's loss on `batch` in eval mode, its training flags left as they were.

    Chunks are fetched by the hooks as in any forward. Their device copies stay there
    while they leave room for the forward's activations (`room_for_activations`), evicted
    only for lack of room: with every chunk fitting, the first batch copies each chunk
    once and later ones copy nothing, until the next update makes the copies stale (the
    step then uses or drops them as its policy says). With no trace to forecast the
    activations from, every copy is dropped after use, as under cpu."""
    manager.flight.wait()
    # Measured from its own start, as a step is: on a GPU, what other engines of this
    # process allocated since this one's last step is theirs, not this forward's.
    device.begin_step(manager.device_bytes)
    dev = device.torch_device
    batch = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    room = room_for_activations(manager.trace, tuple(batch["input_ids"].shape))
    done = False
    try:
        with untouched(model), torch.no_grad(), manager.keeping_copies(room):
            model.eval()
            loss = float(model(**batch).loss)
        done = True
        return loss
    finally:
        if room is None or not done:
            manager.release_all()


def room_for_activations(trace: Trace | None, shape: tuple[int, ...]) -> int | None:
    """Device bytes an evaluation forward over a batch of `shape` may need beside the
    chunks: the traced training step's non-model peak, which holds a forward's activations
    and much more (autograd's saved tensors, backward's gradients), scaled up for a batch
    with more tokens or a longer sequence (attention grows with its square). None when
    there is no trace yet."""
    if trace is None or not trace.points or len(shape) != 2 or len(trace.shape) != 2:
        return None
    tokens = max(1.0, math.prod(shape) / math.prod(trace.shape))
    longer = max(1.0, shape[1] / trace.shape[1])
    return math.ceil(trace.non_model_peak * tokens * longer)
