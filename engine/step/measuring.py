"""Measuring: a step's bytes on the device, trace point by trace point.

A trace *point* is a module boundary where the step runner brings in that module's chunks
(`_point`); the interval to the next point is what a warm-up step's trace records, and
what the step's timeline shows. In each interval the runner samples the device's bytes
(`_sample`): at its points, at every change of model bytes, and on the simulated device as
the non-model bytes grow. Model bytes are the chunk manager's count; non-model bytes are
every op's storages, counted (simulated device, engine.step.non_model) or read from the
allocator (CUDA, engine.step.allocator_readings). An interval keeps its non-model peak, its
working set (the most chunk bytes held beside them: what the placement rules keep room
for) and its parts, split at each gradient arrival (engine.placement.trace). Which steps
count every byte and what the others report is engine.step.counting's; a step that
neither counts nor idles bounds each interval from the trace once, as it closes.

At each point, and as the counted non-model bytes grow, room is kept for the non-model
bytes the trace says are still to come before the next module (`_keep_room`).

A part of engine.step.runner.StepRunner over the runner's state, as the chunk manager's
parts are of it (engine.chunks.manager): the hooks reach these methods, and they the
runner's, as directly as the runner's own, with no object in between.
"""

from __future__ import annotations

from collections.abc import Callable

from engine.chunks.chunk import Chunk
from engine.chunks.manager import ChunkManager
from engine.devices.device import ComputeDevice
from engine.placement.trace import Trace, TracePoint
from engine.step.allocator_readings import AllocatorReadings
from engine.step.arrivals import GradientArrivals
from engine.step.counting import CountedSteps
from engine.step.non_model import NonModelCounter, storage_key
from engine.telemetry import TimelinePoint

__all__ = ["Measuring"]


