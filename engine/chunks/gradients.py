"""Gradients: the device buffers they gather in, and where they go once complete.

A non-resident chunk's gradients gather in a device buffer and go home (to the host, or to
disk through I/O buffers) once every parameter's is in, or, where a buffer would only be a
second copy (rules.keeps_grad: the simulated device, a chunk of one parameter), stay
autograd's tensors until then and go home one by one; a resident chunk keeps autograd's
tensors; a gradient after its chunk's went home (a later micro-batch, a module used twice)
is added where they are. Sharded, complete buffers are handed to the reduction
(engine.chunks.sharding).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.chunks.chunk import Chunk, Slot
from engine.chunks.tiers import ChunkTiers
from engine.placement import rules


class Gradients(ChunkTiers):
    """The manager's gradient side (room is made, and prefetches settled, by DeviceCopies;
    parts on disk are the DiskSide's spill)."""

    def keeps_grad(self, chunk: Chunk) -> bool:
        """Whether non-resident `chunk` keeps autograd's gradients until they go home
        (rules.keeps_grad) rather than a gradient buffer."""
        return rules.keeps_grad(len(chunk.slots), resident=chunk.resident,
                                sharded=chunk.sharded, payload_on_disk=chunk.payload_on_disk,
                                simulated=self.device.simulated)

    def grad_buffer(self, chunk: Chunk, pos: int) -> torch.Tensor:
        self.flight.wait(chunk)
        if chunk.grad is None:
            self.make_room(chunk.nbytes, pos, (chunk,))
            self.grad_bytes += chunk.nbytes
            # Not zeroed: every gradient that arrives overwrites its slot, and finish_grads
            # zeroes what none wrote (a chunk-sized memset per chunk per step, saved).
            chunk.grad = self._buffer(chunk.numel, chunk.dtype)
            if chunk.sharded or chunk.holds_grads:
                # Gradients add up in it (one may come after its chunk was reduced, or
                # after its gradients went to disk), and the padding and unused parameters
                # are zeros in the sum over the ranks (or with what is on disk).
                chunk.grad.zero_()
        return chunk.grad

    def add_shard_grad(self, chunk: Chunk, slot: Slot, grad: torch.Tensor, pos: int) -> None:
        """Sharded: a parameter's gradient into its chunk's (whole, zeroed) device buffer,
        resident or not; the buffer is reduce-scattered once every rank's is complete."""
        buffer = self.grad_buffer(chunk, pos)
        buffer[slot.offset:slot.offset + slot.numel].add_(grad)
        self.sharding.arrived(chunk, slot.offset)

    @property
    def held_grad_bytes(self) -> int:
        """Sharded: gradient buffers complete on this rank that wait for, or are in, their
        reduction (a single process sends them home at once); 0 unsharded."""
        return self.sharding.held_bytes if self.sharding is not None else 0

    def free_grad_buffer(self, buffer: torch.Tensor) -> None:
        """A gradient buffer no chunk points to any more (reduced, or dropped)."""
        self.grad_bytes -= buffer.nbytes
        self._free_buffer(buffer)

    def grad_home(self, chunk: Chunk) -> torch.Tensor:
        """Where a non-resident chunk's gradients land on the host (not one whose payload
        is on disk: its gradients land in I/O buffers, Spill.land_grads, add_grads); in
        fp32 made as the first of them lands, every element written before it is read."""
        self.flight.wait(chunk)
        if not chunk.aliased:
            return chunk.payload
        if chunk.host_grad is None:
            chunk.host_grad = self._alloc("host", chunk.home_numel, torch.float32)
        return chunk.host_grad

    def free_grad_home(self, chunk: Chunk) -> None:
        """The chunk's gradients are spent (updated, or dropped): their landing place goes
        where it exists only for them (rules.grads_land_per_step)."""
        if rules.grads_land_per_step(aliased=chunk.aliased, sharded=chunk.sharded,
                                     disk_tier=self.spill is not None):
            self._free("host", chunk.host_grad)
            chunk.host_grad = None

    def add_late_grad(self, chunk: Chunk, slot: Slot, grad: torch.Tensor, pos: int) -> None:
        """A parameter's gradient after its chunk's went home (a later micro-batch, a module
        run twice): added where they are. On the host, at once. On disk, never brought
        home (the host budget holds at any accumulation): the gradients gather in a device
        buffer as in the first micro-batch, which is added to what the disk holds once
        every parameter of the chunk has its gradient again, or at the end of backward."""
        if not chunk.payload_on_disk:
            self.device.settle_host()  # the gradients sent home may still be in flight
            home = self.grad_home(chunk)[slot.offset:slot.offset + slot.numel]
            home.add_(grad.to(home.device))
            # The gradient came over from the device, as the first micro-batch's did (on the
            # simulated device the add reads it there): counted as they were.
            self.bytes_d2h += grad.nbytes
            return
        self.grad_buffer(chunk, pos)[slot.offset:slot.offset + slot.numel].add_(grad)
        arrived = self._late.setdefault(chunk.index, set())
        if slot.offset in arrived:
            return
        arrived.add(slot.offset)
        if chunk.grads_pending > 0:
            chunk.grads_pending -= 1
            if chunk.grads_pending == 0:
                self.finish_grads(chunk)

    def finish_grads(self, chunk: Chunk) -> None:
        """Every gradient of a non-resident chunk is in: move them to the host. Sharded:
        every gradient this rank computes for the chunk is in (resident or not); it is
        reduced once the ranks agree (engine.chunks.sharding)."""
        if self.sharding is not None:
            self.sharding.ready(chunk)
            return
        if chunk.slot_grads and not chunk.copy_is_home:
            self._send_kept_grad(chunk)
            return
        if chunk.grad is None:
            return
        self.settle(chunk)  # the home may be the payload a prefetch reads
        _zero_unwritten(chunk.grad, chunk, lambda slot: slot.got_grad)
        if chunk.payload_on_disk and chunk.holds_grads:
            self._late.pop(chunk.index, None)
            self.spill.add_grads(chunk, chunk.grad,
                                 lambda home, grads: self._copy(home, grads, "d2h"),
                                 lambda grads, home: self._copy(grads, home, "h2d"))
        elif chunk.payload_on_disk:
            # Into I/O buffers, which go to disk as soon as the bytes are in.
            self.spill.land_grads(chunk, chunk.grad,
                                  lambda home, grads: self._copy(home, grads, "d2h"))
        else:
            # The optimizer reads it after the device settles at the end of backward.
            self._copy(self.grad_home(chunk), chunk.grad, "d2h", host_reads=False)
        chunk.mark_stale()  # the device copy will be outdated by the update
        self.grad_bytes -= chunk.nbytes
        self._free_buffer(chunk.grad)
        chunk.grad = None
        chunk.holds_grads = True

    def _send_kept_grad(self, chunk: Chunk) -> None:
        """A chunk that keeps autograd's gradients (keeps_grad) sends them home one by one,
        what none of them writes (padding, parameters that got none) zeroed beside them: the
        global norm reads every element, and a parameter without a gradient is not moved."""
        self.settle(chunk)  # the home may be the payload a prefetch reads
        home = self.grad_home(chunk)
        for slot, grad in chunk.slot_grads.values():
            self._copy(home[slot.offset:slot.offset + slot.numel], grad, "d2h",
                       host_reads=False)
        _zero_unwritten(home, chunk, lambda slot: slot.offset in chunk.slot_grads)
        self.drop_slot_grads(chunk)
        chunk.mark_stale()  # the device copy will be outdated by the update
        chunk.holds_grads = True

    def keep_slot_grad(self, chunk: Chunk, slot: Slot, grad: torch.Tensor, pos: int) -> None:
        """A resident chunk, or one that keeps its gradients until they go home
        (keeps_grad), keeps autograd's gradient tensor `grad` (flattened) as is: no buffer,
        no copy.

        A resident chunk's room was planned with the residency, but the auto policy may
        have filled it with idle chunks since: those go first. A second gradient for the
        slot adds up."""
        kept = chunk.slot_grads.get(slot.offset)
        if kept is not None:
            kept[1].add_(grad)
            return
        if not self.quiet:
            # In a quiet micro-batch every chunk is resident, which nothing evicts, and the
            # counted one like it made this room: checking it again for every gradient was
            # half a point of a 6-layer OPT's step under cuda (benchmarks/README.md).
            self.make_room(grad.nbytes, pos, (chunk,))
        if not chunk.resident:
            self.device.own(grad)  # its copy home is device -> host
        chunk.slot_grads[slot.offset] = (slot, grad)
        self.device_bytes += grad.nbytes
        self.on_change()

    def drop_slot_grads(self, chunk: Chunk) -> None:
        self.device_bytes -= chunk.kept_grad_bytes
        chunk.slot_grads.clear()
        self.on_change()

    def drop_grad(self, chunk: Chunk) -> None:
        """Free a chunk's device gradient buffer without using it (an aborted step), and
        any reduction still in flight."""
        if self.sharding is not None:
            self.sharding.drop()
        self._late.pop(chunk.index, None)
        if chunk.grad is not None:
            self.grad_bytes -= chunk.nbytes
            self._free_buffer(chunk.grad)
            chunk.grad = None


def _zero_unwritten(grads: torch.Tensor, chunk: Chunk, written: Callable[[Slot], bool]
                    ) -> None:
    """Zero the parts of `grads` (a gradient buffer, or the home they went to) laid out as
    `chunk` that no gradient wrote: padding, and parameters not `written` this step (their
    update is undone, but the global norm reads every element)."""
    end = 0
    for slot in sorted(chunk.slots, key=lambda s: s.offset):
        if slot.offset > end:
            grads[end:slot.offset].zero_()
        if not written(slot):
            grads[slot.offset:slot.offset + slot.numel].zero_()
        end = max(end, slot.offset + slot.numel)
    grads[end:].zero_()
