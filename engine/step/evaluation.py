"""A loss with no gradient and no update (Engine.evaluate)."""

from __future__ import annotations

import torch

from engine.chunks.manager import ChunkManager
from engine.devices.device import ComputeDevice
from engine.models.training import untouched

__all__ = ["evaluate_loss"]


def evaluate_loss(model: torch.nn.Module, manager: ChunkManager, device: ComputeDevice,
                  batch: dict[str, torch.Tensor]) -> float:
    """The model's loss on `batch` in eval mode, its training flags left as they were;
    chunks are fetched by the hooks as in any forward, and all released after."""
    manager.flight.wait()
    dev = device.torch_device
    batch = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    try:
        with untouched(model), torch.no_grad():
            model.eval()
            return float(model(**batch).loss)
    finally:
        manager.release_all()
