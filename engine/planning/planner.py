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
manager's rules (fetch before use, evict the chunk used farthest ahead, gradient buffers until
a chunk's last gradient is in, optimizer state resident for cuda and the margin, room kept
for the traced non-model peak), in bytes only.

Decoder stacks repeat one layer, so a large model is traced with TRACE_LAYERS layers and its
inner layer is repeated in the recording: opt-30b plans in about as long as opt-125m.

Data parallel (`nproc` ranks, engine.distributed): every rank holds one shard of each chunk
(padded to split evenly), gathers a chunk whole for each use and reduce-scatters its
gradients, on its part of the global batch. Every rank then runs the same step, so the plan
is one rank's: its device peak, its host peak (and the machine's, for `nproc` ranks on one
machine, which `host_mem` is checked against), and the bytes it gathers and reduce-scatters
per step (engine.planning.sharded). A host budget is each rank's too, for its shards: the
disk figures are one rank's, in a scratch folder of its own.

The recording is engine.planning.recording's, the replay engine.planning.replay's; this module turns
the bytes into a Plan.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine.config import PRECISIONS, format_size, parse_size
from engine.devices.cuda import DEFAULT_STAGING
from engine.devices.disk import default_disk_dir, space_needed
from engine.models.zoo import meta_model, model_config
from engine.placement import rules
from engine.placement.policy import Policy
from engine.placement.trace import Trace
from engine.planning import disk
from engine.planning.recording import Event, record_step
from engine.planning.replay import (
    ChunkBytes,
    DiskPayloads,
    Layout,
    OutOfMemory,
    StepReplay,
    model_layout,
    resident_chunks,
    sharded_layout,
)

__all__ = ["Plan", "PolicyPlan", "Recommendation", "plan"]

# Decoder layers traced for a deeper model: the first, one inner layer that stands for every
# inner layer, and the last.
TRACE_LAYERS = 3

# Resident bytes of a training process before any model: Python, torch, transformers and the
# autograd engine. Measured (VmHWM) on Linux, torch 2.13: 331 MiB right after the imports,
# about 400 MiB after a few steps of `tiny`, whose model and activations are ~25 MB of that.
RUNTIME_BYTES = 370 * 2**20
# What a process that uses CUDA adds to its host memory (driver, context, kernels). Not
# measured here (no GPU on the machine this was calibrated on); a typical figure.
CUDA_CONTEXT = 500 * 2**20
# Page-locked host memory a CUDA device holds for the whole run: its staging ring, through
# which every copy streams (engine.devices.transfers), whatever the model's size.
PINNED_STAGING = DEFAULT_STAGING.buffers * DEFAULT_STAGING.buffer_bytes

# Freed blocks an allocator keeps beyond the live bytes the engine counts, as a share of the
# step's non-model peak (every live byte but model data: activations, gradients in flight,
# backward temporaries). On the simulated device the host's malloc keeps them: calibrated on
# the peak RSS of simulated runs of opt-125m, batch 2 x 128: 0.40 (auto, fp32), 0.45 (cpu,
# fp32), 0.63 (cpu, bf16). A GPU's caching allocator rounds and caches blocks too; assumed
# alike (not measured on a GPU).
ALLOCATOR_SLACK = 0.5

# Share of the spare device memory a recommended margin leaves to the allocator on a real
# GPU, which rounds and fragments while other processes come and go. The simulated device
# is exact and may be filled.
CUDA_HEADROOM = 0.10
MARGIN_STEP = 0.1  # margins the recommendation compares


