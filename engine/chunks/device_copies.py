"""DeviceCopies: the chunks' copies on the device, brought in for use and let go.

Materialising a module's chunks, prefetching those of the next module that needs one
brought in (rules.prefetch_target) into room that stays free, evicting idle copies to make
room, and, sharded, gathering at the points the ranks agree on (engine.chunks.sharding) and
ahead of use. The decisions are engine.placement.rules'.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from engine.chunks.chunk import Chunk, DeviceCopy
from engine.chunks.state import TensorState
from engine.chunks.tiers import ChunkTiers
from engine.devices.device import DeviceOutOfMemory
from engine.placement import rules
from engine.sizes import format_size

S = TensorState


class DeviceCopies(ChunkTiers):
    """The manager's device copies (parts on disk are read through the DiskSide's spill)."""

    def materialise(self, chunk: Chunk, pos: int, protect: tuple[Chunk, ...] = (),
                    gather: bool = False) -> None:
        """Make sure the chunk's parameters are on the device (HOLD or better).

        Sharded: the whole chunk is gathered when the ranks agreed to (`gather`), which
        they do whenever any of them lacks it (engine.chunks.sharding); a fresh copy is
        gathered again then, its bytes unchanged."""
        self.flight.wait(chunk)  # its update from the last step, if that is still running
        self._last_use[chunk.index] = pos
        self.fetched_ahead.discard(chunk.index)
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

    def prefetch(self, pos: int) -> None:
        """Start copying the chunks of the next module that needs one brought in
        (rules.prefetch_target) while this one and those before it compute (on CUDA and
        the simulated device the copy runs beside them: engine.devices).

        Only into room that is free now and stays free until that module by the trace's
        forecast (its non-model peak, and in backward the gradient buffers that may open
        meanwhile): a prefetch never evicts, so it moves no byte the step would not move
        anyway. Not while tracing, when there is no forecast to trust.
        """
        trace = self.trace
        # One module's chunks ahead at a time: those fetched ahead are used first.
        if trace is None or not self.strict or self.fetched_ahead:
            return
        # Every chunk of the modules ahead already there (all of them, when all are
        # resident): nothing to choose, so no forecast to make.
        target = rules.prefetch_target(trace, pos, lambda i: self.chunks[i].on_device)
        if target is None:
            return
        # Gradients kept as they come (keeps_grad) are counted already as they arrive.
        opening = sum(c.nbytes - c.kept_grad_bytes
                      for i in rules.opening_between(trace, pos, target)
                      if (c := self.chunks[i]).grad is None and not c.resident
                      and c.grads_pending > 0)
        forecast = rules.prefetch_forecast(trace, pos, self.non_model_now(), opening, target)
        # A stale device copy is one whose gradients went home: not used again this step.
        # A payload on disk only once its read ahead is done: a prefetch never waits.
        chosen = rules.prefetches(
            trace.points[target].chunks, free=self.free_bytes(forecast),
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
                # The payload is written no sooner than the chunk settles: gradients
                # come home after `settle`, the update after `release_all`.
                chunk.pending, seconds = self.device.copy_ahead(
                    chunk.device_payload, chunk.payload, src_kept=True)
                self.transfer_seconds += seconds
            self.bytes_h2d += chunk.nbytes
            self.fetched_ahead.add(index)
            self._fetched(chunk)

    def release(self, chunk: Chunk) -> bool:
        """Drop the device copy of an idle, non-resident chunk. Returns whether it did."""
        if chunk.copy_is_home or not chunk.on_device or chunk.in_use():
            return False
        self.fetched_ahead.discard(chunk.index)
        self.settle(chunk)
        self._storage_resize(chunk, False)
        for slot in chunk.slots:
            if slot.state != S.FREE:  # idle: HOLD, or HOLD_AFTER_FWD/BWD
                chunk.set_state(slot, S.FREE)
        return True

    def release_all(self) -> None:
        for chunk in self.chunks:
            self.release(chunk)
        if self.spill is not None:
            self.spill.cancel_read_ahead()


    def make_room(self, nbytes: int, pos: int, protect: tuple[Chunk, ...] = ()) -> None:
        """Evict idle chunks (rules.evictions) until `nbytes` and the forecast fit."""
        now = self.non_model_now()  # read once: nothing allocates before the check
        free = self.free_bytes(self.rules.forecast(self.trace, pos, now), now)
        if free >= nbytes:
            return  # the common case, called for every gradient and copy: nothing to evict
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
        for index in self.rules.release_before_use(on_device, [c.index for c in needed],
                                                   self.fetched_ahead):
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
            self.prefetch(pos)
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
            opening = sum(c.nbytes for i in trace.points[pos].grad_chunks
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

    @contextmanager
    def keeping_copies(self, room_for: int | None) -> Iterator[None]:
        """While inside, forwards outside a step (`prepare_outside_step`) keep the copies of
        other chunks on the device as long as `room_for` bytes stay free for the forward's
        activations, instead of dropping every one before each module: a copy stays valid
        until the next update, so a second evaluation batch finds them all there. None:
        keep none, as cpu does (no forecast of the activations to leave room for)."""
        self._keep_room_for, before = room_for, self._keep_room_for
        try:
            yield
        finally:
            self._keep_room_for = before

    _keep_room_for: int | None = None

    def prepare_outside_step(self, needed: tuple[Chunk, ...]) -> None:
        """Bring `needed` to the device for a forward outside a training step (evaluation),
        whatever the policy: evicting only what leaves too little room (`keeping_copies`),
        or copied in right before use and dropped right after, as cpu does, so that
        evaluation needs no more device memory than the smallest step."""
        on_device = [c.index for c in self.chunks if c.on_device]
        room_for = self._keep_room_for
        if room_for is None or self.sharding is not None:
            leaving = rules.CpuRules.release_before_use(on_device, [c.index for c in needed])
        else:
            coming = sum(c.nbytes for c in needed if not c.on_device)
            idle = [c.index for c in self.chunks if c.on_device and not c.copy_is_home
                    and not c.in_use() and c not in needed]
            # Room for the activations may be out of reach (a batch larger than the
            # trace's): then every idle copy goes, and the forward is cpu's.
            leaving, _ = rules.evictions(coming + room_for, self.free_bytes(), idle,
                                         lambda i: self.chunks[i].nbytes, pos=-1,
                                         trace=self.trace, last_use=self._last_use)
        for index in leaving:
            self.release(self.chunks[index])
        gather = self.sharding.boundary(needed, [])[0] if self.sharding is not None else set()
        for chunk in needed:
            self.materialise(chunk, -1, needed, gather=chunk.index in gather)
