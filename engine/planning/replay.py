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
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from engine.chunks.state import TensorState
from engine.config import format_size
from engine.devices.buffer_pool import HeldBytes
from engine.devices.streams import spare_core
from engine.placement import rules
from engine.placement.policy import Policy
from engine.placement.trace import Trace, TracePoint
from engine.planning.data_parallel import DataParallel
from engine.planning.layout import ChunkBytes, DiskPayloads, Layout
from engine.planning.recording import Event

__all__ = ["OutOfMemory", "StepReplay"]

S = TensorState


class OutOfMemory(Exception):
    pass


class StepReplay:
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
        self.lay, self.policy, self.capacity, self.trace = lay, policy, capacity, trace
        self.disk = disk or DiskPayloads()
        self.ahead: dict[int, int] = {}  # chunk -> payload pieces read ahead, not yet used
        # Pieces read ahead and then not used (ChunkManager.release_all, land_grads): the
        # tier read them all the same. Chunk -> pieces.
        self.unused_reads: dict[int, int] = {}
        self.rules = rules.rules_for(policy, tracing=trace is None)
        self.cost = cost
        self.itemsize = cost.itemsize
        self.nbytes = [n * cost.itemsize for n in lay.numel]
        self.resident = resident
        # Sharded, only the shards are resident: the whole chunk is gathered for each use.
        self.on_device = set() if cost.sharded else set(resident)
        self.device_bytes = sum(cost.resident(lay.numel[c], lay.is_frozen(c)) for c in resident)
        self.peak = self.device_bytes
        # The simulated device's kept buffers (engine.devices.buffer_pool): every chunk
        # copy and gradient buffer comes from them, a resident chunk's copy for good,
        # within the room the activations' peak leaves (ChunkManager.apply_residency).
        self.pool = HeldBytes(max(0, capacity - (0 if trace is None else trace.non_model_peak)))
        for chunk in sorted(self.on_device):
            self.pool.take(self.nbytes[chunk])
        self.resident_buffers = self.pool.in_use
        self.buffer_moves: list[int] = []  # +bytes taken, -bytes given back, in order
        # Resident chunks' optimizer state: device bytes from outside the pool, for good.
        self.resident_state = self.device_bytes - self.pool.in_use
        self.beside_pool = self.resident_state  # the most device bytes beside the pool
        self.footprint = 0  # the most host bytes of the device at one moment (_note_footprint)
        # Host gradient landing places made as gradients land, freed by the update
        # (rules.grads_land_per_step), where the step is one micro-batch: bytes of those
        # made so far this step, and the two figures above with them.
        self.grads_land_in_step = grads_land_in_step
        self.simulated = simulated  # the device the step runs on (rules.keeps_grad)
        # Whether a module joining a run tries the fetches and reads ahead
        # (StepRunner._polling).
        self.runs_poll = rules.runs_poll(simulated=simulated, spare_core=spare_core(),
                                         payloads_on_disk=bool(self.disk.chunks))
        self.landed = self.beside_landed = self.footprint_landed = 0
        self.grads: set[int] = set()
        self.grad_bytes = 0
        # Chunks keeping autograd's gradients until they go home (rules.keeps_grad): bytes.
        self.kept_grads: dict[int, int] = {}
        # Kept gradients whose free the recording has yet to report (`non_model`): bytes.
        self.adopted = 0
        # Chunks whose gradients are coming in, resident or not, and their bytes: the
        # working set counts a gradient buffer for each (engine.placement.trace).
        self.opened: set[int] = set()
        self.opening_bytes = 0
        self.pending = [lay.trainable(c) for c in range(len(lay.params))]
        self.state: dict[str, TensorState] = {}  # parameter -> state past HOLD; absent: idle
        self.computing = [0] * len(lay.numel)  # parameters in COMPUTE per chunk
        self.busy: set[int] = set()  # chunks with a parameter in COMPUTE (Chunk.in_use)
        self.last_use: dict[int, int] = {}
        self.nm = 0
        self.pos = -1
        self.pinned = 0
        self.held = 0  # most chunk bytes held in this part of the interval (pinned, opening)
        self.part_peak = 0  # the non-model peak in it
        # The interval's parts before the latest gradient arrival, as (held, non-model peak)
        # each (TracePoint.close), and how many gradients arrived in it.
        self.parts: list[tuple[int, int]] = []
        self.arrived = 0
        self.evicting = False
        self.overrun = 0
        self.copied = 0  # payload bytes copied between host and device (fetches, gradients)
        # Of those, fetches ahead of use from host memory: on the simulated device its copy
        # thread runs them beside the step (engine.devices.streams.CopyingHostStreams).
        self.prefetched = 0
        self.fetched_ahead: set[int] = set()  # ChunkManager.fetched_ahead
        # Every payload copied to the device, as (chunk, from the master: its gradients are
        # home, so the weights are in the fp32 master): what the disk tier reads for them.
        self.fetches: list[tuple[int, bool]] = []
        self.stale: set[int] = set()  # on the device, but its gradients have gone home
        self.home: set[int] = set()  # gradients gone home (Chunk.holds_grads)
        self.got: set[str] = set()  # parameters whose gradient arrived
        # Tied parameters whose first uses' gradients arrived, not their last (the engine's
        # StepRunner._partial; engine.step.tied_uses).
        self.partial: set[str] = set()
        self.in_backward = False
        # The latest point's phase, chunks and chunks its gradients go to (none in forward),
        # which a module of that phase may join (rules.joins_run); None after a recomputing
        # forward's point (StepRunner._run).
        self.joining: tuple[str, tuple[int, ...], tuple[int, ...]] | None = None
        self.recorded = Trace()  # what the engine's warm-up would record from this step
        self.sharding = sharding(self) if sharding is not None else None

    # bookkeeping

    def _set(self, param: str, state: TensorState | None) -> None:
        before = self.state.get(param)
        if (before == S.COMPUTE) != (state == S.COMPUTE):
            chunk = self.lay.chunk_of[param]
            self.computing[chunk] += 1 if state == S.COMPUTE else -1
            if self.computing[chunk]:
                self.busy.add(chunk)
            else:
                self.busy.discard(chunk)
        if state is None:
            self.state.pop(param, None)
        else:
            self.state[param] = state

    def _in_use(self, chunk: int) -> bool:
        return chunk in self.busy

    def _sample(self) -> None:
        if self.evicting:
            return
        if self.recorded.points:
            # What the rules keep room for (StepRunner._sample): the most chunk bytes held
            # beside the non-model peak to come, part by part (TracePoint.close).
            held = self.sharding.held_bytes if self.sharding is not None else 0
            self.held = max(self.held, self.pinned + self.opening_bytes + held)
            self.part_peak = max(self.part_peak, self.nm)
        self.peak = max(self.peak, self.device_bytes + self.nm)
        beside = self.device_bytes - self.pool.in_use + self.nm
        self.beside_pool = max(self.beside_pool, beside)
        self.beside_landed = max(self.beside_landed, beside + self.landed)
        self._note_footprint()

    def _note_footprint(self) -> None:
        """The pool keeps buffers only within its limit (HeldBytes: it holds at most the limit
        or what is in use, if more), so at any moment the device's host bytes are at most
        that beside the rest; the pool's peak and the most beside it come at other moments
        (the pool's at a full forward, the activations' in backward) and do not add up.
        `footprint_landed`: the same with the gradients landed on the host so far."""
        footprint = (max(self.pool.limit, self.pool.in_use) + self.device_bytes
                     - self.pool.in_use + self.nm)
        self.footprint = max(self.footprint, footprint)
        self.footprint_landed = max(self.footprint_landed, footprint + self.landed)

    @property
    def host_device_bytes(self) -> int:
        """The simulated device's host memory at its peak, once a step like this one has
        run before it: then the pool holds every buffer this step takes from the start, and
        the peak is the pool beside the most of everything else (on CUDA: no such bytes)."""
        return min(self.pool.peak + self.beside_pool, self.footprint)

    @property
    def host_step_bytes(self) -> int:
        """`host_device_bytes` with the host gradient landing places made by its moment,
        where they are made within the step (`grads_land_in_step`): what it adds to the
        chunks' host bytes between steps, at its peak."""
        return min(self.pool.peak + self.beside_landed, self.footprint_landed)

    @property
    def host_device_between_steps(self) -> int:
        """The simulated device's host memory between steps and through the update: its
        buffers, all kept by then, and the resident chunks' optimizer state."""
        return self.pool.peak + self.resident_state

    def take_buffer(self, chunk: int) -> None:
        """A chunk's device copy or gradient buffer comes in (from the pool)."""
        self.device_bytes += self.nbytes[chunk]
        self.pool.take(self.nbytes[chunk])
        self.buffer_moves.append(self.nbytes[chunk])
        self._note_footprint()

    def give_buffer(self, chunk: int) -> None:
        self.device_bytes -= self.nbytes[chunk]
        self.pool.give(self.nbytes[chunk])
        self.buffer_moves.append(-self.nbytes[chunk])

    # ChunkManager

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

    def _materialise(self, chunk: int, protect: tuple[int, ...]) -> None:
        self.last_use[chunk] = self.pos
        self.fetched_ahead.discard(chunk)
        if chunk in self.on_device:
            if chunk in self.stale:
                self.stale.discard(chunk)
                self.copied += self.nbytes[chunk]
                self.fetches.append((chunk, chunk in self.home))
            return
        self._make_room(self.nbytes[chunk], protect + (chunk,))
        self.on_device.add(chunk)
        self.take_buffer(chunk)
        self.copied += self.nbytes[chunk]
        self.fetches.append((chunk, chunk in self.home))
        if chunk not in self.home:
            self.ahead.pop(chunk, None)  # Spill.fetch takes what was read ahead
        self._sample()

    def _land(self, chunk: int) -> None:
        """A non-resident chunk's gradients land on the host (Gradients.grad_home)."""
        if self.grads_land_in_step and chunk not in self.home:
            self.landed += self.cost.landed(self.lay.numel[chunk])
        self.home.add(chunk)

    def _finish_grads(self, chunk: int) -> None:
        self._drop_ahead(chunk)  # Spill.land_grads: the payload's region gets gradients
        self.copied += self.nbytes[chunk]
        self._land(chunk)
        if chunk in self.on_device:
            self.stale.add(chunk)
        self.grads.discard(chunk)
        self.grad_bytes -= self.nbytes[chunk]
        self.give_buffer(chunk)
        self._sample()

    def _keeps_grad(self, chunk: int) -> bool:
        """Gradients.keeps_grad."""
        return rules.keeps_grad(len(self.lay.params[chunk]), resident=chunk in self.resident,
                                sharded=self.sharding is not None,
                                payload_on_disk=chunk in self.disk.chunks,
                                simulated=self.simulated)

    def _send_kept_grad(self, chunk: int) -> None:
        """ChunkManager._send_kept_grad: the kept gradients go home."""
        nbytes = self.kept_grads.pop(chunk)
        self.copied += nbytes
        self.device_bytes -= nbytes
        self._land(chunk)
        if chunk in self.on_device:
            self.stale.add(chunk)
        self._sample()

    # Engine hooks

    def _close_point(self) -> None:
        """The interval that ends here, as its samples left it (closed once, not per sample)."""
        if self.recorded.points:
            self.recorded.points[-1].close([*self.parts, (self.held, self.part_peak)])

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

    def _release_before_use(self, chunks: tuple[int, ...]) -> None:
        for chunk in self.rules.release_before_use(sorted(self.on_device), chunks,
                                                   self.fetched_ahead):
            self._release(chunk)

    def _computing(self, module: str, phase: str, fetch: bool) -> None:
        for param in self.lay.module_params[module] if fetch else ():
            if (phase == "forward" or self.state.get(param) != S.HOLD_AFTER_BWD
                    or param in self.partial):
                self._set(param, S.COMPUTE)

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

    def grad(self, param: str, last: bool = True) -> None:
        """A gradient of `param` arrives: its own, or one use's of a tied one (complete
        with the `last`)."""
        self._arrival()
        chunk = self.lay.chunk_of[param]
        if param in self.got:
            # A later use's, or a second gradient: it adds up where the first is, no bytes.
            if last and param in self.partial:
                self.partial.discard(param)
                self._complete(param, chunk)
            return
        self.got.add(param)
        if chunk not in self.opened:
            self.opened.add(chunk)
            self.opening_bytes += self.nbytes[chunk]
        if self.sharding is not None:
            # A whole gradient buffer, resident or not (ChunkManager.add_shard_grad).
            if chunk not in self.grads:
                self.open_grads(chunk, (chunk,))
        elif chunk in self.resident or self._keeps_grad(chunk):
            # Autograd's own gradient tensor is kept (keep_slot_grad): until the update, or
            # until it goes home (rules.keeps_grad).
            nbytes = self.lay.sizes[param] * self.itemsize
            self._make_room(nbytes, (chunk,))
            self.device_bytes += nbytes
            # It is model data from now on, not non-model (the engine's count disowns it,
            # StepRunner._adopt_kept_grads); the recording frees it right after this event,
            # a drop taken here already.
            self.nm -= nbytes
            self.adopted += nbytes
            if chunk not in self.resident:
                self.kept_grads[chunk] = self.kept_grads.get(chunk, 0) + nbytes
            self._sample()
        elif chunk not in self.grads:
            self.open_grads(chunk, (chunk,))
        if not last:
            self.partial.add(param)
            self._taken(param)
            return
        self._complete(param, chunk)

    def _taken(self, param: str) -> None:
        """GradientArrivals: a parameter on the device whose gradient is taken."""
        if self.state.get(param) in (S.COMPUTE, S.HOLD_AFTER_FWD):
            self._set(param, S.HOLD_AFTER_BWD)

    def _complete(self, param: str, chunk: int) -> None:
        self._taken(param)
        self.pending[chunk] -= 1
        if self.pending[chunk] == 0:
            self._close(chunk)

    def _arrival(self) -> None:
        """StepRunner._on_arrival: the interval's next part begins."""
        self._sample()
        self.parts.append((self.held, self.part_peak))
        self.held = self.part_peak = 0
        self.arrived += 1
        if self.trace is not None:
            self.trace.arrived_at(self.pos, self.arrived)
        self._sample()

    def open_grads(self, chunk: int, protect: tuple[int, ...]) -> None:
        """ChunkManager.grad_buffer: a device gradient buffer for `chunk`."""
        self._make_room(self.nbytes[chunk], protect)
        self.grads.add(chunk)
        self.grad_bytes += self.nbytes[chunk]
        self.take_buffer(chunk)
        self._sample()

    def _close(self, chunk: int) -> None:
        """Every gradient of `chunk` is in, or backward is over."""
        self.opened.discard(chunk)
        self.opening_bytes -= self.nbytes[chunk]
        if self.sharding is not None:
            self.sharding.ready(chunk)
        elif chunk in self.kept_grads:
            self._send_kept_grad(chunk)
        elif chunk in self.grads:
            self._finish_grads(chunk)

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
        if self.sharding is not None:
            self.sharding.finish()
            for chunk in sorted(self.on_device):  # ChunkManager.release_all
                self._release(chunk)
        for chunk in list(self.ahead):  # ChunkManager.release_all at the step's end
            self._drop_ahead(chunk)

    def trace_of(self) -> Trace:
        self._close_point()
        self.recorded.finish()
        return self.recorded
