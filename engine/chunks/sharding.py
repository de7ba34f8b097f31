"""Sharded chunks in a step: when to gather them and when to reduce-scatter their gradients.

Collectives pair up across ranks by the order they are issued in, so every rank must issue
the same ones in the same order, yet what a rank *needs* differs: the auto policy evicts by
the bytes this rank measures, and a parameter unused on one rank (a branch its batch does
not take) leaves that rank's chunk waiting for a gradient that never comes. Deciding from
local state alone would desynchronise the ranks (Gemini's "ZERO DDP error" reports).

So the ranks agree at every module boundary, in one small all-reduce that every rank
issues at the same point (the modules run in the same order everywhere; a fingerprint of
the phase and the module's chunks checks that, before any gather a difference would pair
with another rank's different collective, which gloo answers by aborting the process):

- which of the module's chunks to gather: those that any rank lacks. A rank that still has
  a fresh copy takes part all the same (it gathers what it has); placement stays a local
  choice and never changes which collectives run;
- which chunks' gradients are complete on every rank: those are reduce-scattered now, in
  descending chunk order, while backward goes on; the ones issued at an earlier boundary
  are waited for and land in their shard's home (divided by the world size: SUM, then
  divide);
- which of the next module's chunks (the agreed trace's next point) to gather ahead of use,
  while this module computes: those every rank offers (rules.gathers_ahead: it has the
  room, free now and by the forecast until the next module, without evicting) and some
  rank lacks. Started once the module's own chunks are in, in ascending chunk order, and
  waited for when the chunk is used (or released).

At the end of backward every chunk with trainable parameters that is still waiting is
reduce-scattered, a missing gradient counting as zeros (as DDP's find_unused_parameters
does), so no rank waits for a gradient another rank never computes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch

from engine.chunks.chunk import Chunk
from engine.chunks.manager import ChunkManager
from engine.distributed.collectives import CollectiveError, Collectives, Pending
from engine.placement.trace import Trace


class ShardedChunks:
    """Data parallel over a ChunkManager: gathers and gradient reduction. The manager
    calls it as its engine.chunks.data_parallel.DataParallel hook (ChunkManager.use_sharding)."""

    def __init__(self, manager: ChunkManager, collectives: Collectives) -> None:
        self.manager = manager
        self.collectives = collectives
        self.rank = collectives.rank
        self.world = collectives.world
        self._ready: set[int] = set()  # gradients complete on this rank this backward
        self._arrived: dict[int, set[int]] = {}  # chunk -> slots with a gradient, this backward
        self._issued: set[int] = set()  # reduce-scatters issued this backward
        self._pending: list[tuple[Chunk, torch.Tensor, Pending]] = []
        # Gradient buffers complete here and not reduced yet, or being reduced: bytes a
        # single process would have sent home already (id(buffer) -> bytes).
        self._held: dict[int, int] = {}
        self.held_bytes = 0
        self._ahead: dict[int, Pending] = {}  # chunk -> its gather ahead of use, in flight
        # An interrupt asked for on this rank, and what every rank does once they agree
        # on one (the engine: stop the step at the next module boundary).
        self._interrupt_asked = False
        self.on_interrupt: Callable[[], None] = lambda: None

    def request_interrupt(self) -> None:
        """Cut the step short on every rank: carried by the next boundary's agreement, so
        that all stop at the same boundary (one rank alone would leave the others waiting
        in its collectives). Only sets a flag: safe from a signal handler."""
        self._interrupt_asked = True

    @property
    def chunks(self) -> list[Chunk]:
        return self.manager.chunks

    # --- the step's frame -------------------------------------------------------------

    def begin(self) -> None:
        """A forward and backward starts: no gradient is complete yet."""
        self._ready.clear()
        self._issued.clear()
        self._arrived.clear()

    def arrived(self, chunk: Chunk, offset: int) -> None:
        """The gradient of the parameter at `offset` is in: once every trainable parameter
        of the chunk has one, it is ready. Counted per backward, as a later micro-batch
        of the same step needs its own reduction."""
        got = self._arrived.setdefault(chunk.index, set())
        got.add(offset)
        if len(got) == sum(s.param.requires_grad for s in chunk.slots):
            self.ready(chunk)

    def ready(self, chunk: Chunk) -> None:
        """Every gradient of `chunk` this rank will compute in this backward is in."""
        self._ready.add(chunk.index)
        if chunk.grad is not None:
            self._hold(chunk.grad)

    def _hold(self, buffer: torch.Tensor) -> None:
        if id(buffer) not in self._held:
            self._held[id(buffer)] = buffer.nbytes
            self.held_bytes += buffer.nbytes

    def _let_go(self, buffer: torch.Tensor) -> None:
        self.held_bytes -= self._held.pop(id(buffer), 0)

    def _waiting(self) -> list[int]:
        return [c.index for c in self.chunks
                if c.index not in self._issued and _trainable(c)]

    def agree_trace(self, trace: Trace, overrun: int) -> int:
        """Make `trace` every rank's: each point's peaks become the largest any rank
        measured, so that all forecast and place alike. Returns the largest overrun."""
        points = trace.points
        n = len(points)
        low, high = self.collectives.max_ints([-n, n])
        if -low != n or high != n:
            raise CollectiveError(
                f"rank {self.rank} of {self.world}: the ranks traced different steps ({n} "
                f"module boundaries here, {-low} to {high} across the ranks); every rank "
                f"must run the same modules in the same order")
        agreed = self.collectives.max_ints(
            [overrun] + [p.non_model_peak for p in points] + [p.working_set for p in points])
        for i, point in enumerate(points):
            point.non_model_peak, point.working_set = agreed[1 + i], agreed[1 + n + i]
        return agreed[0]

    # --- module boundaries ------------------------------------------------------------

    def boundary(self, needed: tuple[Chunk, ...], offer: list[int], phase: str = ""
                 ) -> tuple[set[int], list[int]]:
        """The agreement at a module boundary (see the module docstring): `needed`, the
        module's chunks, in the `phase` it runs in; `offer`, the chunks of the next module
        this rank can gather ahead (rules.gathers_ahead). Reduce-scatters what is complete
        everywhere. Returns the indices of `needed` to gather now, and those to gather
        ahead once they are in (`start_gather`). CollectiveError, on every rank, when
        the ranks are at different modules."""
        count = len(self.chunks)
        # Per chunk: lacked here (needed or offered), still waiting for gradients here,
        # not offered here; then an interrupt asked for here, and the fingerprint of this
        # boundary and its negation (their maxima are the largest and the smallest).
        mark = _fingerprint(phase, needed)
        want = [0] * (2 * count) + [1] * count + [mark, -mark, int(self._interrupt_asked)]
        for chunk in needed:
            want[chunk.index] = int(not chunk.on_device or chunk.stale)
        for index in offer:
            chunk = self.chunks[index]
            want[index] = int(not chunk.on_device or chunk.stale)
            want[2 * count + index] = 0
        for index in self._waiting():
            if index not in self._ready:
                want[count + index] = 1
        agreed = self.collectives.max_ints(want)
        if agreed[-3] != -agreed[-2]:
            raise CollectiveError(
                f"rank {self.rank} of {self.world}: the ranks reached a module boundary at "
                f"different modules ({phase or 'evaluation'} of chunks "
                f"{[c.index for c in needed]} here); every rank must run the same modules "
                f"in the same order")
        if agreed[-1]:
            self._interrupt_asked = False
            self.on_interrupt()  # every rank, at this boundary
        self._land_all()
        complete = [i for i in self._waiting() if not agreed[count + i]]
        for index in sorted(complete, reverse=True):
            self._issue(self.chunks[index])
        gather = {c.index for c in needed if agreed[c.index]}
        # Nothing ahead of a boundary no module passes: the step stops at the next one.
        ahead = [] if agreed[-1] else [
            i for i in range(count) if agreed[i] and not agreed[2 * count + i]]
        return gather, ahead

    def reducing(self, index: int) -> bool:
        """Whether chunk `index`'s gradients are being, or have been, reduced this
        backward: it is not gathered ahead (its device copy is about to be stale)."""
        return index in self._issued

    def gather(self, chunk: Chunk) -> None:
        """The whole chunk into its device payload, whose own shard is already in place."""
        self.collectives.gather(chunk.device_payload, chunk.index)

    def start_gather(self, chunk: Chunk) -> None:
        """`gather`, started ahead of use: `settle` waits for it."""
        self._ahead[chunk.index] = self.collectives.start_gather(chunk.device_payload,
                                                                 chunk.index)

    def settle(self, chunk: Chunk) -> None:
        """Until the chunk's gather ahead of use, if one is in flight, has completed here
        (CollectiveError past the timeout)."""
        pending = self._ahead.pop(chunk.index, None)
        if pending is not None:
            self.collectives.wait(pending)

    # --- gradients ----------------------------------------------------------------------

    def _issue(self, chunk: Chunk) -> None:
        """Start reducing `chunk`'s gradient buffer (opened zeroed when this rank got no
        gradient for it: it adds nothing to the sum)."""
        m = self.manager
        buffer = chunk.grad if chunk.grad is not None else m.grad_buffer(chunk, -1)
        chunk.grad = None  # a later gradient for it (a module used twice) opens a new one
        self._hold(buffer)
        self._issued.add(chunk.index)
        self._pending.append((chunk, buffer, self.collectives.reduce_scatter(buffer, chunk.index)))

    def _land_all(self) -> None:
        pending, self._pending = self._pending, []
        for chunk, buffer, work in pending:
            self.collectives.wait(work)
            self._land(chunk, buffer)

    def _land(self, chunk: Chunk, buffer: torch.Tensor) -> None:
        """The reduced shard, averaged, into the shard's home; the buffer is freed."""
        m = self.manager
        shard = buffer[chunk.shard.lo:chunk.shard.hi]
        shard.div_(self.world)
        direction = "" if chunk.resident else "d2h"
        if chunk.payload_on_disk and not chunk.holds_grads:
            # Into I/O buffers, which go to disk as soon as the bytes are in (Spill).
            m.spill.land_grads(chunk, shard, lambda dst, src: m._copy(dst, src, direction))
        elif chunk.holds_grads and chunk.payload_on_disk:  # added to what the disk holds
            m.spill.add_grads(chunk, shard, lambda dst, src: m._copy(dst, src, direction),
                              lambda dst, src: m._copy(dst, src, "h2d" if direction else ""))
        elif chunk.holds_grads:  # a later micro-batch, or a module used twice
            home = m.grad_home(chunk)
            arrived = m.device.host_empty(shard.numel(), shard.dtype) if direction else shard
            if direction:
                m._copy(arrived, shard, direction)
            home.add_(arrived.to(home.dtype))
        else:
            m._copy(m.grad_home(chunk), shard, direction)
        self._let_go(buffer)
        m.free_grad_buffer(buffer)
        chunk.mark_stale()  # the update will change the parameters
        chunk.holds_grads = True

    def finish(self) -> None:
        """The end of backward: reduce every chunk still waiting (missing gradients count
        as zeros), and any gradient that arrived after its chunk was reduced, then land
        them all. The same collectives on every rank, in descending chunk order."""
        self._land_all()
        for index in sorted(self._waiting(), reverse=True):
            self._issue(self.chunks[index])
        for chunk in sorted(self.chunks, key=lambda c: -c.index):
            if chunk.grad is not None and chunk.index in self._issued:
                self._issue(chunk)
        self._land_all()
        self._ready.clear()
        for chunk in self.chunks:  # a gather ahead whose use did not come (no trace is exact)
            self.settle(chunk)

    def drop(self) -> None:
        """Forget the reductions in flight (a failed step): their buffers are freed. The
        gathers ahead are waited for, failed or not, so that no collective writes into a
        device copy once it is released."""
        ahead, self._ahead = self._ahead, {}
        for work in ahead.values():
            with contextlib.suppress(CollectiveError):
                self.collectives.wait(work)
        pending, self._pending = self._pending, []
        for _chunk, buffer, _work in pending:
            self.manager.free_grad_buffer(buffer)
        self._held.clear()
        self.held_bytes = 0
        self._ready.clear()
        self._issued.clear()

    # --- whole tensors --------------------------------------------------------------------

    def whole(self, chunk: Chunk, shard: torch.Tensor) -> torch.Tensor:
        """Every rank's `shard` of a home tensor of `chunk` (master, a moment), gathered
        into one CPU fp32 tensor of the whole chunk. A collective: every rank calls it for
        the same chunks in the same order (checkpoints, model weights, close)."""
        device = self.collectives.device
        full = torch.empty(chunk.numel, dtype=torch.float32, device=device)
        full[chunk.shard.lo:chunk.shard.hi].copy_(shard)
        self.collectives.gather(full, chunk.index)
        return full.cpu()


def _fingerprint(phase: str, needed: tuple[Chunk, ...]) -> int:
    """A module boundary as a number below 2**61: its phase and its chunks, in order."""
    mark = {"forward": 1, "backward": 2}.get(phase, 3)
    for chunk in needed:
        mark = (mark * 1_000_003 + chunk.index + 1) % (2**61 - 1)
    return mark


def _trainable(chunk: Chunk) -> bool:
    return any(s.param.requires_grad for s in chunk.slots)
