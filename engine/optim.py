"""AdamW over whole chunks with fp32 master weights.

One call of PyTorch's fused AdamW kernel per chunk, wherever the chunk's optimizer state
lives (host or device): no per-parameter Python loop, and on this kind of CPU the fused
kernel is ~20x faster than the foreach path. In fp32 the result is bit-identical to
`torch.optim.AdamW(fused=True)` over the same parameters: the kernel is elementwise.
"""

from __future__ import annotations

import math

import torch

from engine.chunk import Chunk


def grad_of(chunk: Chunk) -> torch.Tensor:
    """The chunk's gradients (its home payload after backward) as fp32."""
    g = chunk.payload
    return g if g.dtype == torch.float32 else g.float()


def global_grad_norm(chunks: list[Chunk]) -> float:
    """L2 norm over every gradient; inf or nan when any gradient overflowed."""
    total = 0.0
    for chunk in chunks:
        if chunk.holds_grads:
            total += float(torch.linalg.vector_norm(chunk.payload, dtype=torch.float32)) ** 2
    return math.sqrt(total) if math.isfinite(total) else total


def adamw_update(chunk: Chunk, *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, grad_scale: float = 1.0) -> None:
    """One AdamW step of the chunk from the gradients in its home payload.

    `grad_scale` multiplies the gradients first (loss-scale undo and clipping in one).
    Parameters that got no gradient this step keep their weights and moments, as
    torch.optim.AdamW skips parameters whose .grad is None.
    """
    grad = grad_of(chunk)
    if grad_scale != 1.0:
        grad = grad * grad_scale if grad is chunk.payload else grad.mul_(grad_scale)
    skipped = [s for s in chunk.slots if not s.got_grad]
    kept = [(s, chunk.master[s.offset:s.offset + s.numel].clone(),
             chunk.exp_avg[s.offset:s.offset + s.numel].clone(),
             chunk.exp_avg_sq[s.offset:s.offset + s.numel].clone()) for s in skipped]
    chunk.step += 1
    torch._fused_adamw_(
        [chunk.master], [grad], [chunk.exp_avg], [chunk.exp_avg_sq], [], [chunk.step],
        lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, eps=eps,
        amsgrad=False, maximize=False)
    for s, master, m, v in kept:
        sl = slice(s.offset, s.offset + s.numel)
        chunk.master[sl], chunk.exp_avg[sl], chunk.exp_avg_sq[sl] = master, m, v
    chunk.payload.copy_(chunk.master)  # parameters in the compute dtype, from the master
    chunk.holds_grads = False


def restore_params(chunk: Chunk) -> None:
    """Put the parameters back into a payload that holds gradients (a skipped step)."""
    chunk.payload.copy_(chunk.master)
    chunk.holds_grads = False
