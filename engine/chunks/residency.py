"""Residency: which chunks live on the device, payload and optimizer state, and moving them.

The cuda policy and the margin choose the resident set (engine.placement.rules); this
carries it out, leavers first so that their bytes make room for joiners, with the disk
tier's parts moved in an order that keeps the host within its budget.
"""

from __future__ import annotations

import torch

from engine.chunks.chunk import Chunk, DeviceCopy
from engine.chunks.state import TensorState
from engine.chunks.tiers import ChunkTiers
from engine.placement import rules

S = TensorState


class Residency(ChunkTiers):
    """The manager's resident set (copies released by DeviceCopies, parts on disk moved
    by the DiskSide's spill)."""

    def set_resident(self, chunk: Chunk, resident: bool) -> None:
        """Move a chunk's payload and optimizer state to the device, or back to the host."""
        if chunk.resident == resident:
            return
        self.settle(chunk)
        if chunk.sharded:
            self._move_shard(chunk, "device" if resident else "host")
            chunk.resident = resident
            return
        if chunk.frozen:
            self._place_frozen(chunk, resident)
            return
        if resident:
            fresh = chunk.copy == DeviceCopy.FRESH
            if not chunk.on_device:
                self._storage_resize(chunk, True)
            if not fresh:
                self._copy(chunk.device_payload, chunk.payload, "h2d")
            self._free("host", chunk.payload)
            if chunk.aliased:
                chunk.master = chunk.device_payload
                self._free("host", chunk.host_grad)
                chunk.host_grad = None
            else:
                chunk.master = self._move(chunk.master, "device")
            chunk.payload = chunk.device_payload
            chunk.exp_avg = self._move(chunk.exp_avg, "device")
            chunk.exp_avg_sq = self._move(chunk.exp_avg_sq, "device")
            chunk.set_copy(DeviceCopy.FRESH)
            chunk.resident = True
            for slot in chunk.slots:
                if slot.state == S.FREE:
                    chunk.set_state(slot, S.HOLD)
        else:
            host = self._alloc("host", chunk.numel, chunk.dtype)
            self._copy(host, chunk.device_payload, "d2h")
            chunk.payload = host
            if chunk.aliased:
                chunk.master = host
            else:
                chunk.master = self._move(chunk.master, "host")
            chunk.exp_avg = self._move(chunk.exp_avg, "host")
            chunk.exp_avg_sq = self._move(chunk.exp_avg_sq, "host")
            chunk.resident = False
            self.release(chunk)

    def _place_frozen(self, chunk: Chunk, resident: bool) -> None:
        """A frozen chunk's payload, its only part, to the device or back to the host."""
        if resident:
            if not chunk.on_device:
                self._storage_resize(chunk, True)
                self._copy(chunk.device_payload, chunk.payload, "h2d")
            self._free("host", chunk.payload)
            chunk.payload = chunk.device_payload
            chunk.set_copy(DeviceCopy.FRESH)
            for slot in chunk.slots:
                if slot.state == S.FREE:
                    chunk.set_state(slot, S.HOLD)
        else:
            chunk.payload = self._alloc("host", chunk.numel, chunk.dtype)
            self._copy(chunk.payload, chunk.device_payload, "d2h")
        chunk.master = chunk.payload if chunk.aliased else None
        chunk.resident = resident
        if not resident:
            self.release(chunk)

    def thaw(self, chunk: Chunk) -> None:
        """A frozen chunk one of whose parameters now needs a gradient (gradual unfreezing):
        it gets the fp32 master and moments of any chunk (sharded, the gradients' landing
        place too), on the host, its payload brought there first (the next placement puts
        it where it goes)."""
        self.flight.wait()
        if chunk.resident:
            self.set_resident(chunk, False)
        if chunk.disk_level:
            self.spill.move(chunk, 0)
        self.settle(chunk)
        home = chunk.home_numel
        if chunk.aliased:
            chunk.master = chunk.payload
            if chunk.sharded:  # else made as the gradients land (Gradients.grad_home)
                chunk.host_grad = self._alloc("host", home, torch.float32)
        else:
            chunk.master = self._alloc("host", home, torch.float32)
            chunk.master.copy_(chunk.payload)
        chunk.exp_avg = self._alloc("host", home, torch.float32, zero=True)
        chunk.exp_avg_sq = self._alloc("host", home, torch.float32, zero=True)
        chunk.frozen = False

    def _move_shard(self, chunk: Chunk, to: str) -> None:
        """A sharded chunk's home tensors (its shard: payload, master, moments, gradient
        landing place) to `to`; the gathered copy is another matter (placement's)."""
        if chunk.frozen:
            chunk.payload = self._move(chunk.payload, to)
            chunk.master = chunk.payload if chunk.aliased else None
            return
        if chunk.aliased:
            chunk.master = chunk.payload = self._move(chunk.master, to)
            # Between steps its contents are spent: a new one, not a copy.
            self._free("host" if to == "device" else "device", chunk.host_grad)
            chunk.host_grad = self._alloc(to, chunk.home_numel, torch.float32)
        else:
            chunk.master = self._move(chunk.master, to)
            chunk.payload = self._move(chunk.payload, to)
        chunk.exp_avg = self._move(chunk.exp_avg, to)
        chunk.exp_avg_sq = self._move(chunk.exp_avg_sq, to)

    def resident_cost(self, chunk: Chunk) -> int:
        """Device bytes a chunk needs to be resident (rules.resident_cost); sharded, its
        shard's (its gathered copy comes and goes as a non-resident chunk's does)."""
        return rules.resident_cost(chunk.home_numel, chunk.itemsize, frozen=chunk.frozen)

    def apply_residency(self, want: set[int]) -> None:
        """Move chunks to match `want`: leavers first, so their bytes make room for joiners.

        Under a host budget, the parts of the other chunks go where the disk placement for
        `want` puts them, in an order that keeps the host within the budget but for one
        chunk at a time: what goes (further) to disk first, each leaver as it lands on the
        host, then the joiners (through the host), then what comes back from disk."""
        self.flight.wait()
        placement = self.budget_placement(want)
        if placement is not None:
            self.spill.prepare(placement)
            for chunk in self.chunks:
                level = placement.level(chunk.index)
                if not chunk.resident and chunk.index not in want and level > chunk.disk_level:
                    self.spill.move(chunk, level)
        for chunk in self.chunks:
            if chunk.resident and chunk.index not in want:
                self.set_resident(chunk, False)
                if placement is not None:
                    self.spill.move(chunk, placement.level(chunk.index))
        self.release_all()
        # A new resident set (a new trace, new settings): the buffers kept for the old
        # placement's copies are of sizes and numbers it may not use again. Kept buffers
        # are free device memory, which the activations take at their peak: the buffers
        # get the rest, so that the device's bytes stay within its budget as a GPU's do.
        trace = self.trace
        self.device.trim(None if trace is None
                         else max(0, self.device.capacity() - trace.non_model_peak))
        for chunk in self.chunks:
            if chunk.index in want:
                if chunk.disk_level:
                    self.spill.move(chunk, 0)
                self.set_resident(chunk, True)
        if placement is not None:
            self.restore_disk_placement(placement)
        self.transfer_seconds += self.device.settle_host()
