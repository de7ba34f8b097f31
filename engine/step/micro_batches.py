"""A step's batch as its micro-batches (EngineConfig.grad_accum)."""

from __future__ import annotations

import torch

__all__ = ["split_batch"]


def split_batch(batch: dict, parts: int) -> list[dict]:
    """`batch` as `parts` equal micro-batches along its first dimension, in order."""
    if parts == 1:
        return [batch]
    size = batch["input_ids"].shape[0]
    if size % parts:
        raise ValueError(f"a batch of {size} sequences does not split into {parts} "
                         f"equal micro-batches (grad_accum)")
    return [{k: v.chunk(parts)[i] if isinstance(v, torch.Tensor) else v
             for k, v in batch.items()} for i in range(parts)]
