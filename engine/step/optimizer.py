"""AdamW over whole chunks with fp32 master weights.

PyTorch's fused AdamW kernel, one call per chunk, wherever the chunk's optimizer state lives
(host or device): no per-parameter Python loop, and on this kind of CPU the fused kernel is
~20x faster than the foreach path. The kernel is elementwise, so in fp32 the result is
bit-identical to `torch.optim.AdamW(fused=True)` over the same parameters.

- A host chunk is updated as one flat tensor from its host gradients.
- A resident chunk passes autograd's own gradient tensors (one per parameter, as a list in
  the same single call), so the gradients are never copied.
- A chunk with parts on disk (engine.chunks.spill) is updated a piece at a time in I/O
  buffers: each piece is read while the one before it is updated, and written back while
  the one after it is.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from engine.chunks.chunk import Chunk, Slot, squared_norm
from engine.chunks.manager import ChunkManager
from engine.chunks.update_walk import Span
from engine.config import EngineConfig

LOSS_SCALE_GROWTH_INTERVAL = 2000  # good fp16 steps before the loss scale doubles


def _flat_grad(chunk: Chunk) -> torch.Tensor:
    return chunk.host_grad if chunk.aliased else chunk.payload


def grad_norm_squared(chunk: Chunk) -> float:
    if chunk.copy_is_home:
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
                 weight_decay: float, grad_scale: float = 1.0,
                 spans: Iterable[Span] | None = None, updated: list[Slot] | None = None,
                 scratch: torch.Tensor | None = None) -> None:
    """One AdamW step of the chunk from the gradients backward left it.

    `grad_scale` multiplies the gradients first (loss-scale undo and clipping in one).
    `scratch`: an fp32 buffer of at least the chunk's home elements, where 16-bit
    gradients are read as fp32 (`fp32_grads`).
    Parameters that got no gradient this step keep their weights and moments, as
    torch.optim.AdamW skips parameters whose .grad is None.

    A non-resident chunk is updated span by span: `spans` (engine.chunks.update_walk.Span),
    default the whole chunk from its own tensors; a chunk with parts on disk comes in
    pieces read into I/O buffers. The kernel is elementwise, so that is the same arithmetic.
    `updated`: the parameters that got a gradient (default: as their slots say now; an
    update that overlaps the next step is told, as the next step resets the slots).
    """
    updated = [s for s in chunk.slots if s.got_grad] if updated is None else updated
    for slot in updated:
        slot.steps += 1
    hyper = {"lr": lr, "beta1": betas[0], "beta2": betas[1], "weight_decay": weight_decay,
             "eps": eps}
    if chunk.copy_is_home:
        # One view per parameter, autograd's own gradient tensors: no copy of them.
        picked = [chunk.slot_grads[offset] for offset in sorted(chunk.slot_grads)]
        if not picked:
            return

        def views(flat: torch.Tensor) -> list[torch.Tensor]:
            return [flat[s.offset:s.offset + s.numel] for s, _ in picked]

        _fused(views(chunk.master), fp32_grads([g for _, g in picked], scratch),
               views(chunk.exp_avg), views(chunk.exp_avg_sq), [s.steps for s, _ in picked],
               chunk.master.device, grad_scale, hyper)
        if not chunk.aliased:
            chunk.payload.copy_(chunk.master)
    else:
        # Every updated parameter at the same count: one call over each span, and the
        # parameters without a gradient put back afterwards. Else one view per parameter,
        # each with its own count (a parameter that missed a step is one update behind
        # its neighbours).
        count = updated[0].steps if updated else 1
        uniform = len({s.steps for s in updated}) <= 1
        got = {id(s) for s in updated}
        for span in [Span.whole(chunk)] if spans is None else spans:
            _update_span(chunk, span, got, count if uniform else None, grad_scale, hyper,
                         scratch)
    chunk.holds_grads = False


def _update_span(chunk: Chunk, span: Span, got: set[int], count: int | None,
                 grad_scale: float, hyper: dict, scratch: torch.Tensor | None) -> None:
    """AdamW over elements span.lo..span.hi of a non-resident chunk, for the slots whose
    id is in `got`; `count`: the step count of every one of them, None when they differ."""
    lo, hi = span.lo, span.hi
    cut = [(s, max(s.offset, lo) - lo, min(s.offset + s.numel, hi) - lo)
           for s in chunk.slots if s.offset < hi and s.offset + s.numel > lo]
    device = span.master.device
    if count is None:
        picked = [(s, a, b) for s, a, b in cut if id(s) in got]
        if picked:
            def views(flat: torch.Tensor) -> list[torch.Tensor]:
                return [flat[a:b] for _, a, b in picked]

            _fused(views(span.master), fp32_grads(views(span.grads), scratch),
                   views(span.exp_avg), views(span.exp_avg_sq), [s.steps for s, _, _ in picked],
                   device, grad_scale, hyper)
    else:
        restore = [(a, b) for s, a, b in cut if id(s) not in got]
        kept = [(a, b, span.master[a:b].clone(), span.exp_avg[a:b].clone(),
                 span.exp_avg_sq[a:b].clone()) for a, b in restore]
        _fused([span.master], fp32_grads([span.grads], scratch), [span.exp_avg],
               [span.exp_avg_sq], [count], device, grad_scale, hyper)
        for a, b, master, exp_avg, exp_avg_sq in kept:
            span.master[a:b], span.exp_avg[a:b], span.exp_avg_sq[a:b] = (
                master, exp_avg, exp_avg_sq)
    if span.payload is not None:
        span.payload.copy_(span.master)  # parameters in the compute dtype, from the master


def _fused(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avg: list[torch.Tensor],
           exp_avg_sq: list[torch.Tensor], counts: list[int], device: torch.device,
           grad_scale: float, hyper: dict) -> None:
    """PyTorch's fused AdamW kernel over the given views (fp32 gradients, scaled in place:
    they are used up, or they are `fp32_grads`' copies)."""
    if grad_scale != 1.0:
        torch._foreach_mul_(grads, grad_scale)
    # The kernel only reads the counts: parameters at the same count share one tensor.
    steps = {count: _step_tensor(count, device) for count in set(counts)}
    torch._fused_adamw_(params, grads, exp_avg, exp_avg_sq, [], [steps[c] for c in counts],
                        amsgrad=False, maximize=False, **hyper)


