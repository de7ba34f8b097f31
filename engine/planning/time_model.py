"""The time model: a plan's row (engine.planning.planner.PolicyPlan) in seconds per step.

    times = step_times(p, calibration())   # policy -> StepTime, for a Plan p
    times["auto"].total, times["auto"].parts()

A step is `grad_accum` micro-batches of forward and backward, then one update:

- compute: matmul FLOPs at the calibrated throughput of the precision and the model's width,
  the bytes other ops read and write at the device's elementwise bandwidth, the random
  numbers they draw (dropout's masks) at the device's rate of drawing them, times the
  factor and plus the offset a real decoder measured (engine.planning.calibration), and the
  engine's own cost per op (engine.planning.flops counts both; engine.planning.calibration measures
  the rates), forward, backward and the forward recomputed under activation
  checkpointing; on the simulated device also the new memory its large tensors take at
  the rate a real decoder's took (a run's steady heap maps every tensor of a MiB or more
  afresh: engine.devices.host_memory);
- copies each way: the plan's copied bytes, the whole step's (fetches to the device, each
  micro-batch's, gradients back for the chunks updated on the host, which every
  micro-batch sends) at the calibrated bandwidths; on the simulated device, also
  the fresh pages of the chunk buffers its pool cannot serve and of the host's gradient
  landing places, at the probe's rate of new memory;
- the update: AdamW over the elements updated on the host and on the device;
- the disk tier: what the plan reads and writes there per step, and of it what the step
  waits for (the update's reads and writes, at the rate the disk does both at once);
- collectives (data parallel): what a rank gathers and reduce-scatters.

Overlap is the device's: on CUDA the copies stream on their own engine while kernels run,
so only what exceeds the compute is exposed; the simulated device runs its fetches ahead of
use on a copy thread beside the step where a core is left beside torch's threads, and
every other copy in line (a memcpy on the stepping thread). The disk tier's reads and
writes run on threads beside the step: on CUDA beside the kernels; on the simulated device
the payloads read ahead and the gradients written behind run beside the compute, and the
update's reads and writes beside one forward where the update flies (the next step's). A
CUDA rank's collectives run beside the kernels too.

Every part is then multiplied by the calibration's correction: what runs on this machine
measured against their forecasts (engine.planning.calibration.learn).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.devices.streams import spare_core
from engine.placement.rules import grads_land_per_step
from engine.planning.calibration import Calibration
from engine.planning.flops import StepWork, step_work
from engine.planning.hardware import ADAMW_BYTES

__all__ = ["StepTime", "forecast", "step_times"]

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class StepTime:
    """Predicted seconds of one optimizer step, by cause. Every part is its whole duration;
    `overlap` is the part of them that runs at the same time as another and so does not
    add to the step: total = sum of the parts - overlap."""

    forward: float
    backward: float
    recompute: float
    copy_h2d: float
    copy_d2h: float
    optimizer_host: float
    optimizer_device: float
    disk: float
    collectives: float
    overlap: float
    source: str  # the calibration's: "this machine's calibration" or a hardware profile's specs

    @property
    def compute(self) -> float:
        return self.forward + self.backward + self.recompute

    @property
    def total(self) -> float:
        return (self.compute + self.copy_h2d + self.copy_d2h + self.optimizer_host
                + self.optimizer_device + self.disk + self.collectives - self.overlap)

    def parts(self) -> dict[str, float]:
        """The total and every part, in seconds (what `tuitrain plan --json` prints)."""
        names = ("forward", "backward", "recompute", "copy_h2d", "copy_d2h", "optimizer_host",
                 "optimizer_device", "disk", "collectives", "overlap")
        return {"total": self.total, **{n: getattr(self, n) for n in names}}


@dataclass(frozen=True)
class Traffic:
    """What one step moves and updates, as the plan replayed it (one rank's)."""

    copied: int  # bytes between host and device per step (all its micro-batches), both ways
    updated_on_host: int  # parameters whose AdamW update runs on the host
    updated_on_device: int
    itemsize: int  # bytes per element of the compute dtype (gradients copied back)
    # Of those on the host, the parameters whose optimizer state is on disk: their update
    # computes a piece while the tier reads the next and writes the last.
    updated_on_disk: int = 0
    disk_read: int = 0
    disk_written: int = 0
    # Of those, what the step waits for (engine.planning.disk.DiskTraffic): the update's
    # reads and writes, and accumulation's later reads.
    disk_update: int = 0
    disk_later_read: int = 0
    communicated: int = 0  # bytes gathered and reduce-scattered per step
    # Bytes of new device buffers per micro-batch (simulated: PolicyPlan.fresh): chunk
    # buffers the pool could not serve, each page faulted in and zeroed by the system when
    # the copy first writes it. The replay counts such bytes (StepReplay.settled_fresh):
    # none under cpu, whose few buffers the pool keeps; under auto at a tight budget, where
    # idle copies fill the device beyond what the pool may keep, most of them (opt-125m at
    # 4 x 128 in 1 GiB: 660 MiB per micro-batch).
    fresh: int = 0
    # Of `copied`, the fetches ahead of use from host memory (PolicyPlan.prefetched).
    prefetched: int = 0
    # The update of the chunks whose state is on disk runs beside the next step's forward
    # (PolicyPlan.update_beside); False: the step waits for it.
    update_beside: bool = True
    # The host's fp32 gradient landing places, one per chunk updated there, are made in a
    # step and freed after its update (engine.placement.rules.grads_land_per_step: fp32,
    # one process, no disk tier): new memory once a step, however many micro-batches land
    # in them. On the simulated device opt-125m's under auto at 1 GiB (478 MiB) took 0.04 s
    # a step to free alone, and its copies 0.13 s a step where the bytes copied forecast
    # 0.02.
    grads_land_per_step: bool = False


def forecast(work: StepWork, traffic: Traffic, cal: Calibration, *, precision: str,
             simulated: bool, grad_accum: int = 1, copies_beside: bool = True) -> StepTime:
    """Seconds of one step of `grad_accum` micro-batches, each of `work`. `copies_beside`:
    the simulated device has a core for its copy thread (engine.devices.streams
    .spare_core); without one, its fetches ahead of use run in line too."""
    micro = max(1, grad_accum)

    def kernels(phase: str) -> float:  # "forward", "backward" or "recompute"
        return cal.kernel_seconds(precision, work.hidden, getattr(work, f"{phase}_flops"),
                                  getattr(work, f"{phase}_bytes"),
                                  getattr(work, f"{phase}_random"))

    # Forward and backward at the calibration's factor and offset (fitted on a decoder at
    # two depths), shared between them by their kernels; the recomputed forward at the
    # factor alone (the offset is each micro-batch's, once).
    plain = kernels("forward") + kernels("backward")
    scale = cal.compute_seconds(precision, plain) / plain if plain > 0 else 0.0
    share = (work.forward_flops + work.backward_flops + work.recompute_flops) or 1.0

    def seconds(phase: str, factor: float = scale) -> float:
        work_seconds = factor * kernels(phase)
        # The engine's own work per op runs on the host: in line with the ops on the
        # simulated device; on CUDA beside the kernels it queued, which run asynchronously.
        host = work.ops * getattr(work, f"{phase}_flops") / share * cal.op_overhead
        if not simulated:  # a GPU's caching allocator hands out memory it keeps
            return micro * max(work_seconds, host)
        fresh = cal.activation_seconds(getattr(work, f"{phase}_fresh"))
        return micro * (work_seconds + host + fresh)

    forward, backward = seconds("forward"), seconds("backward")
    recompute = seconds("recompute", cal.factor(precision))
    # Gradients come back to the host for the chunks updated there, every micro-batch's
    # (a later one's are added to the first's there, each coming over from the device):
    # the plan counts them all among the step's copies. The rest are fetches, and the sums
    # of gradients on disk coming back.
    d2h_bytes = min(traffic.copied, micro * traffic.updated_on_host * traffic.itemsize)
    h2d = ((traffic.copied - d2h_bytes) / cal.h2d
           + micro * cal.fresh_seconds(traffic.fresh))
    d2h = d2h_bytes / cal.d2h
    if simulated and traffic.grads_land_per_step:  # a GPU's land in pinned memory it keeps
        d2h += cal.fresh_seconds(4 * traffic.updated_on_host)
    # Outside fp32 the update first reads each gradient as fp32 and after it writes the
    # weights back in the compute dtype (engine.step.optimizer): per element 4 + itemsize
    # bytes each, at the bandwidth the update itself moves its bytes at. The fp32 copies
    # go into one buffer of the largest chunk's size, kept through the update: new memory
    # once a step, not for every gradient (opt-125m in bf16 on the simulated device: the
    # update took 0.20-0.21 s a step with a new tensor per gradient, 0.11-0.14 s with the
    # buffer, where AdamW alone forecast 0.05).
    cast = 0.0 if traffic.itemsize >= 4 else 2 * (4 + traffic.itemsize) / ADAMW_BYTES
    opt_host = traffic.updated_on_host * (1 + cast) / cal.adamw_host
    opt_device = traffic.updated_on_device * (1 + cast) / cal.adamw_device
    disk = traffic.disk_read / (cal.disk_read or cal.h2d) if traffic.disk_read else 0.0
    if traffic.disk_written:
        disk += traffic.disk_written / (cal.disk_write or cal.d2h)
    # What the step waits for: the update's reads and writes, which the tier's two threads
    # run at once (each piece read ahead, the last written behind), and accumulation's
    # later reads, in line. Payloads read ahead and gradients written behind run beside the
    # compute. The opt-125m and Llama-shaped updates with half their chunks on disk (fp32,
    # x1) moved 1.7-2.3 GiB/s both ways together, by the tier's clocks, where the probe of
    # both at once read 2.4 (and one way after the other, on newly written blocks, 1.5).
    waits = traffic.disk_later_read / (cal.disk_read or cal.h2d)
    if traffic.disk_update:
        waits += traffic.disk_update / (cal.disk_duplex or cal.disk_read or cal.h2d)
    waits = min(disk, waits)
    # Collectives go through host memory on the simulated device (gloo) and over the
    # interconnect on GPUs; the copy bandwidth stands for both (not measured apart).
    collectives = traffic.communicated / min(cal.h2d, cal.d2h)
    compute = forward + backward + recompute
    overlap = 0.0
    if not simulated:
        overlap += min(h2d + d2h, compute)  # copies stream beside the kernels
        overlap += min(collectives, compute)
    if simulated:
        # Fetches ahead of use run on the simulated device's copy thread, beside the
        # modules that compute meanwhile (engine.devices.streams.CopyingHostStreams).
        if copies_beside:
            overlap += min(traffic.prefetched / cal.h2d, compute)
        # The disk tier reads payloads ahead and writes gradients behind beside the compute;
        # the step waits for the update's I/O, except where the update of the chunks whose
        # state is on disk flies beside the next step's first forward (engine.chunks.flight:
        # none of their payload on disk). In fp32 the payload is the master and goes to disk
        # with the state, and the step waits (opt-125m cpu at 1 GiB with half the chunks on
        # disk, x1: 0.86-0.96 s of the step's 0.93-1.04 s of disk waits in the update).
        overlap += min(disk - waits, compute)
        beside = min(waits, forward / micro) if traffic.update_beside else 0.0
        # The update's AdamW over the pieces on disk runs while the tier moves the pieces
        # around them: inside the waits the step would otherwise sit through (opt-125m with
        # half its chunks on disk: about 0.03 s a step).
        on_disk = traffic.updated_on_disk * (1 + cast) / cal.adamw_host
        overlap += beside + min(on_disk, waits - beside)
    else:
        # The disk tier reads ahead and writes behind on threads, beside the GPU's kernels.
        overlap += min(disk, compute + opt_host + opt_device)
    times = StepTime(forward=forward, backward=backward, recompute=recompute, copy_h2d=h2d,
                     copy_d2h=d2h, optimizer_host=opt_host, optimizer_device=opt_device,
                     disk=disk, collectives=collectives, overlap=overlap, source=cal.source)
    return corrected(times, cal.correction)


def corrected(times: StepTime, factor: float) -> StepTime:
    """`times` with every part multiplied by `factor` (so the parts still add up)."""
    if factor == 1.0:
        return times
    return dataclasses.replace(times, **{
        f.name: getattr(times, f.name) * factor for f in dataclasses.fields(times)
        if f.name != "source"})


def step_times(plan: object, cal: Calibration, *, grad_accum: int | None = None
               ) -> dict[str, StepTime]:
    """The forecast of each of `plan`'s rows (an engine.planning.planner.Plan), policy ->
    StepTime; `grad_accum` micro-batches of the plan's batch per step (None: the plan's,
    whose bytes copied are those of its own micro-batches)."""
    if grad_accum is None:
        grad_accum = getattr(plan, "grad_accum", 1)
    from engine.models.zoo import model_config

    lora = getattr(plan, "lora", None)
    work = step_work(model_config(plan.model), _DTYPES[plan.precision],
                     batch_size=plan.batch_size // plan.nproc, seq_len=plan.seq_len,
                     checkpointing=plan.checkpointing, lora=lora)
    itemsize = _DTYPES[plan.precision].itemsize
    # A rank's share of the chunks' state; what is on neither host nor disk is on the
    # device, whose chunks update there.
    state = plan.model_bytes / plan.nproc
    # What AdamW updates and what sends gradients back: a LoRA run's adapters alone (its
    # frozen chunks get no gradient, so they copy nothing out and update nothing).
    parameters = (work.trainable if lora is not None else plan.parameters) / plan.nproc
    lands_per_step = grads_land_per_step(aliased=plan.precision == "fp32",
                                         sharded=plan.nproc > 1,
                                         disk_tier=plan.host_budget is not None)
    out = {}
    for name, row in plan.policies.items():
        off_device = ((row.host_model + row.landed_grads + row.disk_bytes) / state
                      if state else 1.0)
        on_device = 1.0 if name == "cuda" else min(1.0, max(0.0, 1.0 - off_device))
        traffic = Traffic(
            copied=row.copied, itemsize=itemsize,
            updated_on_host=int(parameters * (1.0 - on_device)),
            updated_on_device=int(parameters * on_device),
            updated_on_disk=int(parameters * min(1.0 - on_device, row.disk_bytes / state)
                                if state else 0),
            disk_read=row.disk_read, disk_written=row.disk_written,
            disk_update=row.disk_update, disk_later_read=row.disk_later_read,
            communicated=row.gathered + row.reduce_scattered,
            fresh=row.fresh,
            prefetched=row.prefetched,
            update_beside=row.update_beside,
            grads_land_per_step=lands_per_step,
        )
        out[name] = forecast(work, traffic, cal, precision=plan.precision,
                             simulated=plan.simulated, grad_accum=grad_accum,
                             copies_beside=spare_core())
    return out