@dataclass
class PolicyPlan:
    """The forecast for one placement policy."""

    policy: str
    device_peak: int  # peak device bytes of a step: model data + activations
    host_peak: int  # peak resident bytes of the training process (RSS)
    host_model: int  # chunk bytes on the host between steps (MemorySnapshot.host_model)
    copied: int  # bytes copied between host and device per step (bytes_h2d + bytes_d2h)
    fits: bool
    reason: str = ""  # why it does not fit, with the numbers; empty when it fits
    # The disk tier (a host budget): the I/O buffers the host budget holds beside host_model
    # (MemorySnapshot.host_io_buffers), the chunk bytes in the scratch folder
    # (MemorySnapshot.disk_model), and what a steady step reads and writes there.
    io_buffers: int = 0
    disk_bytes: int = 0
    disk_read: int = 0
    disk_written: int = 0
    # Data parallel: bytes per step are one rank's. The other ranks' shards it receives by
    # all-gathers, and what it sends into theirs by reduce-scatters (StepStats
    # .bytes_gathered, .bytes_reduce_scattered); the ranks on one machine.
    gathered: int = 0
    reduce_scattered: int = 0
    ranks: int = 1

    @property
    def machine_host_peak(self) -> int:
        """Resident bytes of all the ranks together, when they share one machine."""
        return self.ranks * self.host_peak


@dataclass
class Recommendation:
    policy: str | None  # None when no policy fits
    margin_ratio: float
    why: str  # one line


@dataclass
class Plan:
    """What `plan` found. Byte counts are for one step at the given batch shape."""

    model: str
    precision: str
    batch_size: int
    seq_len: int
    checkpointing: bool
    device_mem: int
    host_mem: int  # the memory the machine has: what host_peak must stay within
    simulated: bool  # the device lives in host memory, so device bytes count towards host_peak
    parameters: int
    chunk_size: int  # elements per chunk (searched like the engine does)
    chunks: int
    model_bytes: int  # payload + fp32 master + moments of every chunk
    working_set: int  # least device bytes any policy needs: chunks in use, gradients, activations
    non_model_peak: int  # activations: peak bytes saved for backward, plus the latest output
    cuda: PolicyPlan
    cpu: PolicyPlan
    auto: PolicyPlan
    recommended: Recommendation
    host_budget: int | None = None  # chunk bytes + I/O buffers on the host; None: no limit
    disk_dir: str | None = None  # where the scratch folder goes (with a host budget)
    # Bytes the scratch folder may need (every chunk on the host: what the engine checks
    # before it starts, whatever the policy); 0 when the host budget holds everything.
    disk_needed: int = 0
    disk_free: int | None = None  # free bytes where the scratch folder goes; None: not asked
    # Data parallel ranks. Above 1, batch_size is the global batch (each rank trains on
    # batch_size / nproc sequences), and every byte count of the policies, working_set and
    # non_model_peak are one rank's (model_bytes stays the whole model's).
    nproc: int = 1
    # Micro-batches of batch_size sequences per step (gradient accumulation): the memory of
    # one, whatever their number (the host budget holds at any), the disk traffic of all.
    grad_accum: int = 1

    @property
    def uses_disk(self) -> bool:
        return self.disk_needed > 0

    @property
    def policies(self) -> dict[str, PolicyPlan]:
        return {"cuda": self.cuda, "cpu": self.cpu, "auto": self.auto}

    def to_dict(self) -> dict:
        """The plan as plain data: one entry per policy, the recommendation, the inputs."""
        out: dict = {
            name: {
                "device_peak": p.device_peak,
                "host_peak": p.host_peak,
                "fits": p.fits,
                "reason": p.reason,
                "host_model": p.host_model,
                "copied": p.copied,
                "io_buffers": p.io_buffers,
                "disk_bytes": p.disk_bytes,
                "disk_read": p.disk_read,
                "disk_written": p.disk_written,
            }
            for name, p in self.policies.items()
        }
        if self.nproc > 1:
            for name, p in self.policies.items():
                out[name].update(gathered=p.gathered, reduce_scattered=p.reduce_scattered,
                                 machine_host_peak=p.machine_host_peak)
            out["nproc"] = self.nproc
        out["recommended"] = asdict(self.recommended)
        for key in (
            "model",
            "precision",
            "batch_size",
            "seq_len",
            "checkpointing",
            "device_mem",
            "host_mem",
            "simulated",
            "parameters",
            "chunk_size",
            "chunks",
            "model_bytes",
            "working_set",
            "non_model_peak",
            "host_budget",
            "disk_dir",
            "disk_needed",
            "disk_free",
            "grad_accum",
        ):
            out[key] = getattr(self, key)
        return out


