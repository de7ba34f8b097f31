"""Planner: the device and host memory a run will need, per policy, before anything runs.

    p = plan("opt-1.3b", device_mem=6 * 2**30, host_mem=32 * 2**30, precision="bf16")
    p.cpu.device_peak, p.cpu.host_peak, p.cpu.fits, p.recommended.policy
    p = plan("opt-1.3b", device_mem=6 * 2**30, host_mem=24 * 2**30, host_budget=8 * 2**30)
    p.cpu.disk_bytes, p.cpu.disk_read, p.disk_needed, p.disk_free
    p = plan("opt-1.3b", device_mem=6 * 2**30, host_mem=64 * 2**30, batch_size=8, nproc=4)
    p.cpu.device_peak, p.cpu.host_peak, p.cpu.machine_host_peak, p.cpu.gathered

With a host budget (EngineConfig.host_budget) the chunk bytes on the host and the disk
tier's I/O buffers stay within it and the rest goes to the scratch folder, as the engine's
placement rules decide (engine.planning.disk replays them); the host peak is then checked
against `host_mem`, the memory the machine has.

Nothing is allocated. The step is run once on the meta device (shapes and dtypes, no data)
through the engine's own hooks, which records what the engine would see:
the modules in the order they run, every byte an op allocates and frees (counted the way the
engine counts non-model bytes on the simulated device), and when each gradient arrives. That
recording is then replayed against the engine's own chunk layout under each policy, with the
manager's rules (fetch before use, evict the chunk used farthest ahead, gradient buffers, or
autograd's gradients kept, until a chunk's last gradient is in, optimizer state resident for
cuda and the margin, room kept for the traced non-model peak), in bytes only.

Decoder stacks repeat one layer, so a large model is traced with TRACE_LAYERS layers and its
inner layer is repeated in the recording: opt-30b plans in about as long as opt-125m.

Data parallel (`nproc` ranks, engine.distributed): every rank holds one shard of each chunk
(padded to split evenly), gathers a chunk whole for each use and reduce-scatters its
gradients, on its part of the global batch. Every rank then runs the same step, so the plan
is one rank's: its device peak, its host peak (and the machine's, for `nproc` ranks on one
machine, which `host_mem` is checked against), and the bytes it gathers and reduce-scatters
per step (engine.planning.sharded). A host budget is each rank's too, for its shards: the
disk figures are one rank's, in a scratch folder of its own.

The recording is engine.planning.recording's, the layout engine.planning.layout's, the
replay engine.planning.replay's (sharded, with engine.planning.sharded over it) and the
host's side engine.planning.host_memory's; this module runs the replay per policy and
turns the bytes into a Plan (engine.planning.report).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import PRECISIONS, format_size, parse_size
from engine.devices.buffer_pool import settled_fresh
from engine.devices.cuda import allocator_slack
from engine.devices.disk import default_disk_dir
from engine.models.lora import Lora, apply_lora
from engine.models.zoo import meta_model, model_config
from engine.placement import rules
from engine.placement.policy import Policy
from engine.placement.trace import Trace
from engine.planning.host_memory import HostMemory
from engine.planning.layout import (
    ChunkBytes,
    Layout,
    model_layout,
    resident_chunks,
    sharded_layout,
)
from engine.planning.recording import Event, record_step
from engine.planning.replay import OutOfMemory, StepReplay
from engine.planning.report import Plan, PolicyPlan, Recommendation
from engine.planning.sharded import ShardedReplay

__all__ = ["Plan", "PolicyPlan", "Recommendation", "plan"]

# Decoder layers traced for a deeper model: the first, one inner layer that stands for every
# inner layer, and the last.
TRACE_LAYERS = 3

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
class _Outcome:
    policy: Policy
    step: StepReplay
    trace: Trace
    failure: str  # why the device cannot run it; "" when it can
    resident: set[int]


class _Planner:
    """Replays one recording under each placement and turns the bytes into a Plan."""

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
                return _Outcome(policy, warm, trace, self._too_small(trace), warm.resident)
        resident = resident_chunks(
            self.lay, self.cost, policy, margin_ratio, int(min(capacity, 2**62)), trace
        )
        step = self._replay(policy, capacity, resident, trace)
        try:
            step.run(self.events)
        except OutOfMemory as error:
            return _Outcome(
                policy, step, trace, f"out of device memory mid-step: {error}", resident
            )
        return _Outcome(policy, step, trace, "", resident)

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
        return self.host.peak(outcome.resident, *self._device_in_host(outcome.step))

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
            parts = self.host.parts(outcome.resident, *self._device_in_host(outcome.step))
            reason = f"{need} ({parts}), have {format_size(self.host.host_mem)}"
        reason = reason or self.host.disk_reason()
        step = outcome.step
        where = self.host.placement(outcome.resident)
        io = self.host.disk_traffic(outcome.resident, step.fetches, step.home, step.unused_reads)
        row = PolicyPlan(
            policy=policy.value,
            device_peak=int(device_peak),
            host_peak=int(host_peak),
            host_model=self.host.host_model(outcome.resident),
            landed_grads=self.host.landed(outcome.resident),
            copied=outcome.step.copied,
            prefetched=outcome.step.prefetched,
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
            sharding = outcome.step.sharding
            row.gathered, row.reduce_scattered = sharding.gathered, sharding.reduce_scattered
            row.ranks = self.ranks
        return row, outcome

    def _cuda_reason(self, outcome: _Outcome) -> str:
        """Why every chunk cannot stay on the device, or "".

        The engine refuses cuda up front when the chunks with room for their gradients
        exceed the budget, and fails the first step when activations do not fit beside them.
        Sharded, only the shards are resident: the chunks gathered for each use and their
        gradient buffers come on top (Engine._check_budget), so those are in the need.
        """
        model_data, activations = self._cuda_need(outcome.trace)
        sharded = self.cost.sharded
        if not outcome.failure and (model_data + activations <= self.capacity if sharded
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
        model_data = sum(self.cost.resident_cost(n, self.lay.is_frozen(c))
                         for c, n in enumerate(self.lay.numel))
        beside = trace.working_set if self.cost.sharded else trace.non_model_peak
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
            if tried.step.copied <= best.step.copied and tried.resident != best.resident:
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
            f"{format_size(best.step.copied)} per step ({format_size(auto.step.copied)} "
            f"without); predicted peak {format_size(self.device_peak(best.step))} of "
            f"{format_size(self.device_mem)}",
        )


def plan(
    model_name_or_path: str,
    *,
    device_mem: int | str,
    host_mem: int | str,
    precision: str = "bf16",
    batch_size: int = 2,
    seq_len: int = 128,
    checkpointing: bool = False,
    simulated: bool | None = None,
    chunk_size: int | None = None,
    margin_ratio: float = 0.0,
    host_budget: int | str | None = None,
    disk_dir: str | Path | None = None,
    nproc: int = 1,
    grad_accum: int = 1,
    lora: Lora | None = None,
) -> Plan:
    """Forecast a training step's device and host memory under each policy.

    Args:
        model_name_or_path: a zoo name or a local model folder (only its config is read).
        device_mem: device memory in bytes or as text ("6GiB"): the budget the engine gets.
        host_mem: host memory in bytes or as text: what the machine has, which the training
            process's peak (runtime, chunks, a simulated device) must stay within.
        precision: compute dtype of the chunks, "fp32", "bf16" or "fp16".
        batch_size, seq_len: the batch shape; activations scale with both.
        checkpointing: whether the model recomputes its layers in backward.
        simulated: whether the device lives in host memory (the simulated device); None
            means "when there is no CUDA", as the engine decides.
        chunk_size: elements per chunk; None searches it as the engine does.
        margin_ratio: the margin the cpu and auto rows are planned with (the recommendation
            picks its own).
        host_budget: the engine's host budget (EngineConfig.host_budget): chunk bytes and
            the disk tier's I/O buffers on the host; what does not fit goes to disk. None:
            no budget, nothing on disk.
        disk_dir: where the scratch folder would go (EngineConfig.disk_dir); None means the
            engine's default. Only its free space is read.
        nproc: data-parallel ranks (engine.distributed). Above 1 the plan is one rank's:
            `batch_size` is the global batch, which must split evenly over the ranks;
            `device_mem` is each rank's device; `host_mem` is the machine's, which every
            rank's host peak shares (ranks on one machine). A host budget is then each
            rank's, for its shards, and so are the disk figures.
        grad_accum: micro-batches of `batch_size` sequences per step (EngineConfig's):
            the memory is one micro-batch's whatever their number, the host budget
            included, but for the fp32 gradients' host buffers a later micro-batch starts
            with (HostMemory.grads_land_in_step); disk_read and disk_written are the whole
            step's.
        lora: LoRA adapters (engine.models.lora) as the run adds them: the base weights
            frozen, in payload-only chunks, and only the adapters with gradients and
            optimizer state. None: every parameter trains.

    Nothing is allocated: the model only ever exists on the meta device.

    Raises:
        engine.models.zoo.UnknownModel, engine.models.zoo.BadCheckpoint: the model cannot
            be found or read.
        ValueError: a size, precision or batch shape that makes no sense.
        engine.placement.rules.HostBudgetTooSmall: a host budget below what the host needs
            with every part that may go to disk on disk (a ValueError, with the numbers).
    """
    from engine.config import check_margin
    from engine.step.engine import DTYPES

    margin_ratio = check_margin(margin_ratio)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    device_bytes, host_bytes = parse_size(device_mem), parse_size(host_mem)
    if device_bytes <= 0 or host_bytes <= 0:
        raise ValueError("device and host memory must be positive")
    budget = parse_size(host_budget) if host_budget is not None else None
    if budget is not None and budget <= 0:
        raise ValueError("host_budget must be positive")
    folder = None
    if budget is not None:
        folder = Path(disk_dir).expanduser() if disk_dir is not None else default_disk_dir()
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be a whole number of micro-batches, at least 1, "
                         f"not {grad_accum!r}")
    if batch_size < 1 or seq_len < 2:
        raise ValueError(
            f"batch_size must be at least 1 and seq_len at least 2, not {batch_size} and {seq_len}"
        )
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a whole number of ranks, at least 1, not {nproc!r}")
    if batch_size % nproc:
        raise ValueError(f"batch_size {batch_size} does not split evenly over {nproc} ranks; "
                         f"use a multiple of {nproc}")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, not {chunk_size}")
    config = model_config(model_name_or_path)
    positions = getattr(config, "max_position_embeddings", None)
    if positions and seq_len > positions:
        raise ValueError(
            f"seq_len {seq_len} is longer than the {positions} positions of {model_name_or_path}"
        )
    if simulated is None:
        simulated = not torch.cuda.is_available()
    dtype = DTYPES[precision]

    events = record_step(
        config, dtype, batch_size // nproc, seq_len, checkpointing, trace_layers=TRACE_LAYERS,
        lora=lora,
    )
    full = meta_model(model_name_or_path)
    if lora is not None:
        full = apply_lora(full, lora)
    whole = model_layout(full, events, chunk_size)
    lay = sharded_layout(whole, nproc)
    cost = ChunkBytes(dtype.itemsize, nproc)
    host = HostMemory(lay, cost=cost, host_mem=host_bytes, simulated=simulated,
                      host_budget=budget, disk_dir=folder, grad_accum=grad_accum)
    planner = _Planner(lay, events, cost=cost, device_mem=device_bytes, host=host)
    plans, outcomes = {}, {}
    for policy in Policy:
        plans[policy.value], outcomes[policy.value] = planner.policy_plan(policy, margin_ratio)
    trace = outcomes["cpu"].trace
    return Plan(
        model=model_name_or_path,
        precision=precision,
        batch_size=batch_size,
        seq_len=seq_len,
        checkpointing=checkpointing,
        device_mem=device_bytes,
        host_mem=host_bytes,
        simulated=simulated,
        parameters=sum(lay.sizes.values()),
        chunk_size=lay.chunk_size,
        chunks=len(lay.numel),
        model_bytes=sum(ChunkBytes(dtype.itemsize).host(n, whole.is_frozen(c))
                        for c, n in enumerate(whole.numel)),
        working_set=planner.working_set(trace),
        non_model_peak=trace.non_model_peak,
        cuda=plans["cuda"],
        cpu=plans["cpu"],
        auto=plans["auto"],
        recommended=planner.recommend(plans, outcomes["auto"]),
        host_budget=budget,
        disk_dir=str(folder) if folder is not None else None,
        disk_needed=host.disk_needed,
        disk_free=host.disk_free,
        build_peak=host.runtime + host.built(),
        nproc=nproc,
        grad_accum=grad_accum,
        lora=lora,
    )
