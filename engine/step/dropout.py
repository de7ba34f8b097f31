"""Dropout under data parallel: every rank draws the masks of the whole global batch.

One process on a global batch of N x b sequences draws each dropout mask for all N x b
rows at once, from the global generator. So that N ranks of b sequences train exactly as
that process, every rank seeds alike (the run's seed), draws the mask of the whole batch
(N x b rows along the first dimension, the batch dimension of transformers' models) and
keeps its own b rows: rank r those from r x b, the rows its part of the batch holds. The
ranks' generators then advance alike, and one process's masks are the ranks' masks put
together. The cost is the drawing of N masks per rank, not their memory: the other rows
are freed at once.

Dropout inside a fused attention kernel (scaled_dot_product_attention's dropout_p) is
drawn by the kernel, per rank; the zoo's models have none.
"""

from __future__ import annotations

import torch
from torch.nn import functional
from torch.overrides import TorchFunctionMode


class WholeBatchDropout(TorchFunctionMode):
    """Within the block, `torch.nn.functional.dropout` in training draws the mask of the
    whole batch of `world` ranks and keeps rank `rank`'s rows (see the module doc). The
    arithmetic is torch's own on the CPU (a mask of bernoulli(1 - p) in the input's dtype,
    divided by 1 - p, times the input), so one rank on the whole batch is plain PyTorch."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is functional.dropout:
            return self._dropout(*args, **kwargs)
        return func(*args, **kwargs)

    def _dropout(self, input: torch.Tensor, p: float = 0.5, training: bool = True,
                 inplace: bool = False) -> torch.Tensor:
        if not training or p <= 0.0 or p >= 1.0 or input.dim() == 0:
            return functional.dropout(input, p, training, inplace)
        rows = input.shape[0]
        whole = torch.empty((rows * self.world, *input.shape[1:]), dtype=input.dtype,
                            device=input.device)
        whole.bernoulli_(1.0 - p)
        noise = whole[self.rank * rows:(self.rank + 1) * rows].clone()
        del whole
        noise.div_(1.0 - p)
        return input.mul_(noise) if inplace else input * noise
