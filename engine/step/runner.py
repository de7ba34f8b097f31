"""StepRunner: the hook state machine that drives chunk movement while one step runs.

Forward pre-hooks fetch a module's chunks, forward hooks wrap its outputs so that backward
fetches them again, gradient hooks move each finished gradient into its chunk. A module that
needs the chunks the point before it, of its phase, brought in joins that point (a run,
rules.joins_run): in forward it only marks its parameters in use; in backward, once a step
has seen the runs, the next ones leave those modules' outputs unwrapped. Between two such
module boundaries (a trace *point*) it samples the device's bytes: on the warm-up step that
becomes the trace the placement rules forecast from. In a quiet micro-batch (nothing
counted, every chunk's device copy its home: engine.step.counting) the hooks only watch for
an interrupt and give tied weights their aliases, and the micro-batch reports the last
counted one's peaks and timeline.

What it measures between points, and the room it keeps for what the trace forecasts, is its
measuring part's (engine.step.measuring), which it inherits as the chunk manager inherits
its parts: the hooks call those methods as directly as the runner's own.

The public facade (engine.step.engine.Engine) owns the settings and the optimizer; this
class owns only what happens between the first forward pre-hook and the end of backward.
"""

from __future__ import annotations

import time
from contextlib import nullcontext

import torch

from engine.chunks.chunk import Chunk, Slot
from engine.chunks.manager import ChunkManager
from engine.chunks.state import TensorState
from engine.devices.device import ComputeDevice
from engine.devices.streams import spare_core
from engine.placement import rules
from engine.placement.trace import Trace
from engine.step.activation_checkpointing import is_checkpointing
from engine.step.arrivals import GradientArrivals
from engine.step.backward_reads import BackwardReads
from engine.step.borrowing import watch_borrowing
from engine.step.hooks import hook_gradients, install, wrap_outputs
from engine.step.measuring import Measuring
from engine.step.micro_batches import scaled_loss
from engine.step.optimizer import restore_params

S = TensorState


class StepInterrupted(Exception):
    """`Engine.interrupt()` cut a step short. The engine is as it was before that step:
    weights, optimizer state and step count untouched, so the step can simply run again."""


