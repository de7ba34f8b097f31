"""GradientArrivals: where each parameter's gradient goes as autograd makes it.

Into the chunk's device gradient buffer (opened by the first to arrive), kept as it is by a
resident chunk and, until they go home, by one whose buffer would only be a second copy
(rules.keeps_grad: the simulated device, a chunk of one parameter), added to what went home
already, or, data parallel, into the buffer that is reduce-scattered once complete. A chunk
whose gradients have started but not finished arriving holds its buffer, or what it kept:
those are the `opening` chunks a trace's working set counts (a whole buffer each).
A tied weight's gradient arrives use by use (engine.step.tied_uses) and is complete with
its last use's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.chunks.chunk import Chunk, Slot
from engine.chunks.manager import ChunkManager
from engine.chunks.state import TensorState
from engine.step.tied_uses import TiedUses

S = TensorState


class GradientArrivals:
    """The StepRunner's gradient hooks: `on_grad` for a parameter's own gradient, and the
    tied uses' through `tied`. `pos()` is the step's current trace position;
    `on_arrival()` hears each gradient before it moves anything."""

    def __init__(self, model: torch.nn.Module, slot_of: dict[int, tuple[Chunk, Slot]],
                 manager: ChunkManager, pos: Callable[[], int],
                 on_arrival: Callable[[], None] = lambda: None) -> None:
        self.slot_of, self.manager, self.pos = slot_of, manager, pos
        self.on_arrival = on_arrival  # before anything moves for a gradient
        self.tied = TiedUses(model, self.on_use_grad)
        # Chunks whose gradients have started but not finished arriving this backward, and
        # their bytes: the gradient buffers a non-resident placement holds (see trace.py).
        self.opening: set[int] = set()
        self.opening_bytes = 0
        self._partial: set[int] = set()  # id(param): its first uses' gradients in, not all

    def reset(self) -> None:
        """A new backward: nothing has arrived yet."""
        self.opening.clear()
        self.opening_bytes = 0
        self.tied.reset()
        self._partial.clear()

    def close(self, chunk: Chunk) -> None:
        """Backward is over: `chunk` opens no more."""
        if chunk.index in self.opening:
            self.opening.discard(chunk.index)
            self.opening_bytes -= chunk.nbytes

    def on_grad(self, param: torch.nn.Parameter) -> None:
        self._take(param, param, last=True)

    def on_use_grad(self, param: torch.nn.Parameter, alias: torch.nn.Parameter) -> None:
        self._take(param, alias, last=not self.tied.pending(param))

    def _take(self, param: torch.nn.Parameter, holder: torch.nn.Parameter, *,
              last: bool) -> None:
        """`holder.grad` is a gradient of `param`: its own, usually complete once a
        backward, or one use's of a tied one (`holder` an alias), complete with the `last`.
        A parameter that autograd accumulates more than once (a module shared by two
        reentrant-checkpointed segments) adds up where its gradient already is, even once
        it has gone home."""
        self.on_arrival()
        chunk, slot = self.slot_of[id(param)]
        m, pos = self.manager, self.pos()
        first = not slot.got_grad
        if first and chunk.index not in self.opening and chunk.grads_pending > 0:
            self.opening.add(chunk.index)
            self.opening_bytes += chunk.nbytes
        grad = holder.grad.reshape(-1)
        if not last and (chunk.sharded or chunk.holds_grads and chunk.payload_on_disk):
            # Where arrivals are counted, a tied parameter's is its last use's.
            m.grad_buffer(chunk, pos)[slot.offset:slot.offset + slot.numel].add_(grad)
        elif chunk.sharded:
            m.add_shard_grad(chunk, slot, grad, pos)
        elif chunk.resident:
            m.keep_slot_grad(chunk, slot, grad, pos)
        elif chunk.holds_grads:
            m.add_late_grad(chunk, slot, grad, pos)
        elif m.keeps_grad(chunk):
            m.keep_slot_grad(chunk, slot, grad, pos)
        else:
            buf = m.grad_buffer(chunk, pos)[slot.offset:slot.offset + slot.numel]
            buf.copy_(grad) if first else buf.add_(grad)
        holder.grad = grad = None  # before the chunk may go home: no copy of it beside
        slot.got_grad = True
        # Not a parameter off the device: a backward that reads none fetches none
        # (engine.step.backward_reads).
        if slot.state in (S.COMPUTE, S.HOLD_AFTER_FWD):
            chunk.set_state(slot, S.HOLD_AFTER_BWD)
        if not last and first:
            self._partial.add(id(param))  # the first of its uses' gradients this step
        if not last or not (first or id(param) in self._partial):
            return
        self._partial.discard(id(param))
        chunk.grads_pending -= 1
        if chunk.grads_pending == 0:
            self.close(chunk)
            if chunk.copy_is_home:
                chunk.holds_grads = True
            else:
                m.finish_grads(chunk)
