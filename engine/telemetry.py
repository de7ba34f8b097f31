"""What the engine reports: picklable dataclasses shared by the worker, the metrics file and
the UI. Field names are a contract (see DESIGN.md); add fields, never rename."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ChunkInfo:
    index: int
    location: str  # "device" | "host" | "disk" (the payload is in the scratch folder)
    state: str  # the most active TensorState of its parameters
    nbytes: int  # payload bytes (compute dtype)
    frozen: bool = False  # payload only: its parameters need no gradient (LoRA's base)


@dataclass
class MemorySnapshot:
    device_capacity: int  # the budget (simulated) or the real capacity (CUDA), bytes
    device_model: int  # chunk bytes (params, grads, optimizer state) on the device now
    device_non_model_peak: int  # peak activation/workspace bytes on the device in the last step
    device_peak: int  # peak total device bytes in the last step
    host_model: int  # chunk bytes on the host now
    process_rss: int  # the last step's PEAK resident memory of this process, bytes
    # "device"/"host" (and "disk" when a host budget spills) -> TensorState -> parameters
    states: dict[str, dict[str, int]] = field(default_factory=dict)
    chunks: list[ChunkInfo] = field(default_factory=list)
    disk_model: int = 0  # chunk bytes in the scratch folder now (host_budget)
    host_io_buffers: int = 0  # host bytes of the disk tier's I/O buffers (in the host budget)
    # The scratch disk's sequential bandwidth, bytes/s, measured once when the tier opened.
    disk_read_bandwidth: float = 0.0
    disk_write_bandwidth: float = 0.0
    # process_rss is the kernel's high-water mark over the step (Linux); False: a sample of
    # the resident size at the step's end, where the kernel keeps no mark to reset.
    process_rss_exact: bool = True


@dataclass
class TimelinePoint:
    """One interval of a step, from a module boundary to the next, as the device saw it;
    a run of modules that share their chunks (engine.placement.rules.joins_run) is one.

    The same per-interval measurement the warm-up trace records, so a view built from these
    shows where in the step the peak was (forward then backward, module by module)."""

    phase: str  # "forward" | "backward"
    module: str  # qualified name of the module about to run
    # At the interval's peak of device bytes: chunk bytes (payloads, grads, state) and
    # everything else. Their sum is that peak; the step's device_peak is the largest sum.
    model_bytes: int
    non_model_bytes: int
    bytes_h2d: int  # copied to the device in the interval
    bytes_d2h: int  # copied to the host in the interval


@dataclass
class StepStats:
    step: int  # counts from 1; a resumed run keeps counting
    loss: float
    tokens: int
    seconds: float
    forward: float  # seconds, copies excluded
    backward: float
    optimizer: float
    transfer: float  # seconds spent copying chunks between host and device
    bytes_h2d: int
    bytes_d2h: int
    policy: str
    margin_ratio: float
    device_budget: int
    memory: MemorySnapshot
    skipped: bool = False  # fp16: the update was skipped because gradients overflowed
    loss_scale: float = 1.0
    grad_norm: float | None = None
    lr: float = 0.0
    applied: list[str] = field(default_factory=list)  # settings changes that took effect here
    # Gradient accumulation: forward and backward passes summed into this optimizer step;
    # `loss` is their mean and `tokens` their total.
    micro_batches: int = 1
    micro_losses: list[float] = field(default_factory=list)
    activation_checkpointing: bool = False  # whether layers recomputed activations in backward
    # The step interval by interval (the last micro-batch's, with accumulation).
    timeline: list[TimelinePoint] = field(default_factory=list)
    # The disk tier (host_budget): bytes read and written for this step (writes issued;
    # the last ones may finish during the next step), and seconds it waited for the disk.
    bytes_disk_read: int = 0
    bytes_disk_written: int = 0
    disk_wait: float = 0.0
    # Data parallel: chunk bytes this rank exchanged with the others for this step (the
    # other ranks' shards it received by all-gathers, and the bytes it sent into their
    # shards by reduce-scatters); 0 in a single process.
    bytes_gathered: int = 0
    bytes_reduce_scattered: int = 0


def stats_from_dict(data: dict) -> StepStats:
    """Inverse of dataclasses.asdict(StepStats) (for metrics files)."""
    mem = dict(data["memory"])
    mem["chunks"] = [ChunkInfo(**c) for c in mem.get("chunks", [])]
    fields = dict(data)
    fields["memory"] = MemorySnapshot(**mem)
    fields["timeline"] = [TimelinePoint(**p) for p in data.get("timeline", [])]
    return StepStats(**fields)