class Measuring:
    """The StepRunner's measuring side; see the module doc. Its own state is set by
    `_init_measuring` and begun again each step by `_begin_measuring`."""

    # The runner's state it reads (engine.step.runner.StepRunner sets it). A point also ends
    # the latest run, and stops an interrupted step: the runner's `_run` and
    # `_stop_if_interrupted`.
    chunks: list[Chunk]
    device: ComputeDevice
    manager: ChunkManager
    arrivals: GradientArrivals
    module_chunks: dict[int, tuple[Chunk, ...]]
    module_names: dict[int, str]
    pos: int  # index of the latest trace point this step
    _in_step: bool
    _tracing: Trace | None  # the trace being recorded this step

    # Peak non-model bytes this step (set again by `_begin_measuring`). With `peak`, what
    # the step really reached: on the simulated device every storage alive counts
    # (non_model.py).
    non_model_peak = 0
    # A step that neither counts nor idles (engine.step.counting): the trace stands in for
    # the count, so a sample is only the most chunk bytes in the interval, whose top is
    # taken when it closes (`_bound_interval`). Its figures are the counted step's when
    # its fingerprint matches, else these upper bounds.
    _bounding = False

    def _init_measuring(self, device: ComputeDevice) -> None:
        """The measuring state, set once as the runner is made: each step begins it again
        (`_begin_measuring`) and each point opens its interval (`_point`)."""
        self.counter = NonModelCounter(self._is_model_storage, self._on_non_model_change)
        self.counts = CountedSteps(recount=device.simulated)  # which steps count
        self.readings = AllocatorReadings(device)  # CUDA: its counts at each sample
        self.peak = 0  # peak device bytes this step
        self._interval_peak = 0
        self._interval_ws = 0
        # The interval's parts before the latest gradient arrival in it, as (most chunk bytes
        # held, non-model peak) each (TracePoint.close), and how many gradients arrived.
        self._parts: list[tuple[int, int]] = []
        self._arrived = 0
        # The interval's peak of all device bytes, and its split into chunk bytes and the
        # rest at that moment (the timeline's bars: their top is the peak the step reached).
        self._interval_top = (0, 0)
        # The latest forward and backward interval by interval (StepStats.timeline), and the
        # copy counters where the open interval began.
        self.timeline: list[TimelinePoint] = []
        self._copied_at = (0, 0)
        self._pinned = 0
        self._evicting = False

    def _begin_measuring(self, *, tracing: bool, accumulate: bool) -> None:
        """A step begins (StepRunner.begin): its peaks, timeline and counts start afresh, and
        whether it counts, idles or bounds its intervals is decided (engine.step.counting)."""
        self.timeline = []
        self.peak = self.manager.device_bytes
        self.non_model_peak = 0
        self.device.begin_step(self.manager.device_bytes)
        self.readings.reset(self.manager.device_bytes)
        self.counter.reset()
        counting = self.counts.begin(tracing=tracing, accumulate=accumulate)
        # Quiet (engine.step.counting): the hooks idle, and no gradient needs room made.
        self.manager.quiet = (not counting and self.manager.sharding is None
                              and all(c.copy_is_home for c in self.chunks))
        self._bounding = not (counting or self.manager.quiet)
        self._kept_grads: dict[int, int] = {}  # chunk index -> kept gradients adopted

    # --- model bytes and the rest -------------------------------------------------------------

    # Model data is the chunk manager's to count, and the non-model counter leaves it out:
    # chunk payloads exist before the step (no op allocates them), a gradient buffer is an
    # uninitialised allocation the counter asks about (`_is_model_storage`), as is a host
    # buffer gradients land in (made as they land, rules.grads_land_per_step), and a
    # gradient a chunk keeps (rules.keeps_grad) was autograd's until then
    # (`_adopt_kept_grads`).

    def _is_model_storage(self, key: int) -> bool:
        return any(t is not None and storage_key(t) == key
                   for c in self.chunks for t in (c.grad, c.host_grad))

    def _adopt_kept_grads(self) -> None:
        # Only a counting step's counter holds storages to disown (on CUDA it never counts),
        # and only the gradients kept since the last adoption are new to it: a chunk's kept
        # gradients only grow within a step, in insertion order.
        if not (self.device.simulated and self.counts.counting):
            return
        for chunk in self.chunks:
            kept = chunk.slot_grads
            adopted = self._kept_grads.get(chunk.index, 0)
            if len(kept) > adopted:
                self._kept_grads[chunk.index] = len(kept)
                fresh = list(kept.values())[adopted:]
                self.counter.disown({storage_key(g) for _, g in fresh})

    def non_model_now(self) -> int:
        if self.device.simulated or self._traced_stands_in():
            return self._counted_now()
        # The chunk manager asks before it allocates: the allocator's peak so far is read
        # now, before a chunk's bytes could hide a non-model peak under a higher total.
        allocated = (self.readings.allocated if self._sample()
                     else self.device.allocator_bytes())
        return max(0, allocated - self.manager.device_bytes)

    def _traced_stands_in(self) -> bool:
        """In a step that does not count, the interval's traced peak stands in for the
        count (simulated device) or the allocator's reading (CUDA): it leaves the rules the
        same room (engine.step.counting), at no cost per op or per decision."""
        return not self.counts.counting and self._in_step and self.manager.trace is not None

    def _counted_now(self) -> int:
        """The count (simulated device), or the interval's traced peak where that stands
        in (`_traced_stands_in`)."""
        if self._traced_stands_in():
            return self.manager.trace.non_model_ahead(self.pos)
        return self.counter.current

    def _on_model_change(self) -> None:
        if self._in_step:
            self._adopt_kept_grads()
        self._sample()

    def _on_non_model_change(self) -> None:
        self._keep_room(self._chunks_in_use)

    def _keep_room(self, protect: Callable[[], tuple[Chunk, ...]]) -> None:
        """Keep room for the non-model bytes the trace says are still to come before the
        next module (rules.forecast), evicting idle chunks but not `protect()`. Called at
        each point, before the module's first allocation, and on the simulated device after
        every op that allocated, so the common case (room enough) is cheap.

        Sampled first: an allocation that found no room (a forecast short of the truth)
        shows in the step's peak, as it would on a GPU, rather than being hidden by the
        evictions that follow it."""
        self._sample()
        if not self._in_step:
            return
        m = self.manager
        non_model = self.non_model_now()
        if m.free_bytes(m.rules.forecast(m.trace, self.pos, non_model), non_model) < 0:
            self._evicting = True
            try:
                m.make_room(0, self.pos, protect())
            finally:
                self._evicting = False
            self._sample()

    def _sample(self) -> bool:
        """Take a sample of the device's bytes; returns whether it read the allocator."""
        if not hasattr(self, "manager") or self._evicting or self.manager.quiet:
            return False
        model = self.manager.device_bytes
        if self._bounding:
            self._interval_model = max(self._interval_model, model)
            return False
        read = False
        if self.device.simulated or self._traced_stands_in():
            non_model = self._counted_now()
        elif self.counts.counting:
            model, non_model = self.readings.read(model)
            read = True
        else:
            return False  # after a step that did not count: its end reads the allocator
        self._interval_peak = max(self._interval_peak, non_model)
        # An interval's working set is what the placement rules keep room for: the most
        # chunk bytes it holds (in use, and gradient buffers opening) beside its whole
        # non-model peak, which they reserve from its start on (rules.forecast). This part
        # is the chunk bytes; the interval adds its non-model peak when it closes.
        self._interval_ws = max(self._interval_ws, self._pinned + self.arrivals.opening_bytes
                                + self.manager.held_grad_bytes)
        if model + non_model > sum(self._interval_top):
            self._interval_top = (model, non_model)
        self.peak = max(self.peak, model + non_model)
        self.non_model_peak = max(self.non_model_peak, non_model)
        if self.device.simulated and self.counts.counting:
            # Until the next sample (every change of model bytes takes one), non-model
            # growth matters only past a peak or past the room left, once there is room
            # for the forecast: the forecast is room for that growth, so it shrinks as
            # they grow.
            m = self.manager
            forecast = m.rules.forecast(m.trace, self.pos, non_model)
            room = self.device.capacity() - model
            self.counter.quiet_below = (-1 if room < non_model + forecast else
                                        min(self._interval_peak, self.peak - model, room))
        return read

    def _chunks_in_use(self) -> tuple[Chunk, ...]:
        # A chunk whose gradients are coming in, into a buffer or kept as they are.
        return tuple(c for c in self.chunks
                     if c.in_use() or c.grad is not None or c.slot_grads)

    # --- points and the intervals between them ------------------------------------------------

    def _point(self, key: int, phase: str, fetch: bool = True) -> None:
        """A module is about to run, with its chunks if `fetch` (engine.step.backward_reads):
        close the trace interval and open the next."""
        self._stop_if_interrupted(phase)
        self._run = None  # the hook that called opens a run at its point
        chunks = self.module_chunks[key] if fetch else ()
        if not self.device.simulated:
            self._sample()  # the allocator's peak since the last sample is the closing one's
        self._close_interval()
        self.pos += 1
        self._parts, self._arrived = [], 0
        if self.manager.trace is not None:
            self.manager.trace.arrived_at(self.pos, 0)
        if self._tracing is not None:
            self._tracing.points.append(TracePoint(
                tuple(c.index for c in chunks), phase,
                grads_to=None if fetch else tuple(c.index for c in self.module_chunks[key])))
        m = self.manager
        self.timeline.append(TimelinePoint(phase, self.module_names[key], 0, 0, 0, 0))
        self._copied_at = (m.bytes_h2d, m.bytes_d2h)
        self._interval_peak = self._interval_ws = self._interval_model = 0
        self._interval_top = (0, 0)

        # Chunks no placement could evict until the next point: in use or about to be.
        def pinned() -> tuple[Chunk, ...]:
            return tuple(c for c in self.chunks if c.in_use() or c in chunks)

        if not self._bounding:  # the working set is sampled
            self._pinned = sum(c.nbytes for c in pinned())
        self._keep_room(pinned)  # before the module's first allocation, not after
        self.counts.mark(m.device_bytes, m.bytes_h2d, m.bytes_d2h)

    def _close_interval(self) -> None:
        """The interval since the latest point ends: its peaks go to the trace being
        recorded, if any, and with the bytes copied in it to the timeline."""
        if self._bounding and 0 <= self.pos:
            self._bound_interval()
        if self._tracing is not None and self._tracing.points:
            self._tracing.points[-1].close(
                [*self._parts, (self._interval_ws, self._interval_peak)])
        if self.timeline:
            point, m = self.timeline[-1], self.manager
            point.model_bytes, point.non_model_bytes = self._interval_top
            point.bytes_h2d = m.bytes_h2d - self._copied_at[0]
            point.bytes_d2h = m.bytes_d2h - self._copied_at[1]

    def _bound_interval(self) -> None:
        """A step where the trace stands in for the count (`_bounding`): the interval's
        top is the most chunk bytes it held beside its traced non-model peak, an upper
        bound of its samples' (which that peak stands in for at each), taken once."""
        points = self.manager.trace.points
        # A step that ran more modules than its trace (a branch taken since) has no traced
        # peak past the trace's end, as its samples had not (Trace.non_model_ahead).
        non_model = points[self.pos].non_model_peak if self.pos < len(points) else 0
        self._interval_top = (self._interval_model, non_model)
        self.peak = max(self.peak, self._interval_model + non_model)
        self.non_model_peak = max(self.non_model_peak, non_model)

    def _on_arrival(self) -> None:
        """A gradient arrives: the interval's next part begins, and the forecast is of
        the peak still to come in it (engine.placement.trace). In a quiet micro-batch,
        where no module boundary is seen in backward, an interrupt stops it here."""
        if not self._in_step:
            return
        if self.manager.quiet:
            self._stop_if_interrupted("backward")
            return
        if self._bounding:  # nothing sampled, no parts: only the forecast moves on
            self._arrived += 1
            self.manager.trace.arrived_at(self.pos, self._arrived)
            return
        self._sample()
        self._parts.append((self._interval_ws, self._interval_peak))
        self._interval_peak = self._interval_ws = 0
        self._arrived += 1
        if self.manager.trace is not None:
            self.manager.trace.arrived_at(self.pos, self._arrived)
        self._sample()

    def _finish_count(self) -> None:
        """The step's peaks: measured, or those of the counted step it matches."""
        if self.manager.quiet:
            self.peak, self.non_model_peak, self.timeline = self.counts.repeat()
            return
        m = self.manager
        self.counts.mark(m.device_bytes, m.bytes_h2d, m.bytes_d2h)
        self.peak, self.non_model_peak, tops = self.counts.finish(
            self.peak, self.non_model_peak, self.timeline)
        for point, (model, non_model) in zip(self.timeline, tops, strict=True):
            point.model_bytes, point.non_model_bytes = model, non_model
