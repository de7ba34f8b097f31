"""Data parallel, what every rank's engine agrees on at each step: the settings rank 0
staged, and the step's loss, tokens and which parameters got a gradient somewhere."""

from __future__ import annotations

import torch

from engine.chunks.chunk import Chunk
from engine.config import LiveSettings

__all__ = ["agree_step", "follow_rank_zero"]


def follow_rank_zero(collectives, staged: LiveSettings | None, settings: LiveSettings
                     ) -> LiveSettings | None:
    """The settings rank 0 staged (None: none), every rank's, so that a change made on rank
    0 alone (the app steers rank 0) takes effect on every rank at the same step. One small
    collective per step."""
    row = torch.tensor([float(staged is not None), *(staged or settings).as_row()],
                       dtype=torch.float64, device=collectives.device)
    first = collectives.all_gather_rows(row)[0].tolist()
    return LiveSettings.from_row(first[1:]) if first[0] else None


def agree_step(collectives, chunks: list[Chunk], loss: float, tokens: int
               ) -> tuple[float, int]:
    """The whole batch's loss and tokens, and which parameters got a gradient on some rank
    (those are updated everywhere, as DDP would); raises if the ranks issued different
    collectives this step."""
    slots = [s for c in chunks for s in c.slots]
    loss, tokens, used = collectives.agree_step(loss, tokens, [s.got_grad for s in slots])
    for slot, got in zip(slots, used, strict=True):
        slot.got_grad = got
    return loss, tokens
