"""What the planner found: a forecast per placement policy, the recommendation, the Plan.

engine.planning.planner fills these in; the application shows them (and `to_dict` gives
them as plain data, for --json).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.models.lora import Lora

__all__ = ["Plan", "PolicyPlan", "Recommendation"]


@dataclass
class PolicyPlan:
    """The forecast for one placement policy."""

    policy: str
    device_peak: int  # peak device bytes of a step: model data + activations
    host_peak: int  # peak resident bytes of the training process (RSS)
    host_model: int  # chunk bytes on the host between steps (MemorySnapshot.host_model)
    # Bytes copied between host and device per step, every micro-batch's (bytes_h2d +
    # bytes_d2h).
    copied: int
    fits: bool
    reason: str = ""  # why it does not fit, with the numbers; empty when it fits
    # Of `copied`, the fetches ahead of use from host memory (StepReplay.prefetched).
    prefetched: int = 0
    # The simulated device's chunk buffers at a step's peak, in use and kept for reuse: host
    # memory for the whole run (engine.devices.buffer_pool); 0 on a real device.
    device_buffers: int = 0
    # The simulated device's buffer bytes per micro-batch that its pool cannot serve in a
    # settled step (StepReplay.settled_fresh): fresh pages, each faulted in and zeroed.
    fresh: int = 0
    # The disk tier (a host budget): the I/O buffers the host budget holds beside host_model
    # (MemorySnapshot.host_io_buffers), the chunk bytes in the scratch folder
    # (MemorySnapshot.disk_model), and what a steady step reads and writes there.
    io_buffers: int = 0
    disk_bytes: int = 0
    disk_read: int = 0
    disk_written: int = 0
    # Of those, what the step waits for (engine.planning.disk.DiskTraffic): the update's
    # reads and writes, less the state read ahead, and accumulation's later reads.
    disk_update: int = 0
    disk_later_read: int = 0
    # Whether the update of the chunks whose state is on disk runs beside the next step's
    # forward (engine.chunks.disk_side.overlap_update: state on disk and no payload there,
    # which the forward would read); else the step waits for it.
    update_beside: bool = False
    # Data parallel: bytes per step (every micro-batch's) are one rank's. The other ranks'
    # shards it receives by all-gathers, and what it sends into theirs by reduce-scatters
    # (StepStats.bytes_gathered, .bytes_reduce_scattered); the ranks on one machine.
    gathered: int = 0
    reduce_scattered: int = 0
    ranks: int = 1
    # fp32 gradients' host landing places where they exist from their landing to the update
    # (engine.placement.rules.grads_land_per_step): in host_peak, not in host_model.
    landed_grads: int = 0

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
    # one, whatever their number (the host budget holds at any), but for the fp32 gradients'
    # host buffers a later one starts with and the device's peak, the highest one's; the
    # copies and the disk traffic of all.
    grad_accum: int = 1
    # Resident bytes of the training process while the engine builds the chunks (runtime
    # included): the model is never whole in host memory, only the chunk state kept so
    # far (under a host budget, at most the budget), one chunk and one tensor read.
    build_peak: int = 0
    lora: Lora | None = None  # the adapters a LoRA run trains; None: every parameter trains

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
                "landed_grads": p.landed_grads,
                "copied": p.copied,
                "prefetched": p.prefetched,
                "fresh": p.fresh,
                "io_buffers": p.io_buffers,
                "disk_bytes": p.disk_bytes,
                "disk_read": p.disk_read,
                "disk_written": p.disk_written,
                "disk_update": p.disk_update,
                "disk_later_read": p.disk_later_read,
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
            "build_peak",
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
