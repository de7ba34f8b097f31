"""The engine's step, replayed in bytes.

`StepReplay` runs a recording (engine.planning.recording) against a chunk layout
(engine.planning.layout) under one placement policy, counting device bytes and copies.
Nothing is allocated. Data parallel, it is one rank's step (`sharded_layout`,
ChunkBytes.world), and the gathers and gradient reductions are its `sharding`'s: a layer
over this replay (engine.planning.sharded), as the engine's are engine.chunks.sharding's.

Every decision (what to release, which chunk to evict, what to prefetch, what stays
resident, how much room the forecast keeps) is asked of engine.placement.rules, the same
functions the ChunkManager carries out on tensors; what remains here is the counting, and
the engine's own bookkeeping of which parameter is in which TensorState.

A step of several micro-batches (EngineConfig.grad_accum) is its first replayed as above,
and then a later one (`later_micro_batch`), which starts where the first left the chunks:
every later one is alike.

It is built as the ChunkManager is, its parts over one shared state: the state and its
counting, sampled per interval (engine.planning.replay_bytes), the device copies
(replay_copies) and the gradients (replay_gradients). This module holds the StepRunner's
side: the recording's events, run through the engine's hooks, and the trace they record.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.chunks.state import TensorState
from engine.placement import rules
from engine.placement.policy import Policy
from engine.placement.trace import Trace, TracePoint
from engine.planning.data_parallel import DataParallel
from engine.planning.layout import ChunkBytes, DiskPayloads, Layout
from engine.planning.recording import Event
from engine.planning.replay_copies import OutOfMemory, ReplayCopies
from engine.planning.replay_gradients import ReplayGradients

__all__ = ["OutOfMemory", "StepReplay"]

S = TensorState


class StepReplay(ReplayCopies, ReplayGradients):
    """One engine step replayed in bytes: the StepRunner's sampling and the placement rules.

    Without a trace it is the warm-up step (no forecast, least recently used eviction, an
    overrun is noted rather than raised); with one it is every later step. With payloads on
    disk (`disk`), a chunk is prefetched only once its pieces have been read ahead
    (rules.disk_read_ahead, each read taken as done by the next module). Sharded
    (`cost.world` > 1), one rank's step: chunks are gathered at agreed boundaries and never
    gathered ahead of use where every rank offers them, their gradients reduce-scattered
    (`sharding`, engine.planning.sharded.ShardedReplay).
    """

    def __init__(
        self,
        lay: Layout,
        *,
        cost: ChunkBytes,
        policy: Policy,
        capacity: float,
        resident: set[int],
        trace: Trace | None = None,
        disk: DiskPayloads | None = None,
        sharding: Callable[[StepReplay], DataParallel] | None = None,
        grads_land_in_step: bool = False,
        simulated: bool = True,
    ) -> None:
        if cost.sharded != (sharding is not None):
            raise ValueError("a sharded step, and only one, replays with its data-parallel side")
        super().__init__(lay, cost=cost, policy=policy, capacity=capacity, resident=resident,
                         trace=trace, disk=disk, grads_land_in_step=grads_land_in_step,
                         simulated=simulated)
        self.sharding = sharding(self) if sharding is not None else None

    # Engine hooks

    def point(self, module: str, phase: str, fetch: bool = True) -> None:
        chunks = self.lay.module_chunks[module] if fetch else ()
        grads_to = self.lay.module_chunks[module] if phase == "backward" else ()
        recompute = phase == "forward" and self.in_backward
        run = self.joining
        if (not recompute and run is not None and run[0] == phase and self.sharding is None
                and rules.joins_run(chunks, grads_to, run[1], run[2])):
            # StepRunner._join: no point of its own; a chunk evicted since is brought in
            # again, or waited for where fetched ahead again since (DeviceCopies.prepare
            # without a phase).
            if any(c not in self.on_device or c in self.stale or c in self.fetched_ahead
                   for c in chunks):
                self._release_before_use(chunks)
                for chunk in chunks:
                    self._materialise(chunk, chunks)
            if self.runs_poll:
                self._prefetch()
                self._read_ahead()
            self._computing(module, phase, fetch)
            return
        self.joining = None if recompute else (phase, chunks, grads_to)
        self._close_point()
        self.pos += 1
        self.recorded.points.append(TracePoint(
            chunks, phase, grads_to=None if fetch else self.lay.module_chunks[module]))
        self.pinned = sum(self.nbytes[c] for c in self.busy.union(chunks))
        self.held = self.part_peak = 0
        self.parts, self.arrived = [], 0
        if self.trace is not None:
            self.trace.arrived_at(self.pos, 0)
        self._keep_room(tuple(self.busy.union(chunks)))
        self._release_before_use(chunks)
        if self.sharding is not None:
            offer = self._gather_offer(chunks, "backward" if self.in_backward else phase)
            gather, ahead = self.sharding.boundary(chunks, offer)
            for chunk in chunks:
                self.sharding.materialise(chunk, chunks, gather=chunk in gather)
            for chunk in ahead:
                self.sharding.gather_ahead(chunk)
        else:
            for chunk in chunks:
                self._materialise(chunk, chunks)
            self._prefetch()
            self._read_ahead()
        self._computing(module, phase, fetch)

    def _computing(self, module: str, phase: str, fetch: bool) -> None:
        for param in self.lay.module_params[module] if fetch else ():
            if (phase == "forward" or self.state.get(param) != S.HOLD_AFTER_BWD
                    or param in self.partial):
                self._set(param, S.COMPUTE)

    def post(self, module: str) -> None:
        for param in self.lay.module_params[module]:
            self._set(param, S.HOLD_AFTER_FWD)

    def done(self, module: str) -> None:
        """StepRunner._after_backward: frozen parameters leave COMPUTE (idle, then released
        as the rules say)."""
        for param in self.lay.module_params[module]:
            if self.state.get(param) == S.COMPUTE and self.lay.is_frozen(self.lay.chunk_of[param]):
                self._set(param, None)

    def non_model(self, delta: int) -> None:
        if delta < 0 and self.adopted:
            taken = min(self.adopted, -delta)
            self.adopted -= taken
            delta += taken
            if not delta:
                return
        self.nm += delta
        if delta > 0:
            self._keep_room(tuple(self.busy | self.grads | self.kept_grads.keys()))
        else:
            self._sample()

    def _keep_room(self, protect: tuple[int, ...]) -> None:
        """StepRunner._keep_room: a sample, then room for the forecast non-model bytes
        (sampled first, as the engine does: bytes that found no room show in the peak)."""
        self._sample()
        forecast = self.rules.forecast(self.trace, self.pos, self.nm)
        if self.device_bytes + self.nm + forecast > self.capacity:
            self.evicting = True
            try:
                self._make_room(0, protect)
            finally:
                self.evicting = False
            self._sample()

    def run(self, events: list[Event]) -> None:
        for event in events:
            kind = event[0]
            if kind == "point":
                self.point(*event[1:])
            elif kind == "post":
                self.post(event[1])
            elif kind == "done":
                self.done(event[1])
            elif kind == "nm":
                self.non_model(event[1])
            elif kind == "grad":
                self.grad(*event[1:])
            elif kind == "backward":
                self.in_backward = True
        for chunk in sorted(self.opened):
            self._close(chunk)
        if self.later and self.sharding is None:
            for chunk in sorted(self.grads):  # a parameter got none: the end adds them
                self.add_to_disk(chunk)
        if self.sharding is not None:
            self.sharding.finish()
            for chunk in sorted(self.on_device):  # ChunkManager.release_all
                self._release(chunk)
        for chunk in list(self.ahead):  # ChunkManager.release_all at the step's end
            self._drop_ahead(chunk)

    def later_micro_batch(self) -> StepReplay:
        """The replay of the step's next micro-batch (EngineConfig.grad_accum), from where
        this one leaves the chunks (StepRunner.begin with `accumulate`): every copy but the
        resident ones' let go (ChunkManager.release_all), the gradients home, and those the
        resident chunks keep still on the device. Every later micro-batch starts so."""
        later = StepReplay(
            self.lay, cost=self.cost, policy=self.policy, capacity=self.capacity,
            resident=self.resident, trace=self.trace, disk=self.disk,
            sharding=type(self.sharding) if self.sharding is not None else None,
            grads_land_in_step=self.grads_land_in_step, simulated=self.simulated)
        later.later = True
        later.home = set(self.home)
        later.kept_resident = self.kept_resident
        later.device_bytes += self.kept_resident
        return later

    def trace_of(self) -> Trace:
        self._close_point()
        self.recorded.finish()
        return self.recorded