def fp32_grads(grads: list[torch.Tensor], scratch: torch.Tensor | None) -> list[torch.Tensor]:
    """The gradients as the fused kernel takes them, fp32 (it wants the master's dtype):
    fp32 ones as they are; 16-bit ones copied into `scratch` one after another, or without
    one into new tensors. A scratch kept through the update reads every chunk's into the
    same memory: new tensors were new memory at every chunk (a step's whole gradients
    each step, page by page on the simulated device, 0.085 s of opt-125m's bf16 update)."""
    if all(g.dtype == torch.float32 for g in grads):
        return grads
    if scratch is None:
        return [g if g.dtype == torch.float32 else g.float() for g in grads]
    out, at = [], 0
    for g in grads:
        if g.dtype == torch.float32:
            out.append(g)
            continue
        view = scratch[at:at + g.numel()].view(g.shape)
        view.copy_(g)
        out.append(view)
        at += g.numel()
    return out


def update_scratch(chunks: list[Chunk], precision: str, device: torch.device
                   ) -> torch.Tensor | None:
    """The fp32 buffer on `device` that a 16-bit update reads the gradients of `chunks` into
    (`fp32_grads`): as large as the largest one, the one chunk's fp32 gradients the plan
    counts through the update (engine.planning.host_memory: `update`). None in fp32, or
    with no chunk."""
    if precision == "fp32" or not chunks:
        return None
    return torch.empty(max(c.home_numel for c in chunks), dtype=torch.float32, device=device)


def _step_tensor(count: int, device: torch.device) -> torch.Tensor:
    """The step count as the fused kernel reads it: an fp32 scalar beside the state."""
    return torch.full((), float(count), dtype=torch.float32, device=device)


def restore_params(chunk: Chunk) -> None:
    """Undo what backward did to the payload (a skipped or failed step)."""
    if chunk.spill is not None:
        chunk.spill.flight.wait(chunk)  # the last step's update of it may be running still
        if not chunk.holds_grads:
            return
    if not chunk.copy_is_home and not chunk.aliased:
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
        self.manager.free_grad_home(chunk)
        self.manager.drop_slot_grads(chunk)

    def _global_grad_norm(self, chunks: list[Chunk]) -> float:
        """global_grad_norm; data parallel, over every rank's shards (an all-reduce of the
        squared norm, so every rank clips, and skips an fp16 overflow, alike)."""
        sharding = self.manager.sharding
        if sharding is None:
            return global_grad_norm(chunks)
        total = sharding.collectives.sum_floats([sum(grad_norm_squared(c) for c in chunks)])[0]
        return math.sqrt(total) if math.isfinite(total) else total

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
                grad_norm = self._global_grad_norm(with_grads) * scale
                if not math.isfinite(grad_norm):
                    pipeline.cancel()
                    for chunk in with_grads:
                        self.discard(chunk)
                    self.loss_scale /= 2.0
                    self.good_steps = 0
                    return True, grad_norm
                if cfg.max_grad_norm is not None and grad_norm > cfg.max_grad_norm:
                    scale *= cfg.max_grad_norm / (grad_norm + 1e-6)
            hyper = {"lr": cfg.lr_at(step), "betas": cfg.betas, "eps": cfg.eps,
                     "weight_decay": cfg.weight_decay, "grad_scale": scale}
            on_device = [c for c in with_grads if c.copy_is_home]
            scratch = (update_scratch(on_device, cfg.precision, on_device[0].master.device)
                       if on_device else None)
            for chunk in on_device:  # now
                adamw_update(chunk, **hyper, scratch=scratch)
                self.manager.drop_slot_grads(chunk)
            del scratch  # freed before the host's is made: one at a time, as the plan counts
        except BaseException:
            pipeline.cancel()
            raise
        # Host chunks in one walk: in a thread of its own that overlaps the next step's
        # forward when their state is on disk (engine.chunks.flight), else right here.
        on_host = [(c, [s for s in c.slots if s.got_grad]) for c in with_grads
                   if not c.copy_is_home]

        def walk(done: Callable[[Chunk], None]) -> None:
            scratch = update_scratch([c for c, _ in on_host], cfg.precision,
                                     torch.device("cpu"))
            try:
                for chunk, updated in on_host:
                    adamw_update(chunk, **hyper, spans=pipeline.spans(chunk), updated=updated,
                                 scratch=scratch)
                    self.manager.free_grad_home(chunk)
                    done(chunk)
            except BaseException:
                pipeline.cancel()
                raise

        if self.manager.overlap_update():
            self.manager.flight.run([c for c, _ in on_host], walk)
        else:
            walk(lambda chunk: None)
        if cfg.precision == "fp16":
            self.good_steps += 1
            if self.good_steps % LOSS_SCALE_GROWTH_INTERVAL == 0:
                self.loss_scale *= 2.0
        return False, grad_norm