class StepRunner(Measuring):
    """Runs forward and backward of one step over chunked parameters; see the module doc."""

    # The latest point's phase, chunks needed and chunks its gradients go to (none in
    # forward), which a module of that phase may join (rules.joins_run); None after a
    # recomputing forward's point (activation checkpointing), which none joins.
    _run: tuple[str, tuple[Chunk, ...], tuple[Chunk, ...]] | None = None

    def __init__(self, model: torch.nn.Module, chunks: list[Chunk], device: ComputeDevice, *,
                 borrowed: dict[int, list[torch.nn.Parameter]] | None = None) -> None:
        self.model = model
        self.chunks = chunks
        self.device = device
        self._init_measuring(device)  # counters, peaks, timeline (engine.step.measuring)
        self.manager = ChunkManager(chunks, device, non_model_now=self.non_model_now,
                                    on_change=self._on_model_change)
        self.trace: Trace | None = None  # the latest finished warm-up trace
        self._tracing: Trace | None = None  # the trace being recorded this step
        self._forecast: Trace | None = None  # the manager's trace before this one began
        self.pos = -1  # index of the latest trace point this step
        self.step_number = 0  # the optimizer step this forward and backward are for
        self.forward_seconds = 0.0  # wall time of the latest forward, transfers included
        self._in_step = False
        self._in_backward = False
        self._interrupted = False
        self.slot_of = {id(s.param): (c, s) for c in chunks for s in c.slots}
        self._handles, owned = install(model, pre_forward=self._pre_forward,
                                       post_forward=self._post_forward, borrowed=borrowed,
                                       after_backward=self._after_backward)
        self._grad_hooks: dict[int, object] = {}  # id(param) -> its gradient hook
        self.arrivals = GradientArrivals(model, self.slot_of, self.manager, lambda: self.pos,
                                         on_arrival=self._on_arrival)
        self.tied = self.arrivals.tied  # tied weights: a gradient per use
        self.backward_reads = BackwardReads()  # modules fetched in forward only
        self._modules = list(model.modules())
        self.module_slots: dict[int, list[tuple[Chunk, Slot]]] = {
            k: [self.slot_of[id(p)] for p in ps] for k, ps in owned.items()}
        self.module_chunks: dict[int, tuple[Chunk, ...]] = {
            k: tuple(dict.fromkeys(c for c, _ in pairs)) for k, pairs in self.module_slots.items()}
        self._keys = {id(m): k for k, m in enumerate(model.modules()) if k in owned}
        # Backward runs (rules.joins_run), as a step that wrapped every module output saw
        # them: the module calls (module key, its n-th call this forward) whose backward
        # joined the point before it, and at each such point the modules that joined it.
        # A later step of the trace's key wraps none of those calls (no identity node, no
        # backward point to run) and marks their parameters in use at the run's point.
        self._joined: set[tuple[int, int]] = set()
        self._members: dict[int, list[int]] = {}
        self._runs_for: tuple | None = None  # the step key they were seen for
        self._calls: dict[int, int] = {}  # module key -> its calls so far this forward
        self._skipping = False  # this forward leaves the joining calls unwrapped
        self._polling = False  # joining calls prefetch and read ahead (rules.runs_poll)
        # A traced step: each module's forward point (its own or its run's), by key; and
        # whether a module borrowed a parameter in it (`_borrow`), so that the next traces.
        self._forward_at: dict[int, int] = {}
        self._retrace = False
        names = [name or type(model).__name__ for name, _ in model.named_modules()]
        self.module_names = {k: names[k] for k in owned}  # same order as install's keys

    # --- hook callbacks -----------------------------------------------------------------------

    def interrupt(self) -> None:
        self._interrupted = True

    def _stop_if_interrupted(self, phase: str) -> None:
        if self._interrupted:
            self._interrupted = False
            raise StepInterrupted(f"step {self.step_number} was interrupted in the {phase}")

    def _pre_forward(self, key: int) -> None:
        if not self._in_step:
            # A forward outside step() (evaluation, generation): fetch like the cpu policy,
            # with the running modules' chunks marked in use so that none is evicted.
            self.manager.prepare_outside_step(self.module_chunks[key])
            for chunk, slot in self.module_slots[key]:
                chunk.set_state(slot, S.COMPUTE)
            return
        if self.manager.quiet:
            # Every chunk's copy is its home and nothing is counted: nothing to fetch,
            # make room for or record, so its parameters stay HOLD (engine.step.counting).
            # A tied weight's uses still run on aliases (below): autograd would keep one
            # use's gradient until the last use's arrived, and sum them in another order.
            self._stop_if_interrupted("forward")
        else:
            needed = self.module_chunks[key]
            if not self._in_backward and self._joins("forward", needed, ()):
                self._stop_if_interrupted("forward")
                self._join(needed)
            else:
                self._point(key, "forward")
                # A forward inside backward is activation checkpointing's recompute:
                # gradients may arrive before the next module, and prefetching must leave
                # them room.
                phase = "backward" if self._in_backward else "forward"
                self.manager.prepare(needed, self.pos, phase)
                if not self._in_backward:
                    self._run = ("forward", needed, ())
            for chunk, slot in self.module_slots[key]:
                chunk.set_state(slot, S.COMPUTE)
        if not self._in_backward and self.tied.any:
            self.tied.enter(self._modules[key])
        if self._tracing is not None and not self._in_backward:  # never quiet
            self._forward_at[key] = self.pos
            self.backward_reads.enter(key)

    def _post_forward(self, key: int, output: object) -> object:
        if not self._in_step:
            for chunk, slot in self.module_slots[key]:
                if slot.state == S.COMPUTE:
                    chunk.set_state(slot, S.HOLD)
            return output
        if self.tied.any:
            self.tied.leave(self._modules[key])
        if self.manager.quiet:
            return output  # nothing to fetch in backward either
        if self._tracing is not None:  # watched on traced steps only
            self.backward_reads.leave(key, (s.param for _, s in self.module_slots[key]))
        for chunk, slot in self.module_slots[key]:
            # A borrowed parameter may have been released already by the module it was
            # borrowed from, if that one ran inside this one.
            if slot.state != S.HOLD_AFTER_FWD:
                chunk.set_state(slot, S.HOLD_AFTER_FWD)
        if not torch.is_grad_enabled():
            return output
        call = None  # a recomputed forward's outputs: their backward is never run
        if not self._in_backward:
            call = (key, self._calls.get(key, 0))
            self._calls[key] = call[1] + 1
            if self._skipping and call in self._joined:
                return output  # its backward joins a run: marked in use at the run's point
        return wrap_outputs(output, lambda: self._pre_backward(key, call))

    def _pre_backward(self, key: int, call: tuple[int, int] | None = None) -> None:
        fetch = self.backward_reads.reads(key)
        needed = self.module_chunks[key] if fetch else ()
        if self._joins("backward", needed, self.module_chunks[key]):
            self._stop_if_interrupted("backward")
            if call is not None and not self._skipping:
                self._joined.add(call)
                members = self._members.setdefault(self.pos, [])
                if key not in members:
                    members.append(key)
            self._join(needed)
            self._computing(key, fetch)
            return
        self._point(key, "backward", fetch)
        self._run = ("backward", needed, self.module_chunks[key])
        self.manager.prepare(needed, self.pos, "backward")
        self._computing(key, fetch)
        if self._skipping:  # the modules joining this run, wrapped in no identity node
            for member in self._members.get(self.pos, ()):
                self._computing(member, self.backward_reads.reads(member))

    def _joins(self, phase: str, needed: tuple[Chunk, ...], grads_to: tuple[Chunk, ...]
               ) -> bool:
        """Whether a module of `phase` joins the latest point's run (rules.joins_run)."""
        run = self._run
        return (run is not None and run[0] == phase and self.manager.sharding is None
                and rules.joins_run(needed, grads_to, run[1], run[2]))

    def _join(self, needed: tuple[Chunk, ...]) -> None:
        """A module joins the run: no point of its own. Its chunks are there unless evicted
        since, for room the forecast did not keep: then brought in again, or waited for
        where a fetch ahead brought one in again since (its copy may still be on its way)."""
        m = self.manager
        if any(not c.on_device or c.stale or c.index in m.fetched_ahead for c in needed):
            m.prepare(needed, self.pos)
        if self._polling:  # a copy beside the step may start in room freed mid-run
            m.prefetch(self.pos)
            m.read_ahead(self.pos)

    def _computing(self, key: int, fetch: bool) -> None:
        """The parameters of module `key` are in use for its backward (if it reads them)."""
        for chunk, slot in self.module_slots[key] if fetch else ():
            if slot.state != S.HOLD_AFTER_BWD or self.tied.pending(slot.param):
                chunk.set_state(slot, S.COMPUTE)

    def _after_backward(self, key: int) -> None:  # no gradient will move frozen ones on
        for chunk, slot in self.module_slots[key]:
            if slot.state == S.COMPUTE and not slot.param.requires_grad:
                chunk.set_state(slot, S.HOLD)

    def _borrow(self, running: list[torch.nn.Module], param: torch.nn.Parameter) -> None:
        """A traced forward hands `param` to a function while `running` run: if no hook of
        the innermost hooked one fetches it, that module borrows it from now on, and it is
        fetched at once (engine.step.borrowing)."""
        key = next((self._keys[id(m)] for m in reversed(running) if id(m) in self._keys), None)
        if self._in_backward or key is None or id(param) not in self.slot_of:
            return
        pair = self.slot_of[id(param)]
        if any(s is pair[1] for _, s in self.module_slots[key]):
            return
        chunk, slot = pair
        self.module_slots[key].append(pair)
        self.module_chunks[key] = tuple(dict.fromkeys((*self.module_chunks[key], chunk)))
        self.manager.prepare(self.module_chunks[key], self.pos)
        chunk.set_state(slot, S.COMPUTE)
        # The module's point in the trace (its latest forward one, or the one whose run it
        # joined) needs the chunk too. Which modules join which runs (rules.joins_run) may
        # differ now that the chunk is the module's own: the next step traces again.
        point = self._tracing.points[self._forward_at[key]]
        point.chunks = tuple(dict.fromkeys((*point.chunks, chunk.index)))
        self._retrace = True

    # --- one forward and backward ---------------------------------------------------------

    @property
    def tracing(self) -> bool:
        return self._tracing is not None

    def step_key(self, shape: tuple, checkpointing: bool | None = None) -> tuple:
        """What a trace depends on: the batch shape, activation checkpointing (read from
        the model unless given: reading it walks every module), and which parameters need
        a gradient."""
        if checkpointing is None:
            checkpointing = is_checkpointing(self.model)
        trainable = tuple(s.param.requires_grad for c in self.chunks for s in c.slots)
        return (shape, checkpointing, trainable)

    def begin(self, shape: tuple, *, step: int, accumulate: bool = False,
              checkpointing: bool | None = None) -> bool:
        """Open a forward and backward for optimizer step `step` on a batch of `shape`;
        returns whether it will be traced (the step changed, see step_key). `accumulate`:
        a later micro-batch of the same step, whose gradients add to those already in;
        `checkpointing`: whether the model recomputes activations, if the caller knows."""
        self.step_number = step
        for chunk in self.chunks:
            if chunk.frozen and any(s.param.requires_grad for s in chunk.slots):
                self.manager.thaw(chunk)  # unfrozen since: it needs optimizer state now
        hook_gradients((s.param for c in self.chunks for s in c.slots), self.arrivals.on_grad,
                       self._grad_hooks)
        key = self.step_key(shape, checkpointing)
        tracing = self.trace is None or self.trace.key != key or self._retrace
        self._retrace = False
        self._tracing = Trace(shape, key=key) if tracing else None
        self.arrivals.reset()
        if tracing:
            # A trace of another step is no forecast of this one's activations; it is the
            # forecast again if this step fails (_abort).
            self._forecast, self.manager.trace = self.manager.trace, None
        self.manager.begin_step(tracing=tracing)
        self.pos = -1
        self._run = None
        self._calls = {}
        self._forward_at = {}
        if tracing or self._runs_for != key:
            self._joined.clear()  # seen again by this step, which wraps every output
            self._members.clear()
            self._runs_for = None
        self._polling = rules.runs_poll(
            simulated=self.device.simulated, spare_core=spare_core(),
            payloads_on_disk=any(c.payload_on_disk for c in self.chunks))
        self._skipping = self._runs_for == key and not self._polling
        self._key = key
        self._begin_measuring(tracing=tracing, accumulate=accumulate)
        for chunk in self.chunks:
            chunk.grads_pending = sum(s.param.requires_grad for s in chunk.slots)
            if not accumulate:
                for slot in chunk.slots:
                    slot.got_grad = False
        return tracing

    def forward_backward(self, batch: dict[str, torch.Tensor], loss_scale: float
                         ) -> tuple[torch.Tensor, float, float]:
        """Forward and backward of `batch`; returns (loss, forward transfer seconds, backward
        transfer seconds). On any failure the chunks are left as before the step."""
        m = self.manager
        self.model.train()
        self._in_step = True
        try:
            # Every op's allocations, counted on the simulated device; on CUDA the
            # allocator counts them itself (AllocatorReadings), with no work per op.
            counting = (self.counter if self.device.simulated and self.counts.counting
                        else nullcontext())
            watch = watch_borrowing(self.model, self._borrow) if self.tracing else nullcontext()
            saved = self.backward_reads.watching() if self.tracing else nullcontext()
            with counting, watch, saved:
                t0, x0 = time.perf_counter(), m.transfer_seconds
                loss = self.model(**batch).loss
                self.forward_seconds = time.perf_counter() - t0
                x1 = m.transfer_seconds
                self._in_backward = True
                scaled_loss(loss, loss_scale).backward()
            self._finish_backward()
            self._close_interval()
            self._finish_count()
            if not (self._skipping or self.manager.quiet):  # every output was wrapped
                self._runs_for = self._key
            x2 = m.transfer_seconds
        except BaseException:
            self._abort()
            raise
        finally:
            self._in_step = self._in_backward = self._bounding = False
            m.end_step()
        return loss, x1 - x0, x2 - x1

    def _finish_backward(self) -> None:
        m = self.manager
        for chunk in self.chunks:
            # Parameters that got no gradient leave no chunk waiting.
            if chunk.slot_grads:
                chunk.holds_grads = True
            self.arrivals.close(chunk)
            m.finish_grads(chunk)
            for slot in chunk.slots:
                if slot.state in (S.COMPUTE, S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD):
                    chunk.set_state(slot, S.HOLD)
        m.end_backward()  # data parallel: the gradient reductions still waiting
        m.release_all()  # device copies are outdated by the update that follows
        # Gradients sent home land before the optimizer reads them.
        m.transfer_seconds += self.device.settle_host()

    def _abort(self) -> None:
        """Leave the chunks consistent after a failed forward/backward: no grads, no copies."""
        self.device.settle_host()
        self.tied.leave_all()
        for chunk in self.chunks:
            self.manager.drop_grad(chunk)
            self.manager.drop_slot_grads(chunk)
            if chunk.holds_grads:
                restore_params(chunk)
                if not chunk.resident:
                    chunk.mark_stale()
            self.manager.free_grad_home(chunk)
            for slot in chunk.slots:
                if slot.state not in (S.FREE, S.HOLD):
                    slot.state = S.HOLD  # reset after a failure; not a transition
                slot.param.grad = None
            chunk.computing = 0
        self.manager.release_all()
        if self._tracing is not None:
            self.manager.trace = self._forecast
            self._retrace = True  # the trace this step was to record is still owed
        self._tracing = None
        self.counter.reset()
        self.counts.abort()

    def end_trace(self) -> Trace | None:
        """Close the trace this step recorded, if any, and hand it to the placement rules.
        Returns it with the manager's overrun (bytes it could not make room for)."""
        trace, self._tracing = self._tracing, None
        if trace is None:
            return None
        trace.finish()
        self.trace = trace
        self.manager.use_trace(trace)
        return trace

    def remove_hooks(self) -> None:
        for handle in [*self._handles, *self._grad_hooks.values()]:
            handle.remove()
        self._handles, self._grad_hooks = [], {}
