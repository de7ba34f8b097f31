"""ReplayCopies: the replayed step's device copies, brought in for use and let go.

The counterpart of engine.chunks.device_copies.DeviceCopies, in bytes: materialising a
module's chunks, releasing what the rules let go before a use, evicting idle copies to make
room (an overrun noted in the warm-up step, OutOfMemory in a later one), prefetching the
chunks of the next point that needs one brought in (rules.prefetch_target) into room that
stays free, offering the next point's chunks for a sharded rank to gather ahead
(engine.planning.sharded), and, with payloads on disk, reading their pieces ahead as the
disk side does (rules.disk_read_ahead). The decisions are engine.placement.rules'.
"""

from __future__ import annotations

import itertools

from engine.config import format_size
from engine.placement import rules
from engine.planning.replay_bytes import ReplayBytes

__all__ = ["OutOfMemory", "ReplayCopies"]


class OutOfMemory(Exception):
    pass


class ReplayCopies(ReplayBytes):
    """The replay's device copies (ChunkManager's DeviceCopies and reads ahead)."""

    def _copy_is_home(self, chunk: int) -> bool:
        """Chunk.copy_is_home: sharded, only the shard is resident, never the whole copy."""
        return chunk in self.resident and self.sharding is None

    def _release(self, chunk: int) -> None:
        if self._copy_is_home(chunk) or chunk not in self.on_device or self._in_use(chunk):
            return
        self.fetched_ahead.discard(chunk)
        self.on_device.discard(chunk)
        self.stale.discard(chunk)
        self.give_buffer(chunk)
        for param in self.lay.params[chunk]:
            self._set(param, None)
        self._sample()

    def _make_room(self, nbytes: int, protect: tuple[int, ...]) -> None:
        forecast = self.rules.forecast(self.trace, self.pos, self.nm)
        free = self.capacity - self.device_bytes - self.nm - forecast
        idle = [c for c in sorted(self.on_device)
                if not self._copy_is_home(c) and not self._in_use(c) and c not in protect]
        victims, short = rules.evictions(nbytes, free, idle, self.nbytes.__getitem__,
                                         pos=self.pos, trace=self.trace,
                                         last_use=self.last_use)
        for victim in victims:
            self._release(victim)
        if short:
            if self.trace is not None:
                raise OutOfMemory(
                    f"{format_size(self.device_bytes)} of model data and "
                    f"{format_size(self.nm)} of activations leave no room for "
                    f"{format_size(nbytes + forecast)} more"
                )
            self.overrun = max(self.overrun, int(short))

    def _fetch_bytes(self, chunk: int) -> int:
        """Bytes a fetch of `chunk` copies (DeviceCopies.materialise): its payload, or, once
        its gradients are home in bf16/fp16 (they hold the payload's place), its fp32
        master, which the copy casts."""
        if chunk in self.home and not self.cost.aliased:
            return 4 * self.cost.home(self.lay.numel[chunk])
        return self.nbytes[chunk]

    def _materialise(self, chunk: int, protect: tuple[int, ...]) -> None:
        self.last_use[chunk] = self.pos
        self.fetched_ahead.discard(chunk)
        if chunk in self.on_device:
            if chunk in self.stale:
                self.stale.discard(chunk)
                self.copied += self._fetch_bytes(chunk)
                self.fetches.append((chunk, chunk in self.home))
            return
        self._make_room(self.nbytes[chunk], protect + (chunk,))
        self.on_device.add(chunk)
        self.take_buffer(chunk)
        self.copied += self._fetch_bytes(chunk)
        self.fetches.append((chunk, chunk in self.home))
        if chunk not in self.home:
            self.ahead.pop(chunk, None)  # Spill.fetch takes what was read ahead
        self._sample()

    def _release_before_use(self, chunks: tuple[int, ...]) -> None:
        for chunk in self.rules.release_before_use(sorted(self.on_device), chunks,
                                                   self.fetched_ahead):
            self._release(chunk)

    def _prefetch(self) -> None:
        """ChunkManager.prefetch: the chunks of the next point that needs one brought in,
        into room that stays free until then."""
        trace, pos = self.trace, self.pos
        if trace is None or self.fetched_ahead:
            return
        target = rules.prefetch_target(trace, pos, self.on_device.__contains__)
        if target is None:
            return
        opening = sum(self.nbytes[c] - self.kept_grads.get(c, 0)
                      for c in rules.opening_between(trace, pos, target)
                      if c not in self.grads and c not in self.resident and self.pending[c])
        forecast = rules.prefetch_forecast(trace, pos, self.nm, opening, target)
        chosen = rules.prefetches(
            trace.points[target].chunks, nbytes=self.nbytes.__getitem__,
            free=self.capacity - self.device_bytes - self.nm - forecast,
            skip=lambda c: c in self.on_device or c in self.home or (
                c in self.disk.chunks and self.ahead.get(c, 0) < self.disk.pieces[c]))
        for chunk in chosen:
            self.on_device.add(chunk)
            self.take_buffer(chunk)
            self.copied += self.nbytes[chunk]
            if chunk not in self.disk.chunks:
                self.prefetched += self.nbytes[chunk]
            self.fetches.append((chunk, False))
            self.fetched_ahead.add(chunk)
            self.ahead.pop(chunk, None)
            self._sample()

    def _gather_offer(self, chunks: tuple[int, ...], phase: str) -> list[int]:
        """ChunkManager._gather_offer: the next point's chunks this rank has room to gather
        ahead, before `chunks` (the running module's) come in."""
        trace, pos = self.trace, self.pos
        if trace is None or pos + 1 >= len(trace.points):
            return []
        opening = 0
        if phase == "backward":
            opening = sum(self.nbytes[c] for c in trace.points[pos].grad_chunks
                          if c not in self.grads and self.pending[c])
        forecast = rules.prefetch_forecast(trace, pos, self.nm, opening)
        coming = sum(self.nbytes[c] for c in chunks if c not in self.on_device)
        return rules.gathers_ahead(
            (c for c in trace.points[pos + 1].chunks if c not in chunks),
            skip=lambda c: c in self.home or self.sharding.reducing(c) or (
                c in self.disk.chunks and self.ahead.get(c, 0) < self.disk.pieces[c]),
            on_device=lambda c: c in self.on_device,
            free=self.capacity - self.device_bytes - self.nm - forecast - coming,
            nbytes=self.nbytes.__getitem__)

    def _read_ahead(self) -> None:
        """ChunkManager.read_ahead: payload pieces of the next chunks on disk to be fetched,
        into at most `disk.slots` buffers (rules.disk_read_ahead)."""
        trace, disk = self.trace, self.disk
        if trace is None or not disk.chunks:
            return
        slots = disk.slots - sum(self.ahead.values())
        if slots <= 0:
            return
        upcoming = itertools.chain.from_iterable(
            p.chunks for p in itertools.islice(trace.points, self.pos + 1, None))
        chosen = rules.disk_read_ahead(
            upcoming, slots=slots,
            wanted=lambda c: (c in disk.chunks and c not in self.home
                              and c not in self.on_device),
            pieces=lambda c: range(self.ahead.get(c, 0), disk.pieces[c]))
        for chunk, _ in chosen:
            self.ahead[chunk] = self.ahead.get(chunk, 0) + 1

    def _drop_ahead(self, chunk: int) -> None:
        if pieces := self.ahead.pop(chunk, 0):
            self.unused_reads[chunk] = self.unused_reads.get(chunk, 0) + pieces
