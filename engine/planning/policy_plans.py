"""Each policy's plan: one recording replayed under a placement policy, its bytes a row.

Under each policy the warm-up step is replayed first (no trace: the least recently used
chunk is evicted, an overrun noted), then, where its working set fits, a steady step with
the trace it recorded and the chunks the margin keeps resident (engine.planning.replay).
The steady step's bytes become the policy's PolicyPlan (engine.planning.report): the device
peak, the host's (engine.planning.host_memory), the copies and the disk's I/O, or why it
does not fit (a budget below the working set or below what the largest module needs, a
cuda policy whose model data or activations do not fit, a host or scratch folder too
small), with what the policy would need given room to spare.

The allocator keeps freed blocks beyond the live bytes the engine counts: on a GPU device
memory the chunks cannot have (the engine's own rule), on the simulated device host memory
(ALLOCATOR_SLACK of the non-model peak). Both are added here, where the bytes become a row.

The recommendation: cuda where everything fits, none where cpu does not, cpu where auto
could keep next to nothing beyond the working set, else auto at the margin that copies
least, searched in MARGIN_STEPs (leaving CUDA_HEADROOM to a GPU's allocator).
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.config import format_size
from engine.devices.buffer_pool import settled_fresh
from engine.devices.cuda import allocator_slack
from engine.placement import rules
from engine.placement.policy import Policy
from engine.placement.trace import Trace
from engine.planning.host_memory import HostMemory
from engine.planning.layout import ChunkBytes, Layout, resident_chunks
from engine.planning.recording import Event
from engine.planning.replay import OutOfMemory, StepReplay
from engine.planning.report import PolicyPlan, Recommendation
from engine.planning.sharded import ShardedReplay

__all__ = ["PolicyPlans"]

# Freed blocks an allocator keeps beyond the live bytes the engine counts, as a share of the
# step's non-model peak (every live byte but model data: activations, gradients in flight,
# backward temporaries). On the simulated device the host's malloc keeps them: calibrated on
# the peak RSS of simulated runs of opt-125m, batch 2 x 128: 0.40 (auto, fp32), 0.45 (cpu,
# fp32), 0.63 (cpu, bf16). A GPU's is the engine's own rule (engine.devices.cuda
# .allocator_slack: a share of the budget, measured there), so that plan and engine agree.
ALLOCATOR_SLACK = 0.5

# Share of the spare device memory a recommended margin leaves to the allocator on a real
# GPU, which rounds and fragments while other processes come and go. The simulated device
# is exact and may be filled.
CUDA_HEADROOM = 0.10
MARGIN_STEP = 0.1  # margins the recommendation compares


@dataclass
class _Moved:
    """Bytes a step moves: copied between host and device, of them the fetches ahead of use
    from host memory, and, data parallel, gathered and reduce-scattered."""

    copied: int
    prefetched: int
    gathered: int = 0
    reduce_scattered: int = 0

    @classmethod
    def of(cls, step: StepReplay, times: int = 1) -> _Moved:
        """What `step` (a micro-batch) moved, `times` over."""
        sharding = step.sharding
        return cls(times * step.copied, times * step.prefetched,
                   times * sharding.gathered if sharding is not None else 0,
                   times * sharding.reduce_scattered if sharding is not None else 0)

    def __add__(self, other: _Moved) -> _Moved:
        return _Moved(self.copied + other.copied, self.prefetched + other.prefetched,
                      self.gathered + other.gathered,
                      self.reduce_scattered + other.reduce_scattered)


@dataclass
class _Outcome:
    policy: Policy
    # The step's first micro-batch: its memory is every one's, but for the device's peak,
    # which is the highest of any (_accumulated).
    step: StepReplay
    trace: Trace
    failure: str  # why the device cannot run it; "" when it can
    resident: set[int]
    moved: _Moved  # the whole step's, every micro-batch's (where it ran)


class PolicyPlans:
    """Replays one recording under each placement and turns the bytes into a Plan's
    rows and its recommendation."""

    def __init__(
        self,
        lay: Layout,
        events: list[Event],
        *,
        cost: ChunkBytes,
        device_mem: int,
        host: HostMemory,
    ) -> None:
        self.lay, self.events, self.cost, self.host = lay, events, cost, host
        self.device_mem, self.simulated = device_mem, host.simulated
        self.ranks = cost.world  # sharded: every figure is one rank's, its chunks' shards
        self.capacity = device_mem
        self.slack = self._allocator_slack()
        if not self.simulated:
            # Blocks a GPU's allocator keeps are device memory the chunks cannot have.
            self.capacity = max(0, device_mem - self.slack)
        # Before its first step the engine asks for the chunks of its largest module, twice
        # (Engine.min_working_set without a trace).
        self.first_need = rules.minimum_working_set(
            None, [sum(lay.numel[c] * cost.itemsize for c in cs)
                   for cs in lay.module_chunks.values()])

    def run(
        self,
        policy: Policy,
        capacity: float,
        margin_ratio: float = 0.0,
        trace: Trace | None = None,
    ) -> _Outcome:
        """The warm-up step (unless its trace is given), then a steady step."""
        if trace is None:
            warm = self._replay(
                policy, capacity, resident_chunks(self.lay, self.cost, policy, 0.0, 0, None))
            warm.run(self.events)
            trace = warm.trace_of()
            if warm.overrun > 0 or trace.working_set > capacity:
                return _Outcome(policy, warm, trace, self._too_small(trace), warm.resident,
                                _Moved.of(warm))
        resident = resident_chunks(
            self.lay, self.cost, policy, margin_ratio, int(min(capacity, 2**62)), trace
        )
        step = self._replay(policy, capacity, resident, trace)
        try:
            step.run(self.events)
            moved = self._accumulated(step)
        except OutOfMemory as error:
            return _Outcome(policy, step, trace, f"out of device memory mid-step: {error}",
                            resident, _Moved.of(step))
        return _Outcome(policy, step, trace, "", resident, moved)

    def _accumulated(self, first: StepReplay) -> _Moved:
        """The bytes a step of `grad_accum` micro-batches moves: the first's, and each later
        one's, which fetches (and gathers) again what it needs (bf16/fp16: from the fp32
        master, its gradients being home) and adds its gradients to those there
        (engine.step.engine.Engine.step). Every later one starts where the one before left
        the chunks, so they are alike."""
        later = self.host.grad_accum - 1
        if not later:
            return _Moved.of(first)
        again = first.later_micro_batch()
        again.run(self.events)
        # A later one starts with what the first left on the device (resident chunks keep
        # their gradients there), so its peak may be the step's.
        first.peak = max(first.peak, again.peak)
        return _Moved.of(first) + _Moved.of(again, later)

    def _replay(self, policy: Policy, capacity: float, resident: set[int],
                trace: Trace | None = None) -> StepReplay:
        """A replay of the warm-up step (no trace) or of a steady one, which reads the
        payloads the host budget sends to disk; sharded, with its data-parallel side."""
        return StepReplay(
            self.lay,
            cost=self.cost,
            policy=policy,
            capacity=capacity,
            resident=resident,
            trace=trace,
            disk=self.host.disk_payloads(resident) if trace is not None else None,
            sharding=ShardedReplay if self.cost.sharded else None,
            grads_land_in_step=self.host.grads_land_in_step,
            simulated=self.simulated,
        )

    def _allocator_slack(self) -> int:
        """Bytes the allocator holds beyond the live bytes of a step.

        The recording counts every live byte (engine.step.non_model), so what is left is
        the allocator's: on the simulated device host memory (ALLOCATOR_SLACK of the
        non-model peak), on a GPU device memory (what CudaDevice leaves it of the budget).
        """
        if not self.simulated:
            return allocator_slack(self.device_mem, self.device_mem)
        non_model = self.run(Policy.CPU, float("inf")).trace.non_model_peak
        return int(ALLOCATOR_SLACK * non_model)

    def _too_small(self, trace: Trace) -> str:
        """Why no policy fits, by part: at the interval that needs most, the chunks in use
        with the gradient buffers they open, and the activations (every non-model byte)."""
        widest = max(trace.points, key=lambda p: p.working_set)
        chunks = widest.working_set - widest.non_model_peak
        return (
            f"device budget {format_size(self.device_mem)} is below the minimum working "
            f"set {format_size(self.working_set(trace))} (chunks in use and their gradient "
            f"buffers {format_size(chunks)} + activations "
            f"{format_size(self.working_set(trace) - chunks)} in {widest.phase})"
        )

    def working_set(self, trace: Trace) -> int:
        """The least device memory a step needs, as the engine will measure it."""
        return trace.working_set + (0 if self.simulated else self.slack)

    def device_peak(self, step: StepReplay) -> int:
        return step.peak + (0 if self.simulated else self.slack)

    def host_peak(self, outcome: _Outcome) -> int:
        return self.host.peak(outcome.resident, *self._device_in_host(outcome.step),
                              placed_first=self._placed_first(outcome.policy))

    def _placed_first(self, policy: Policy) -> frozenset[int]:
        """rules.built_on_device: built there under a host budget, and the disk tier opens
        only for the rest."""
        costs = [self.cost.resident_cost(n, self.lay.is_frozen(c))
                 for c, n in enumerate(self.lay.numel)]
        return frozenset(rules.built_on_device(policy, costs, capacity=int(self.capacity),
                                               sharded=self.cost.sharded))

    def _device_in_host(self, step: StepReplay) -> tuple[int, int]:
        """The simulated device's host bytes at the step's peak (its pool of kept buffers
        and the rest, with the allocator's slack, and the gradients landed on the host by
        then where they land at every step: StepReplay.host_step_bytes), and those that
        stay through the update (engine.devices.buffer_pool). On CUDA the device's bytes
        are not the host's: the step's peak, which the host ignores."""
        if not self.simulated:
            return step.peak + self.slack, 0
        return step.host_step_bytes + self.slack, step.host_device_between_steps

    def policy_plan(self, policy: Policy, margin_ratio: float) -> tuple[PolicyPlan, _Outcome]:
        outcome = self.run(policy, self.capacity, margin_ratio)
        if policy == Policy.CUDA:
            reason = self._cuda_reason(outcome)
        else:
            reason = outcome.failure
            if not reason and self.capacity < self.first_need:
                reason = (
                    f"device budget {format_size(self.device_mem)} is below the "
                    f"{format_size(self.first_need)} the largest module needs with its "
                    f"gradients"
                )
        if reason:
            # Report what the policy would need with room to spare; auto needs what cpu does.
            needs = self.run(Policy.CPU if policy == Policy.AUTO else policy, float("inf"))
            device_peak = max(self.device_peak(needs.step), self.working_set(needs.trace))
            if policy == Policy.CUDA:
                device_peak = max(device_peak, sum(self._cuda_need(needs.trace)))
            host_peak = self.host_peak(needs)
        else:
            device_peak, host_peak = self.device_peak(outcome.step), self.host_peak(outcome)
        if not reason and not self.host.fits(host_peak):
            need = f"needs {format_size(host_peak)} of host memory"
            if self.cost.sharded:
                need = (f"{self.ranks} ranks need {format_size(self.ranks * host_peak)} of "
                        f"host memory, {format_size(host_peak)} each")
            parts = self.host.parts(outcome.resident, *self._device_in_host(outcome.step),
                                    placed_first=self._placed_first(policy))
            reason = f"{need} ({parts}), have {format_size(self.host.host_mem)}"
        # The engine opens its disk tier where the policy's placement before any trace
        # needs one (ChunkManager.use_host_budget): every policy's but cuda's, which keeps
        # every chunk on the device (or does not fit, the reason above); with ranks, every
        # policy's.
        reason = reason or self.host.disk_reason(set(self._placed_first(policy)))
        step = outcome.step
        where = self.host.placement(outcome.resident)
        io = self.host.disk_traffic(outcome.resident, step.fetches, step.home, step.unused_reads)
        row = PolicyPlan(
            policy=policy.value,
            device_peak=int(device_peak),
            host_peak=int(host_peak),
            host_model=self.host.host_model(outcome.resident),
            landed_grads=self.host.landed(outcome.resident),
            copied=outcome.moved.copied,
            prefetched=outcome.moved.prefetched,
            device_buffers=outcome.step.pool.peak if self.simulated else 0,
            fresh=(settled_fresh(step.pool.limit, step.resident_buffers, step.buffer_moves)
                   if self.simulated else 0),
            fits=not reason,
            reason=reason,
            io_buffers=where.buffer_bytes,
            disk_bytes=where.disk_bytes,
            disk_read=io.read,
            disk_written=io.written,
            disk_update=io.update,
            disk_later_read=io.later_read,
            update_beside=bool(where.state) and not where.payload,
        )
        if self.cost.sharded:
            row.gathered = outcome.moved.gathered
            row.reduce_scattered = outcome.moved.reduce_scattered
            row.ranks = self.ranks
        return row, outcome

    def _cuda_reason(self, outcome: _Outcome) -> str:
        """Why every chunk cannot stay on the device, or "".

        The engine refuses cuda up front when the chunks with room for their gradients
        exceed the budget, and fails the first step when activations do not fit beside them.
        With several micro-batches it refuses the two together (rules.cuda_need) once the
        first has traced, before a later one runs: their peak is there
        (rules.cuda_peaks_beside_gradients), as the replay of a later one finds.
        Sharded, only the shards are resident: the chunks gathered for each use and their
        gradient buffers come on top (Engine._check_budget), so those are in the need.
        """
        model_data, activations = self._cuda_need(outcome.trace)
        sharded = self.cost.sharded
        together = sharded or rules.cuda_peaks_beside_gradients(self.host.grad_accum)
        # The activations count a GPU's allocator slack already: held to the whole device.
        if not outcome.failure and (model_data + activations <= self.device_mem if together
                                    else model_data <= self.capacity):
            return ""
        what = ("the working set (gathered chunks, their gradients and activations)"
                if sharded else "activations")
        shards = " shards" if sharded else ""
        return (
            f"needs {format_size(model_data + activations)} on the device (model data"
            f"{shards} {format_size(model_data)} with its gradients + {what} "
            f"{format_size(activations)}), have {format_size(self.device_mem)}"
        )

    def _cuda_need(self, trace: Trace) -> tuple[int, int]:
        """(model data, activations) the cuda policy keeps on the device (cuda_policy_bytes);
        sharded, (the shards, the working set)."""
        model_data, beside = rules.cuda_need(
            [self.cost.resident_cost(n, self.lay.is_frozen(c))
             for c, n in enumerate(self.lay.numel)],
            trace=trace, working_set=trace.working_set, sharded=self.cost.sharded)
        return model_data, beside + (0 if self.simulated else self.slack)

    def recommend(self, plans: dict[str, PolicyPlan], auto: _Outcome) -> Recommendation:
        if plans["cuda"].fits:
            return Recommendation(
                "cuda",
                0.0,
                "everything fits on the device: no copies, and the optimizer runs there",
            )
        if not plans["cpu"].fits:
            tight = plans["cpu"].reason
            return Recommendation(
                None,
                0.0,
                f"nothing fits: {tight}; try a smaller batch "
                f"or sequence, --checkpointing, or more memory",
            )
        spare = self.capacity - auto.trace.working_set
        smallest = min(n * self.cost.itemsize for n in self.lay.numel)
        if not plans["auto"].fits or spare < 2 * smallest:
            return Recommendation(
                "cpu",
                0.0,
                f"only {format_size(max(0, spare))} beyond the "
                f"working set: auto could keep next to nothing, and cpu is "
                f"the steadier policy",
            )
        # Resident chunks are never copied and update on the device, but take room from the
        # idle chunks auto would keep: the margin that copies least per step wins, the larger
        # one on a tie.
        top = 1.0 if self.simulated else 1.0 - CUDA_HEADROOM
        best, best_ratio = auto, 0.0
        for k in range(1, int(round(top / MARGIN_STEP)) + 1):
            ratio = round(k * MARGIN_STEP, 2)
            tried = self.run(Policy.AUTO, self.capacity, ratio, trace=auto.trace)
            if tried.failure or not self.host.fits(self.host_peak(tried)):
                continue
            if tried.moved.copied <= best.moved.copied and tried.resident != best.resident:
                best, best_ratio = tried, ratio
        if not best.resident:
            return Recommendation(
                "auto",
                0.0,
                f"auto keeps idle chunks in the {format_size(spare)} beyond the working set; "
                f"optimizer state there would only make it copy more",
            )
        return Recommendation(
            "auto",
            best_ratio,
            f"margin {best_ratio:g} keeps the optimizer state of {len(best.resident)} of "
            f"{len(self.lay.numel)} chunks on the device and copies "
            f"{format_size(best.moved.copied)} per step ({format_size(auto.moved.copied)} "
            f"without); predicted peak {format_size(self.device_peak(best.step))} of "
            f"{format_size(self.device_mem)}",
        )
