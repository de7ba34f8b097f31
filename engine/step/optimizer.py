"""AdamW over whole chunks with fp32 master weights.

PyTorch's fused AdamW kernel, one call per chunk, wherever the chunk's optimizer state lives
(host or device): no per-parameter Python loop, and on this kind of CPU the fused kernel is
~20x faster than the foreach path. The kernel is elementwise, so in fp32 the result is
bit-identical to `torch.optim.AdamW(fused=True)` over the same parameters.

- A host chunk is updated as one flat tensor from its host gradients.
- A resident chunk passes autograd's own gradient tensors (one per parameter, as a list in
  the same single call), so the gradients are never copied.
- A chunk with parts on disk (engine.chunks.spill) is updated in I/O buffers: its state is
  read while the chunk before it is updated, and written back while the one after it is.
"""

from __future__ import annotations

import math

import torch

from engine.chunks.chunk import Chunk, squared_norm
from engine.chunks.manager import ChunkManager
from engine.config import EngineConfig

LOSS_SCALE_GROWTH_INTERVAL = 2000  # good fp16 steps before the loss scale doubles


def _flat_grad(chunk: Chunk) -> torch.Tensor:
    return chunk.host_grad if chunk.aliased else chunk.payload


def grad_norm_squared(chunk: Chunk) -> float:
    if chunk.resident:
        grads = [g for _, g in chunk.slot_grads.values()]
    elif chunk.payload_on_disk:
        return chunk.grad_sq  # taken as they landed, before they went to disk
    else:
        grads = [_flat_grad(chunk)]
    return sum(squared_norm(g) for g in grads)


def global_grad_norm(chunks: list[Chunk]) -> float:
    """L2 norm over every gradient; inf or nan when any gradient overflowed."""
    total = sum(grad_norm_squared(c) for c in chunks)
    return math.sqrt(total) if math.isfinite(total) else total


def adamw_update(chunk: Chunk, *, lr: float, betas: tuple[float, float], eps: float,
                 weight_decay: float, grad_scale: float = 1.0) -> None:
    """One AdamW step of the chunk from the gradients backward left it.

    `grad_scale` multiplies the gradients first (loss-scale undo and clipping in one).
    Parameters that got no gradient this step keep their weights and moments, as
    torch.optim.AdamW skips parameters whose .grad is None.
    """
    updated = [s for s in chunk.slots if s.got_grad]
    for slot in updated:
        slot.steps += 1
    device = chunk.master.device
    if chunk.resident or len({s.steps for s in updated}) > 1:
        # One view per parameter, each with its own step count (a parameter that missed a
        # step is one update behind its neighbours).
        if chunk.resident:
            picked = [chunk.slot_grads[offset] for offset in sorted(chunk.slot_grads)]
        else:
            flat = _flat_grad(chunk)
            picked = [(s, flat[s.offset:s.offset + s.numel]) for s in updated]

        def views(flat: torch.Tensor) -> list[torch.Tensor]:
            return [flat[s.offset:s.offset + s.numel] for s, _ in picked]

        params, m, v = views(chunk.master), views(chunk.exp_avg), views(chunk.exp_avg_sq)
        grads = [g if g.dtype == torch.float32 else g.float() for _, g in picked]
        steps = [_step_tensor(s.steps, device) for s, _ in picked]
        restore = []
    else:
        # Every updated parameter at the same count: one call over the whole chunk, and the
        # parameters without a gradient put back afterwards.
        flat = _flat_grad(chunk)
        params, m, v = [chunk.master], [chunk.exp_avg], [chunk.exp_avg_sq]
        grads = [flat if flat.dtype == torch.float32 else flat.float()]
        steps = [_step_tensor(updated[0].steps if updated else 1, device)]
        restore = [(s.offset, s.offset + s.numel) for s in chunk.slots if not s.got_grad]
    if not params:
        return
    if grad_scale != 1.0:
        torch._foreach_mul_(grads, grad_scale)
    kept = [(a, b, chunk.master[a:b].clone(), chunk.exp_avg[a:b].clone(),
             chunk.exp_avg_sq[a:b].clone()) for a, b in restore]
    torch._fused_adamw_(
        params, grads, m, v, [], steps,
        lr=lr, beta1=betas[0], beta2=betas[1], weight_decay=weight_decay, eps=eps,
        amsgrad=False, maximize=False)
    for a, b, master, exp_avg, exp_avg_sq in kept:
        chunk.master[a:b], chunk.exp_avg[a:b], chunk.exp_avg_sq[a:b] = master, exp_avg, exp_avg_sq
    if not chunk.aliased:
        chunk.payload.copy_(chunk.master)  # parameters in the compute dtype, from the master
    chunk.holds_grads = False


def _step_tensor(count: int, device: torch.device) -> torch.Tensor:
    """The step count as the fused kernel reads it: an fp32 scalar beside the state."""
    return torch.full((), float(count), dtype=torch.float32, device=device)


def restore_params(chunk: Chunk) -> None:
    """Undo what backward did to the payload (a skipped or failed step)."""
    if not chunk.resident and not chunk.aliased:
        if chunk.disk_level:
            chunk.spill.restore_payload(chunk)
        else:
            chunk.payload.copy_(chunk.master)
    chunk.holds_grads = False
    chunk.grad_sq = None


class ChunkAdamW:
    """The step over every chunk: fp16 dynamic loss scaling, optional global-norm clipping,
    then one fused AdamW call per chunk that got gradients."""

    def __init__(self, config: EngineConfig, manager: ChunkManager) -> None:
        self.config = config
        self.manager = manager
        self.loss_scale = config.initial_loss_scale if config.precision == "fp16" else 1.0
        self.good_steps = 0

    def discard(self, chunk: Chunk) -> None:
        """Drop the chunk's gradients and put its parameters back."""
        if chunk.holds_grads:
            restore_params(chunk)
        self.manager.drop_slot_grads(chunk)

    def step(self, chunks: list[Chunk], step: int) -> tuple[bool, float | None]:
        """Update every chunk holding gradients as optimizer step `step` (counted from 1).

        Returns (skipped, grad_norm): fp16 skips the update when a gradient overflowed and
        halves the loss scale; the norm is measured when clipping or loss scaling needs it.
        """
        cfg = self.config
        with_grads = [c for c in chunks if c.holds_grads]
        pipeline = self.manager.update_pipeline(with_grads)
        pipeline.start()  # the first reads from disk overlap the norm
        try:
            scale = 1.0 / self.loss_scale
            grad_norm = None
            if cfg.max_grad_norm is not None or cfg.precision == "fp16":
                grad_norm = global_grad_norm(with_grads) * scale
                if not math.isfinite(grad_norm):
                    pipeline.cancel()
                    for chunk in with_grads:
                        self.discard(chunk)
                    self.loss_scale /= 2.0
                    self.good_steps = 0
                    return True, grad_norm
                if cfg.max_grad_norm is not None and grad_norm > cfg.max_grad_norm:
                    scale *= cfg.max_grad_norm / (grad_norm + 1e-6)
            lr = cfg.lr_at(step)
            for chunk in with_grads:
                pipeline.load(chunk)
                adamw_update(chunk, lr=lr, betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay, grad_scale=scale)
                self.manager.drop_slot_grads(chunk)
                pipeline.store(chunk)
        except BaseException:
            pipeline.cancel()
            raise
        if cfg.precision == "fp16":
            self.good_steps += 1
            if self.good_steps % LOSS_SCALE_GROWTH_INTERVAL == 0:
                self.loss_scale *= 2.0
        return False, grad_norm
