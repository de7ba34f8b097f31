"""A step's batch as its micro-batches (EngineConfig.grad_accum), and the loss each one's
backward starts from."""

from __future__ import annotations

import torch

__all__ = ["check_split", "scaled_loss", "split_batch"]


def split_batch(batch: dict, parts: int) -> list[dict]:
    """`batch` as `parts` equal micro-batches along its first dimension, in order."""
    if parts == 1:
        return [batch]
    check_split(batch["input_ids"].shape[0], parts)
    return [{k: v.chunk(parts)[i] if isinstance(v, torch.Tensor) else v
             for k, v in batch.items()} for i in range(parts)]


def check_split(rows: int | None, parts: int) -> None:
    """ValueError unless a batch of `rows` sequences splits into `parts` equal micro-batches
    (None: no batch seen yet, nothing to check)."""
    if rows is not None and rows % parts:
        raise ValueError(f"a batch of {rows} sequences does not split into {parts} "
                         f"equal micro-batches (grad_accum)")


def scaled_loss(loss: torch.Tensor, scale: float) -> torch.Tensor:
    """What a micro-batch's backward starts from: its loss times `scale` (1 / micro-batches,
    times fp16's loss scale), or the loss itself where that is 1. The product is one scalar
    more on the device through backward; the plan's recording makes it too
    (engine.planning.recording), so that a budget the plan says fits is one the step fits."""
    return loss * scale if scale != 1.0 else loss
