"""ChunkManager: where every chunk's bytes are, and moving them.

Byte accounting is exact: every tensor a chunk allocates or frees goes through `_alloc` /
`_free`, so `device_bytes` and `host_bytes` are counted, never estimated.

The decisions (what to evict, what to release, what to prefetch, what stays resident, what
goes to disk under a host budget) are engine.placement.rules'; this module only carries them
out on tensors, with engine.chunks.spill for the parts on disk. The planner's replay carries
out the same rules on counters.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from engine.chunks import scratch_space
from engine.chunks import spill as disk
from engine.chunks.chunk import Chunk, DeviceCopy, Slot
from engine.chunks.flight import UpdateInFlight
from engine.chunks.sharding import ShardedChunks
from engine.chunks.state import TensorState
from engine.chunks.update_walk import NoDisk, UpdatePipeline
from engine.config import format_size
from engine.devices.device import ComputeDevice, DeviceOutOfMemory
from engine.devices.disk import ALIGN, DiskTierError, space_needed
from engine.distributed.collectives import CollectiveError, Collectives
from engine.placement import rules
from engine.placement.policy import Policy
from engine.placement.trace import Trace

S = TensorState


class ChunkManager:
    def __init__(self, chunks: list[Chunk], device: ComputeDevice, *,
                 non_model_now: Callable[[], int], on_change: Callable[[], None]) -> None:
        self.chunks = chunks
        self.device = device
        self.policy = Policy.AUTO
        self.rules = rules.rules_for(self.policy)
        self.trace: Trace | None = None  # the warm-up trace the rules forecast from
        self.non_model_now = non_model_now
        self.on_change = on_change
        self.device_bytes = 0
        self.host_bytes = 0
        self.grad_bytes = 0  # device gradient buffers alive now
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.transfer_seconds = 0.0
        self.strict = True  # raise when room cannot be made; off while tracing
        self.overrun = 0  # most bytes over capacity seen while not strict
        self._last_use: dict[int, int] = {}  # chunk -> position of its latest use (LRU)
        self.host_budget: int | None = None  # chunk bytes + I/O buffers on the host
        self.disk_piece = rules.DISK_PIECE  # elements per piece of disk I/O
        self.spill: disk.Spill | None = None  # the disk tier, when the host budget needs it
        self._disk_base = (0, 0, 0.0)  # the tier's counters when a step last reported
        self.flight = UpdateInFlight()  # the last step's update, while the next forward runs
        # Chunk -> the parameters (offsets) whose late gradients (add_late_grad) its device
        # buffer holds, while that buffer gathers them.
        self._late: dict[int, set[int]] = {}
        self.sharding: ShardedChunks | None = None  # data parallel: gathers and reductions

    def use_sharding(self, collectives: Collectives) -> None:
        """Data parallel: the chunks are sharded (packing.build_chunks with `ranks`), and
        gathers and gradient reductions go through `collectives` (engine.chunks.sharding).
        Under a host budget the disk tier holds parts of this rank's shards."""
        self.sharding = ShardedChunks(self, collectives)

    # --- the step's frame -------------------------------------------------------------

    def set_policy(self, policy: Policy) -> None:
        self.policy = policy
        self.rules = rules.rules_for(policy)

    def reset_counters(self) -> None:
        """Zero the step's copy counters: at the step's start, before any pending change
        moves a byte, so that the step reports every copy made for it."""
        self.bytes_h2d = self.bytes_d2h = 0
        self.transfer_seconds = 0.0

    def begin_step(self, *, tracing: bool) -> None:
        """A traced step has no forecast to trust yet: room that cannot be made is noted as
        an overrun rather than raised."""
        self.rules = rules.rules_for(self.policy, tracing=tracing)
        if tracing:
            self.strict = False
            self.overrun = 0
        if self.sharding is not None:
            self.sharding.begin()

    def end_step(self) -> None:
        self.strict = True
        self.rules = rules.rules_for(self.policy)

    def end_backward(self) -> None:
        """Every gradient of this backward is in. Sharded: reduce what is still waiting."""
        if self.sharding is not None:
            self.sharding.finish()

    def use_trace(self, trace: Trace | None) -> None:
        """Forecast from `trace`. Data parallel: every rank forecasts from the same numbers
        (each point's peaks and the overrun, the largest any rank measured), so that they
        all place alike."""
        if trace is not None and self.sharding is not None:
            self.overrun = self.sharding.agree_trace(trace, self.overrun)
        self.trace = trace

    # --- accounting -------------------------------------------------------------------

    def count_host(self, chunks: list[Chunk]) -> None:
        """Take the host bytes of freshly packed chunks into the count (each tensor once:
        in fp32 the payload is the master)."""
        tensors = {id(t): t for c in chunks
                   for t in (c.payload, c.master, c.exp_avg, c.exp_avg_sq, c.host_grad)
                   if t is not None}
        self.host_bytes += sum(t.nbytes for t in tensors.values())
        self.on_change()

    def _alloc(self, where: str, numel: int, dtype: torch.dtype, zero: bool = False
               ) -> torch.Tensor:
        if where == "device":
            t = self.device.empty(numel, dtype)
            self.device_bytes += t.nbytes
        else:
            t = self.device.host_empty(numel, dtype)
            self.host_bytes += t.nbytes
        if zero:
            t.zero_()
        self.on_change()
        return t

    def _free(self, where: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        if where == "device":
            self.device_bytes -= t.nbytes
        else:
            self.host_bytes -= t.nbytes
        self.on_change()

    def drop_grad(self, chunk: Chunk) -> None:
        """Free a chunk's device gradient buffer without using it (an aborted step), and
        any reduction still in flight."""
        if self.sharding is not None:
            self.sharding.drop()
        self._late.pop(chunk.index, None)
        if chunk.grad is not None:
            self.grad_bytes -= chunk.nbytes
            self._free("device", chunk.grad)
            chunk.grad = None

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str, *,
              host_reads: bool = True) -> None:
        """Copy between the tiers. `host_reads=False`: nothing on the host reads `dst` until
        the device settles it (ComputeDevice.settle_host), so the host need not wait."""
        self.transfer_seconds += self.device.copy(dst, src, host_reads=host_reads)
        if direction == "h2d":
            self.bytes_h2d += src.nbytes
        elif direction == "d2h":
            self.bytes_d2h += src.nbytes

    def _move(self, t: torch.Tensor, to: str) -> torch.Tensor:
        """A real move: copy to the other location, free the source."""
        src = "host" if to == "device" else "device"
        dst = self._alloc(to, t.numel(), t.dtype)
        self._copy(dst, t, "h2d" if to == "device" else "d2h")
        self._free(src, t)
        return dst

    # --- the device payload -------------------------------------------------------------

    def _storage_resize(self, chunk: Chunk, on: bool) -> None:
        storage = chunk.device_payload.untyped_storage()
        storage.resize_(chunk.nbytes if on else 0)
        chunk.set_copy(DeviceCopy.FRESH if on else DeviceCopy.ABSENT)
        self.device_bytes += chunk.nbytes if on else -chunk.nbytes
        self.on_change()

    def materialise(self, chunk: Chunk, pos: int, protect: tuple[Chunk, ...] = (),
                    gather: bool = False) -> None:
        """Make sure the chunk's parameters are on the device (HOLD or better).

        Sharded: the whole chunk is gathered when the ranks agreed to (`gather`), which
        they do whenever any of them lacks it (engine.chunks.sharding); a fresh copy is
        gathered again then, its bytes unchanged."""
        self.flight.wait(chunk)  # its update from the last step, if that is still running
        self._last_use[chunk.index] = pos
        self.settle(chunk)
        if chunk.on_device and not chunk.stale and not gather:
            return
        if not chunk.on_device:
            self.make_room(chunk.nbytes, pos, protect + (chunk,))
            self._storage_resize(chunk, True)
        # A payload that holds gradients (every trainable parameter's is in, and a frozen
        # one is still to be used) has the weights in the master only.
        master = chunk.holds_grads and not chunk.aliased
        if chunk.sharded:
            self._own_shard(chunk)
            self.sharding.gather(chunk)
        elif chunk.payload_on_disk or (master and chunk.state_on_disk):
            for source, lo, hi in self.spill.fetch(chunk):
                self._copy(chunk.device_payload[lo:hi], source, "h2d")
        else:
            self._copy(chunk.device_payload, chunk.master if master else chunk.payload, "h2d")
        self._fetched(chunk)

    def _own_shard(self, chunk: Chunk) -> None:
        """A sharded chunk's own shard into its place in the device payload, before a
        gather (from the fp32 master once the payload holds gradients), read from disk
        piece by piece where it is there."""
        self.flight.wait(chunk)  # its update from the last step, if that is still running
        master = chunk.holds_grads and not chunk.aliased
        own = chunk.device_payload[chunk.shard.lo:chunk.shard.hi]
        if chunk.payload_on_disk or (master and chunk.state_on_disk):
            for source, lo, hi in self.spill.fetch(chunk):
                self._copy(own[lo:hi], source, "h2d")
            return
        self._copy(own, chunk.master if master else chunk.payload,
                   "" if chunk.resident else "h2d")

    def _fetched(self, chunk: Chunk) -> None:
        chunk.set_copy(DeviceCopy.FRESH)
        for slot in chunk.slots:
            if slot.state == S.FREE:
                chunk.set_state(slot, S.HOLD)

    def settle(self, chunk: Chunk) -> None:
        """Let the compute stream wait for the chunk's prefetch, if one is in flight
        (sharded: its gather ahead of use)."""
        if chunk.pending is not None:
            self.device.wait(chunk.pending)
            chunk.pending = None
        if self.sharding is not None:
            self.sharding.settle(chunk)

    def prefetch(self, pos: int, phase: str) -> None:
        """Start copying the next module's chunks while this one computes (on CUDA the copy
        runs on a side stream).

        Only into room that is free now and stays free until the next module by the trace's
        forecast (its non-model peak, and in backward the gradient buffers this module may
        open): a prefetch never evicts, so it moves no byte the step would not move anyway.
        Not while tracing, when there is no forecast to trust.
        """
        trace = self.trace
        if trace is None or not self.strict or pos + 1 >= len(trace.points):
            return
        opening = 0
        if phase == "backward":
            opening = sum(c.nbytes for i in trace.points[pos].chunks
                          if (c := self.chunks[i]).grad is None and not c.resident
                          and c.grads_pending > 0)
        forecast = rules.prefetch_forecast(trace, pos, self.non_model_now(), opening)
        # A stale device copy is one whose gradients went home: not used again this step.
        # A payload on disk only once its read ahead is done: a prefetch never waits.
        chosen = rules.prefetches(
            trace.points[pos + 1].chunks, free=self.free_bytes(forecast),
            skip=lambda i: (self.chunks[i].on_device or self.chunks[i].holds_grads
                            or self.flight.pending(i)
                            or (self.chunks[i].payload_on_disk and not self.spill.ready(i))),
            nbytes=lambda i: self.chunks[i].nbytes)
        for index in chosen:
            chunk = self.chunks[index]
            self._storage_resize(chunk, True)
            if chunk.payload_on_disk:
                # Piece by piece on one stream: the last one's event covers them all.
                for source, lo, hi in self.spill.fetch(chunk):
                    chunk.pending, seconds = self.device.copy_ahead(
                        chunk.device_payload[lo:hi], source)
                    self.transfer_seconds += seconds
            else:
                chunk.pending, seconds = self.device.copy_ahead(chunk.device_payload,
                                                                chunk.payload)
                self.transfer_seconds += seconds
            self.bytes_h2d += chunk.nbytes
            self._fetched(chunk)

    def release(self, chunk: Chunk) -> bool:
        """Drop the device copy of an idle, non-resident chunk. Returns whether it did."""
        if chunk.copy_is_home or not chunk.on_device or chunk.in_use():
            return False
        self.settle(chunk)
        self._storage_resize(chunk, False)
        for slot in chunk.slots:
            if slot.state != S.FREE:
                if slot.state != S.HOLD:
                    chunk.set_state(slot, S.HOLD)
                chunk.set_state(slot, S.FREE)
        return True

    def release_all(self) -> None:
        for chunk in self.chunks:
            self.release(chunk)
        if self.spill is not None:
            self.spill.cancel_read_ahead()

    def free_bytes(self, extra_non_model: int = 0) -> int:
        return self.device.capacity() - self.device_bytes - self.non_model_now() - extra_non_model

    def make_room(self, nbytes: int, pos: int, protect: tuple[Chunk, ...] = ()) -> None:
        """Evict idle chunks (rules.evictions) until `nbytes` and the forecast fit."""
        forecast = self.rules.forecast(self.trace, pos, self.non_model_now())
        free = self.free_bytes(forecast)
        idle = [c.index for c in self.chunks if c.on_device and not c.copy_is_home
                and not c.in_use() and c not in protect]
        victims, short = rules.evictions(nbytes, free, idle, lambda i: self.chunks[i].nbytes,
                                         pos=pos, trace=self.trace, last_use=self._last_use)
        for index in victims:
            self.release(self.chunks[index])
        if short:
            if self.strict:
                raise DeviceOutOfMemory(
                    f"the device ({format_size(self.device.capacity())}) cannot hold "
                    f"{format_size(nbytes)} more: {format_size(self.device_bytes)} of "
                    f"model data and {format_size(self.non_model_now())} of activations "
                    f"are in use, {format_size(short)} short")
            self.overrun = max(self.overrun, short)

    def prepare(self, needed: tuple[Chunk, ...], pos: int, phase: str = "") -> None:
        """Bring `needed` to the device for the module about to run."""
        if phase == "backward":
            self.flight.wait()  # gradients come home to chunks the last update is done with
        on_device = [c.index for c in self.chunks if c.on_device]
        for index in self.rules.release_before_use(on_device, [c.index for c in needed]):
            self.release(self.chunks[index])
        if self.sharding is not None:
            # Gathers at agreed points only: the boundary's agreement decides those for
            # this module and those ahead of the next (engine.chunks.sharding).
            offer = self._gather_offer(needed, pos, phase) if phase else []
            gather, ahead = self.sharding.boundary(needed, offer, phase)
            for chunk in needed:
                self.materialise(chunk, pos, needed, gather=chunk.index in gather)
            for index in ahead:
                self._gather_ahead(self.chunks[index])
            return
        for chunk in needed:
            self.materialise(chunk, pos, needed)
        if phase:
            self.prefetch(pos, phase)
            self.read_ahead(pos)

    def _gather_offer(self, needed: tuple[Chunk, ...], pos: int, phase: str) -> list[int]:
        """Sharded: the next module's chunks this rank can have gathered ahead of use
        (rules.gathers_ahead), decided at the boundary, before `needed` come in. The room
        is `prefetch`'s (free now, and by the trace's forecast until the next module; every
        chunk's gradients open a buffer here, resident or not) less what `needed` still
        take: room no eviction made. Not while tracing."""
        trace = self.trace
        if trace is None or not self.strict or pos + 1 >= len(trace.points):
            return []
        opening = 0
        if phase == "backward":
            opening = sum(c.nbytes for i in trace.points[pos].chunks
                          if (c := self.chunks[i]).grad is None and c.grads_pending > 0)
        forecast = rules.prefetch_forecast(trace, pos, self.non_model_now(), opening)
        coming = sum(c.nbytes for c in needed if not c.on_device)
        running = {c.index for c in needed}
        return rules.gathers_ahead(
            (i for i in trace.points[pos + 1].chunks if i not in running),
            # As `prefetch`'s, a gather ahead never waits: not for an update in flight, nor
            # for a shard on disk that is not read ahead yet.
            skip=lambda i: (self.chunks[i].holds_grads or self.sharding.reducing(i)
                            or self.flight.pending(i)
                            or (self.chunks[i].payload_on_disk and not self.spill.ready(i))),
            on_device=lambda i: self.chunks[i].on_device,
            free=self.free_bytes(forecast) - coming, nbytes=lambda i: self.chunks[i].nbytes)

    def _gather_ahead(self, chunk: Chunk) -> None:
        """Start gathering a chunk the ranks agreed to gather ahead of use, into room this
        rank offered (or its own device copy)."""
        if not chunk.on_device:
            self._storage_resize(chunk, True)
        self._own_shard(chunk)
        self.sharding.start_gather(chunk)
        self._fetched(chunk)

    def prepare_outside_step(self, needed: tuple[Chunk, ...]) -> None:
        """Bring `needed` to the device for a forward outside a training step (evaluation),
        whatever the policy: copied in right before use, dropped right after, as cpu does,
        so that evaluation needs no more device memory than the smallest step."""
        on_device = [c.index for c in self.chunks if c.on_device]
        for index in rules.CpuRules.release_before_use(on_device, [c.index for c in needed]):
            self.release(self.chunks[index])
        gather = self.sharding.boundary(needed, [])[0] if self.sharding is not None else set()
        for chunk in needed:
            self.materialise(chunk, -1, needed, gather=chunk.index in gather)

    # --- gradients ------------------------------------------------------------------------

    def grad_buffer(self, chunk: Chunk, pos: int) -> torch.Tensor:
        self.flight.wait(chunk)
        if chunk.grad is None:
            self.make_room(chunk.nbytes, pos, (chunk,))
            self.grad_bytes += chunk.nbytes
            # Not zeroed: every gradient that arrives overwrites its slot, and finish_grads
            # zeroes what none wrote (a chunk-sized memset per chunk per step, saved).
            chunk.grad = self._alloc("device", chunk.numel, chunk.dtype)
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
        self._free("device", buffer)

    def grad_home(self, chunk: Chunk) -> torch.Tensor:
        """Where a non-resident chunk's gradients land on the host (not one whose payload
        is on disk: its gradients land in I/O buffers, Spill.land_grads, add_grads)."""
        self.flight.wait(chunk)
        return chunk.host_grad if chunk.aliased else chunk.payload

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
        if chunk.grad is None:
            return
        self.settle(chunk)  # the home may be the payload a prefetch reads
        _zero_unwritten(chunk)
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
        self._free("device", chunk.grad)
        chunk.grad = None
        chunk.holds_grads = True

    def keep_slot_grad(self, chunk: Chunk, slot: Slot, grad: torch.Tensor, pos: int) -> None:
        """A resident chunk keeps autograd's gradient tensor as is: no buffer, no copy.

        Its room was planned with the residency, but the auto policy may have filled it
        with idle chunks since: those go first. A second gradient for the slot adds up."""
        if slot.offset in chunk.slot_grads:
            chunk.slot_grads[slot.offset][1].add_(grad.reshape(-1))
            return
        self.make_room(grad.nbytes, pos, (chunk,))
        chunk.slot_grads[slot.offset] = (slot, grad.reshape(-1))
        self.device_bytes += grad.nbytes
        self.on_change()

    def drop_slot_grads(self, chunk: Chunk) -> None:
        self.device_bytes -= sum(g.nbytes for _, g in chunk.slot_grads.values())
        chunk.slot_grads.clear()
        self.on_change()

    # --- residency (cuda policy and the margin) -----------------------------------------------

    def set_resident(self, chunk: Chunk, resident: bool) -> None:
        """Move a chunk's payload and optimizer state to the device, or back to the host."""
        if chunk.resident == resident:
            return
        self.settle(chunk)
        if chunk.sharded:
            self._move_shard(chunk, "device" if resident else "host")
            chunk.resident = resident
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
                chunk.host_grad = self._alloc("host", chunk.numel, chunk.dtype)
            else:
                chunk.master = self._move(chunk.master, "host")
            chunk.exp_avg = self._move(chunk.exp_avg, "host")
            chunk.exp_avg_sq = self._move(chunk.exp_avg_sq, "host")
            chunk.resident = False
            self.release(chunk)

    def _move_shard(self, chunk: Chunk, to: str) -> None:
        """A sharded chunk's home tensors (its shard: payload, master, moments, gradient
        landing place) to `to`; the gathered copy is another matter (placement's)."""
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
        return rules.resident_cost(chunk.home_numel, chunk.itemsize)

    def apply_residency(self, want: set[int]) -> None:
        """Move chunks to match `want`: leavers first, so their bytes make room for joiners.

        Under a host budget, the parts of the other chunks go where the disk placement for
        `want` puts them, in an order that keeps the host within the budget but for one
        chunk at a time: what goes (further) to disk first, each leaver as it lands on the
        host, then the joiners (through the host), then what comes back from disk."""
        self.flight.wait()
        placement = self.disk_placement(want) if self.spill is not None else None
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
        for chunk in self.chunks:
            if chunk.index in want:
                if chunk.disk_level:
                    self.spill.move(chunk, 0)
                self.set_resident(chunk, True)
        if placement is not None:
            self.restore_disk_placement(placement)
        self.transfer_seconds += self.device.settle_host()

    # --- the disk tier (engine.chunks.spill) ---------------------------------------------------

    def use_host_budget(self, host_budget: int, disk_dir: Path,
                        fill: Callable[[Chunk], None] | None = None) -> None:
        """Keep the chunk bytes on the host, with the disk tier's I/O buffers, within
        `host_budget`; what does not fit goes to a scratch folder of its own under
        `disk_dir`, made now if any placement could need it (all chunks on the host).

        `fill`: the chunks are still empty (packing.build_chunks(filled=False)); fill each
        with it, last used first, and send its parts where the budget says before the next
        is filled, so that the host never holds the whole model's state at once.

        Raises ValueError (rules.HostBudgetTooSmall, ScratchTooSmall, or naming a folder
        that cannot be written) before anything moves. Sharded, the budget is this rank's,
        for its shards."""
        self.host_budget = host_budget
        self.disk_piece = rules.disk_piece([c.home_numel for c in self.chunks],
                                           self.chunks[0].itemsize if self.chunks else 4,
                                           host_budget=host_budget, block=ALIGN)
        worst = self.disk_placement(set())
        if worst.state:
            self.spill = scratch_space.open_spill(
                self.chunks, disk_dir=disk_dir, need=worst.disk_bytes, piece=self.disk_piece,
                flight=self.flight, empty=self.device.host_empty,
                alloc=lambda numel, dtype: self._alloc("host", numel, dtype),
                free=lambda t: self._free("host", t))
        if fill is None:
            return
        if self.spill is not None:
            self.spill.settle(worst)  # the buffers that carry the parts there
        # Last used first: those are the chunks the placement sends to disk, so the model's
        # own parameters shrink while the parts the host keeps have not yet grown.
        for chunk in reversed(self.chunks):
            fill(chunk)
            self.count_host([chunk])
            if self.spill is not None and worst.level(chunk.index):
                try:
                    self.spill.move(chunk, worst.level(chunk.index))
                except DiskTierError as e:
                    # Filled by someone else since the check: still a folder too small.
                    parent = self.spill.tier.folder.parent
                    self.spill.close()
                    self.spill = None
                    if e.errno != errno.ENOSPC:
                        raise
                    raise scratch_space.too_small(parent, space_needed(worst.disk_bytes),
                                                  scratch_space.free_space(parent)) from None

    def disk_placement(self, resident: set[int]) -> rules.DiskPlacement:
        """rules.disk_placement for the chunks not in `resident`."""
        return rules.disk_placement(
            [rules.disk_cost(c.home_numel, c.itemsize, ALIGN, self.disk_piece)
             for c in self.chunks],
            on_host=[c.index for c in self.chunks if c.index not in resident],
            host_budget=self.host_budget, block=ALIGN)

    def restore_disk_placement(self, placement: rules.DiskPlacement | None = None) -> None:
        """Put every non-resident chunk's parts where `placement` (default: the one in
        force) says, e.g. after gradients brought a payload home for a step."""
        if self.spill is None:
            return
        placement = placement or self.spill.placement
        moving = [c for c in self.chunks
                  if not c.resident and placement.level(c.index) != c.disk_level]
        if not moving and placement == self.spill.placement:
            return  # nothing to do: the disk tier is left alone (an update may be using it)
        self.flight.wait()
        for chunk in moving:
            self.spill.move(chunk, placement.level(chunk.index))
        self.spill.settle(placement)

    def read_ahead(self, pos: int) -> None:
        """Start reading from disk, into idle buffers: the payloads of the next chunks to
        be fetched (trace order; not while tracing, when there is no order to trust), and
        the state the update will need first."""
        if self.spill is None or self.flight.active:
            return  # a running update has the disk tier to itself
        if self.trace is not None and self.strict:
            upcoming = itertools.chain.from_iterable(
                p.chunks for p in itertools.islice(self.trace.points, pos + 1, None))
            self.spill.read_ahead(upcoming, skip=lambda i: self.chunks[i].on_device)
        self.spill.read_ahead_state()

    def overlap_update(self) -> bool:
        """Whether the update of host chunks may overlap the next step's forward
        (engine.chunks.flight): when it is bound by the disk, with optimizer state there,
        and the forward needs nothing of the disk tier (no payload there)."""
        return (self.spill is not None and bool(self.spill.placement.state)
                and not self.spill.placement.payload)

    def update_pipeline(self, chunks: list[Chunk]) -> UpdatePipeline | NoDisk:
        """The optimizer's walk over `chunks` (update_walk.Span by span), reading and
        writing their parts on disk."""
        return UpdatePipeline(self.spill, chunks) if self.spill is not None else NoDisk()

    @contextlib.contextmanager
    def opened(self, chunk: Chunk, *, write: bool = False,
               master_only: bool = False) -> Iterator[None]:
        """The chunk's tensors all readable (parts on disk read into buffers) in the block;
        `write`: what the block changed in them goes back to disk; `master_only`: only the
        fp32 master need be readable (fp32 reads no moments, bf16/fp16 no payload)."""
        if self.spill is None or not chunk.disk_level:
            yield
            return
        regions = (disk.STATE, disk.PAYLOAD) if write else ()
        read = (disk.master_region(chunk),) if master_only else None
        with self.spill.opened(chunk, write=regions, read=read):
            yield

    def flush_disk(self) -> None:
        """Wait for every write the disk tier has issued."""
        if self.spill is not None:
            self.spill.tier.flush()

    def retry_disk(self) -> None:
        """Write again what a failed write left held in memory (DiskTierError if it fails)."""
        if self.spill is not None:
            self.spill.tier.retry_failed()

    def disk_errors(self) -> list[OSError]:
        """Writes that failed since the last call."""
        return self.spill.tier.take_errors() if self.spill is not None else []

    @property
    def disk_bytes(self) -> int:
        return self.spill.disk_bytes if self.spill is not None else 0

    @property
    def io_buffer_bytes(self) -> int:
        return self.spill.tier.buffer_bytes if self.spill is not None else 0

    def disk_counters(self) -> tuple[int, int, float]:
        """(bytes read, bytes written, seconds waited) by the disk tier since the last
        call, which a step makes once, as it reports. Every byte counts once, in the step
        whose report follows it: an update that overlaps the next step's forward (state on
        disk) is counted there, not lost between the two."""
        if self.spill is None:
            return 0, 0, 0.0
        tier, (r, w, s) = self.spill.tier, self._disk_base
        waited = tier.wait_seconds + self.flight.waited
        self._disk_base = (tier.bytes_read, tier.bytes_written, waited)
        return tier.bytes_read - r, tier.bytes_written - w, waited - s


    def whole(self, chunk: Chunk, shard: torch.Tensor) -> torch.Tensor:
        """A sharded chunk's home tensor `shard` (master, a moment) gathered whole on the
        CPU, in fp32; a collective (engine.chunks.sharding.ShardedChunks.whole)."""
        return self.sharding.whole(chunk, shard)

    # --- the end ------------------------------------------------------------------------------

    def close(self, *, keep_weights: bool = True) -> None:
        """Give every parameter its latest weights as a plain CPU tensor of its own (in the
        compute dtype; `keep_weights=False`: empty ones), then drop every chunk tensor and
        the scratch folder: nothing of the engine stays alive. The last update, and its
        writes, end first."""
        self.flight.close()
        self.device.settle_host()
        for chunk in self.chunks:
            self.settle(chunk)
            if keep_weights:
                self._give_weights(chunk)
            else:
                for slot in chunk.slots:
                    slot.param.data = torch.empty(0, dtype=chunk.dtype)
                    slot.param.grad = None
            chunk.payload = chunk.device_payload = chunk.grad = chunk.host_grad = None
            chunk.master = chunk.exp_avg = chunk.exp_avg_sq = None
            chunk.slot_grads.clear()
        if self.spill is not None:
            self.spill.close()  # the scratch folder goes with it
            self.spill = None
        self.device_bytes = self.host_bytes = self.grad_bytes = 0

    def _give_weights(self, chunk: Chunk) -> None:
        """Each parameter of the chunk its latest weights, as a CPU tensor of its own."""
        with self.opened(chunk):
            master = chunk.master
            if chunk.sharded:
                try:
                    master = self.whole(chunk, chunk.master)
                except CollectiveError:
                    master = None  # another rank is gone: no whole weights to give
            for slot in chunk.slots:
                if master is None:
                    slot.param.data = torch.empty(0, dtype=chunk.dtype)
                    continue
                weights = master[slot.offset:slot.offset + slot.numel]
                slot.param.data = weights.to("cpu", chunk.dtype, copy=True).view(slot.shape)
                slot.param.grad = None


def _zero_unwritten(chunk: Chunk) -> None:
    """Zero the parts of the gradient buffer no gradient wrote: padding, and parameters that
    got none this step (their update is undone, but the global norm reads every element)."""
    end = 0
    for slot in sorted(chunk.slots, key=lambda s: s.offset):
        if slot.offset > end:
            chunk.grad[end:slot.offset].zero_()
        if not slot.got_grad:
            chunk.grad[slot.offset:slot.offset + slot.numel].zero_()
        end = max(end, slot.offset + slot.numel)
    chunk.grad[end:].zero_()