# --- the plan ---------------------------------------------------------------------------


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
        host_mem: int,
        simulated: bool,
        host_budget: int | None = None,
        disk_dir: Path | None = None,
        grad_accum: int = 1,
    ) -> None:
        self.lay, self.events, self.cost = lay, events, cost
        self.grad_accum = grad_accum
        self.device_mem, self.host_mem, self.simulated = device_mem, host_mem, simulated
        self.host_budget, self.disk_dir = host_budget, disk_dir
        self.ranks = cost.world  # sharded: every figure is one rank's, its chunks' shards
        homes = [cost.home(n) for n in lay.numel]
        self.disk_piece = disk.piece(homes, cost.itemsize, host_budget)
        self.disk_costs = disk.chunk_costs(homes, cost.itemsize, self.disk_piece)
        self._placements: dict[frozenset[int], rules.DiskPlacement] = {}
        # The engine places every chunk on the host first (ChunkManager.use_host_budget):
        # a budget too small for that is refused before anything runs, whatever the policy
        # (rules.HostBudgetTooSmall), and so is a scratch folder without room for it.
        worst = self.placement(set())
        self.disk_needed = worst.disk_bytes if worst.state else 0
        self.disk_free = (disk.free_space(disk_dir) if self.disk_needed and disk_dir is not None
                          else None)
        self.runtime = RUNTIME_BYTES + (0 if simulated else CUDA_CONTEXT + PINNED_STAGING)
        self.capacity = device_mem
        self.slack = self._allocator_slack()
        if not simulated:
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
            warm = StepReplay(
                self.lay,
                cost=self.cost,
                policy=policy,
                capacity=capacity,
                resident=resident_chunks(self.lay, self.cost, policy, 0.0, 0, None),
            )
            warm.run(self.events)
            trace = warm.trace_of()
            if warm.overrun > 0 or trace.working_set > capacity:
                return _Outcome(policy, warm, trace, self._too_small(trace), warm.resident)
        resident = resident_chunks(
            self.lay, self.cost, policy, margin_ratio, int(min(capacity, 2**62)), trace
        )
        step = StepReplay(
            self.lay,
            cost=self.cost,
            policy=policy,
            capacity=capacity,
            resident=resident,
            trace=trace,
            disk=self.disk_payloads(resident),
        )
        try:
            step.run(self.events)
        except OutOfMemory as error:
            return _Outcome(
                policy, step, trace, f"out of device memory mid-step: {error}", resident
            )
        return _Outcome(policy, step, trace, "", resident)

    def _allocator_slack(self) -> int:
        """Bytes the allocator holds beyond the live bytes of a step (ALLOCATOR_SLACK).

        The recording counts every live byte (engine.step.non_model), so what is left is
        the allocator's: on the simulated device host memory, on a GPU device memory.
        """
        non_model = self.run(Policy.CPU, float("inf")).trace.non_model_peak
        return int(ALLOCATOR_SLACK * non_model)

    def _too_small(self, trace: Trace) -> str:
        return (
            f"device budget {format_size(self.device_mem)} is below the minimum working "
            f"set {format_size(self.working_set(trace))} (chunks in use, gradients and "
            f"activations)"
        )

    def working_set(self, trace: Trace) -> int:
        """The least device memory a step needs, as the engine will measure it."""
        return trace.working_set + (0 if self.simulated else self.slack)

    def device_peak(self, step: StepReplay) -> int:
        return step.peak + (0 if self.simulated else self.slack)

    def placement(self, resident: set[int]) -> rules.DiskPlacement:
        """Where the parts of the chunks not in `resident` are under the host budget."""
        key = frozenset(resident)
        if key not in self._placements:
            self._placements[key] = disk.placement(self.disk_costs, key, self.host_budget)
        return self._placements[key]

    def disk_payloads(self, resident: set[int]) -> DiskPayloads:
        """The payloads on disk when `resident` stay on the device, as the read-ahead sees
        them: half the payload buffers may hold pieces read ahead (Spill.read_ahead)."""
        where = self.placement(resident)
        slots = rules.payload_buffers(where.aliased) // 2 if where.payload else 0
        return DiskPayloads(where.payload, [c.pieces for c in self.disk_costs], slots)

    def host_model(self, resident: set[int]) -> int:
        """Chunk bytes on the host between steps (those on disk not counted)."""
        return self.placement(resident).host_bytes

    def built(self, outcome: _Outcome) -> int:
        """Host bytes while the engine builds: every chunk's host state at once, whatever
        the policy (resident chunks move to the device afterwards).

        Under a host budget the engine fills the chunks one at a time, last used first,
        and sends each one's parts where the placement with nothing resident puts them
        before the next (ChunkManager.use_host_budget): the peak is then the model's own
        fp32 parameters not yet packed, the parts kept so far, one chunk's whole state and
        the I/O buffers that carry them. Sharded, the same with this rank's shards."""
        if self.host_budget is None:
            if self.cost.sharded:
                return self._built_shards()
            return sum(self.cost.host(n) for n in self.lay.numel)
        worst = self.placement(set())
        lay = self.lay
        # The model's own fp32 parameters not yet packed (sharded: every rank holds the
        # whole model, and packs its shards).
        own = ([4 * sum(lay.sizes[p] for p in ps) for ps in lay.params] if self.cost.sharded
               else [4 * n for n in lay.numel])
        unpacked = sum(own)
        kept = peak = 0
        for index in reversed(range(len(lay.numel))):
            numel = lay.numel[index]
            unpacked -= own[index]
            peak = max(peak, unpacked + kept + self.cost.host(numel))
            level, cost = worst.level(index), self.disk_costs[index]
            kept += (self.cost.host(numel), cost.host_payload, 0)[level]
        return max(peak, kept) + worst.buffer_bytes

    def _built_shards(self) -> int:
        """Host bytes while a rank builds: it holds the whole model in fp32, and fills its
        shard of each chunk in use order, freeing the chunk's parameters once copied
        (engine.chunks.packing.fill); with few ranks the shards outgrow the model, with
        many the model itself is the peak."""
        lay = self.lay
        unpacked = 4 * sum(lay.sizes.values())
        kept = peak = 0
        for index, numel in enumerate(lay.numel):
            peak = max(peak, unpacked + kept + self.cost.host(numel))
            unpacked -= 4 * sum(lay.sizes[p] for p in lay.params[index])
            kept += self.cost.host(numel)
        return max(peak, kept)

    def during(self, outcome: _Outcome) -> int:
        """Host bytes during a steady step, the runtime aside.

        The host holds the non-resident chunks' parts that are not on disk and the disk
        tier's I/O buffers and, when the device is simulated, the device's bytes and the
        allocator's slack too. The update of a chunk in a 16-bit precision reads its
        gradients as fp32, one chunk at a time.
        """
        chunks = self.placement(outcome.resident).host_total
        largest = self.cost.home(max(self.lay.numel, default=0))
        update = 0 if self.cost.aliased else 4 * largest
        during = chunks + update
        if self.simulated:
            during = max(during, chunks + outcome.step.peak + self.slack)
        return during

    def host_peak(self, outcome: _Outcome) -> int:
        """Resident bytes of the training process (sharded: of one rank) at its peak."""
        return self.runtime + max(self.built(outcome), self.during(outcome))

    def host_fits(self, host_peak: int) -> bool:
        """Whether the machine holds the peak of every rank at once (they share it)."""
        return self.ranks * host_peak <= self.host_mem

    def disk_traffic(self, outcome: _Outcome) -> disk.DiskTraffic:
        step = outcome.step
        return disk.traffic(self.placement(outcome.resident), self.disk_costs,
                            [self.cost.home(n) for n in self.lay.numel],
                            fetches=step.fetches, updated=step.home, unused=step.unused_reads,
                            piece=self.disk_piece, micro_batches=self.grad_accum)

    def _disk_reason(self) -> str:
        """Why the scratch folder cannot take what the host budget sends it, or "".
        Sharded, every rank on the machine has a folder of its own there."""
        if self.disk_free is None:
            return ""
        if problem := disk.folder_problem(self.disk_dir):
            return problem
        needed = space_needed(self.disk_needed)  # the engine's check: its probe counted
        if self.ranks * needed <= self.disk_free:
            return ""
        need = format_size(needed)
        if self.cost.sharded:
            need = f"{format_size(self.ranks * needed)} ({need} per rank)"
        return (
            f"the host budget {format_size(self.host_budget)} needs {need} on disk, but "
            f"{self.disk_dir} has {format_size(self.disk_free)} free"
        )

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
        if not reason and not self.host_fits(host_peak):
            need = f"needs {format_size(host_peak)} of host memory"
            if self.cost.sharded:
                need = (f"{self.ranks} ranks need {format_size(self.ranks * host_peak)} of "
                        f"host memory, {format_size(host_peak)} each")
            reason = (
                f"{need} ({self._host_parts(outcome)}), have {format_size(self.host_mem)}"
            )
        reason = reason or self._disk_reason()
        where, io = self.placement(outcome.resident), self.disk_traffic(outcome)
        row = PolicyPlan(
            policy=policy.value,
            device_peak=int(device_peak),
            host_peak=int(host_peak),
            host_model=self.host_model(outcome.resident),
            copied=outcome.step.copied,
            fits=not reason,
            reason=reason,
            io_buffers=where.buffer_bytes,
            disk_bytes=where.disk_bytes,
            disk_read=io.read,
            disk_written=io.written,
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
        model_data = sum(self.cost.resident_cost(n) for n in self.lay.numel)
        beside = trace.working_set if self.cost.sharded else trace.non_model_peak
        return model_data, beside + (0 if self.simulated else self.slack)

    def _host_parts(self, outcome: _Outcome) -> str:
        if self.built(outcome) > self.during(outcome):
            holds = ("the model's own weights until they are packed, beside the parts "
                     "kept so far" if self.host_budget is not None or self.cost.sharded
                     else "all of them at once")
            return (f"building the chunks holds {holds}, "
                    f"{format_size(self.built(outcome))} + runtime {format_size(self.runtime)}")
        where = self.placement(outcome.resident)
        parts = [f"chunks {format_size(where.host_bytes)}"]
        if where.buffer_bytes:
            parts.append(f"disk I/O buffers {format_size(where.buffer_bytes)}")
        if self.simulated:
            parts.append(f"simulated device {format_size(outcome.step.peak)}")
            parts.append(f"allocator slack {format_size(self.slack)}")
        parts.append(f"runtime {format_size(self.runtime)}")
        return " + ".join(parts)

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
            if tried.failure or not self.host_fits(self.host_peak(tried)):
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
            included; disk_read and disk_written are the whole step's.

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
        config, dtype, batch_size // nproc, seq_len, checkpointing, trace_layers=TRACE_LAYERS
    )
    full = meta_model(model_name_or_path)
    whole = model_layout(full, events, chunk_size)
    lay = sharded_layout(whole, nproc)
    planner = _Planner(
        lay,
        events,
        cost=ChunkBytes(dtype.itemsize, nproc),
        device_mem=device_bytes,
        host_mem=host_bytes,
        simulated=simulated,
        host_budget=budget,
        disk_dir=folder,
        grad_accum=grad_accum,
    )
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
        model_bytes=sum(ChunkBytes(dtype.itemsize).host(n) for n in whole.numel),
        working_set=planner.working_set(trace),
        non_model_peak=trace.non_model_peak,
        cuda=plans["cuda"],
        cpu=plans["cpu"],
        auto=plans["auto"],
        recommended=planner.recommend(plans, outcomes["auto"]),
        host_budget=budget,
        disk_dir=str(folder) if folder is not None else None,
        disk_needed=planner.disk_needed,
        disk_free=planner.disk_free,
        nproc=nproc,
        grad_accum=grad_accum,
    )
