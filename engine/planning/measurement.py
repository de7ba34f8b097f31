"""A calibration measured now (`measure`): every figure of this machine's `Calibration`
(engine.planning.speeds), all together in at most TIME_LIMIT seconds.

What is measured, each on the engine's own path: matmuls per compute dtype at a few widths
on the compute device; the bytes per second that ops other than matmuls write there; how
fast it draws random numbers (dropout's masks); how fast the system hands out new host
memory (a page faulted in, zeroed and unmapped); copies each way through the device's
transfers (the staging ring on CUDA); PyTorch's fused AdamW, the engine's update, on the
host and on the device; the disk tier's steady reads and writes in the scratch folder, each
way and both at once; a real decoder's forward and backward at two depths, against what
those rates forecast for it, in this process's heap and, on the simulated device, in a
process of its own whose heap maps nothing afresh (what the activations' new memory costs
is their difference); and the engine's own cost per module interval (hooks, chunk states),
from a few steps of the `tiny` model. What memory's speed sets, and the disk, are measured
in two windows apart (`_MemorySpeeds`; the disk's probe is engine.planning.disk_speed's): a
machine's memory and disk move from moment to moment.

What each probe does and why is told where it lives: the matmuls here, the other single
operations and the engine's own cost in engine.planning.probes, the disk in
engine.planning.disk_speed, the decoder in engine.planning.reference_decoder; each repeats
for its share of the time limit (engine.planning.clock). Keeping the figures, and learning
from runs, is engine.planning.calibration's.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone

import torch

from engine.planning.clock import _Clock
from engine.planning.disk_speed import probe
from engine.planning.machine import fingerprint, load_average, load_beside
from engine.planning.probes import (
    ADAMW_ELEMENTS,
    FRESH_BYTES,
    RANDOM_ELEMENTS,
    _adamw_rate,
    _fresh_pages_rate,
    _MemorySpeeds,
    _op_overhead,
    _random_rate,
)
from engine.planning.reference_decoder import (
    CUDA_REFERENCE,
    KEPT_LIMIT,
    REFERENCE,
    _KeptDecoder,
    _Reference,
)
from engine.planning.speeds import DTYPES, Calibration

__all__ = ["CUDA_TOKENS", "CUDA_WIDTHS", "KERNELS_SHARE", "TIME_LIMIT", "TOKENS", "WIDTHS",
           "measure"]

TIME_LIMIT = 30.0  # seconds a calibration may take, all measurements together
# The kernels' and copies' share of what is left of the limit once the engine is imported;
# the engine's steps take the rest, which on a loaded machine is two steps of `tiny`.
KERNELS_SHARE = 0.65
# Widths matmuls are measured at (tokens x width @ width x width); a model's own width is
# interpolated between them. A GPU is measured wider: small matmuls cannot fill it.
WIDTHS = (256, 768, 2048)
CUDA_WIDTHS = (768, 2048, 4096)
TOKENS = 1024
# A GPU's matmuls are measured at as many rows as a 1.3B model's step holds (8 x 1024
# tokens): at 1024 an H200 ran them launch-bound (bf16 258 TFLOP/s at width 2048, where
# opt-1.3b's step reached 425), and the forecast of that step came out 14x the measured one
# with the reference decoder's factor (REFERENCE). A small model's launch-bound step is the
# op overhead's (engine.planning.time_model: the kernels or the host, whichever is longer).
CUDA_TOKENS = 8192


def measure(*, simulate: bool | None = None, limit: float = TIME_LIMIT,
            scale: float = 1.0) -> Calibration:
    """Measure this machine now (about `limit` seconds). `scale` shrinks every size, for a
    quick, rougher measurement (tests).

    In the process's heap as it is: a calibration for runs is measured in the heap they
    keep (engine.devices.host_memory.steady_heap; tuitrain's commands set it first), whose
    new memory the forecasts price apart; the kept decoder beside it in a process of its
    own (at a `limit` of KEPT_LIMIT or more), so that this one's heap stays as runs keep
    it. Under glibc's own heap the decoder's tensors below its line are new memory too,
    which nothing counts: the factor carries them, on top of the new memory a forecast
    adds: counted twice. Measured here in one process, decoders of opt-125m's width (1 to
    12 layers) ran in the same time under either heap, at 1.33-1.45x the rates' forecast
    under glibc's and at 0.83-1.23x, with new memory priced apart, under the steady one."""
    from engine.devices.device import default_precision, make_device, uses_cuda

    started, load = time.perf_counter(), load_average()
    # The engine's steps come last, but their model is built first (its imports take
    # seconds on a loaded machine, tens of them for transformers'): what is left of the
    # limit is then shared out.
    from engine.models.zoo import build_model

    cuda = uses_cuda(simulate)
    half = default_precision(cuda)
    shape = CUDA_REFERENCE if cuda else REFERENCE
    # The deep decoder in a kept heap, in a process of its own (started first: its imports
    # take the seconds this one's model takes to build), timed beside this one's.
    kept = None if cuda or limit < KEPT_LIMIT else _KeptDecoder.start(shape, scale)
    model = build_model("tiny", seed=0)
    if kept is not None:
        kept = kept.ready(started + limit / 2)
    left = max(1.0, started + limit - time.perf_counter())
    device = make_device(2**30, simulate)
    where = device.torch_device
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    widths = [max(16, int(w * scale)) for w in (CUDA_WIDTHS if cuda else WIDTHS)]
    precisions = list(DTYPES) if cuda else ["fp32", "bf16"]
    # The engine's steps (_op_overhead) take what is left of the limit: building `tiny`
    # and its first steps take a few seconds on a busy machine.
    # A share for each matmul, the elementwise rate, the random numbers, new memory, each
    # copy and each AdamW; the reference decoder REFERENCE_SHARES, twice as many with the
    # kept decoder beside it (each of its rounds runs both).
    # The decoder in fp32, and in the half precision runs here default to, if any.
    names = ["fp32"] if half == "fp32" else ["fp32", half]
    references = [_Reference(where, sync, scale, name, shape, kept if name == "fp32" else None)
                  for name in names]
    clock = _Clock(left * KERNELS_SHARE,
                   len(widths) * len(precisions) + 7
                   + sum(reference.shares for reference in references),
                   time.perf_counter if cuda else time.thread_time)
    tokens = max(16, int((CUDA_TOKENS if cuda else TOKENS) * scale))
    for reference in references:
        reference.time(clock)  # its first window: before the kernels
    memory = _MemorySpeeds(clock, device, sync, scale)
    memory.time()  # its first window, beside the decoder's
    disk = [probe(scale)]

    matmul: dict[str, dict[int, float]] = {}
    for name in precisions:
        matmul[name] = {}
        for width in widths:
            # Constant values: a matmul's speed does not depend on them, and the run's
            # random numbers stay untouched.
            a = torch.full((tokens, width), 0.5, device=where, dtype=DTYPES[name])
            b = torch.full((width, width), 0.25, device=where, dtype=DTYPES[name])
            matmul[name][width] = clock.rate(2.0 * tokens * width * width,
                                             lambda a=a, b=b: a @ b, sync)
    if not cuda:
        # fp16 matmuls on a CPU take the bf16 path's speed or worse; not measured apart.
        matmul["fp16"] = dict(matmul["bf16"])

    fresh_pages = _fresh_pages_rate(clock, max(2**16, int(FRESH_BYTES * scale)))
    random = _random_rate(clock, max(4096, int(RANDOM_ELEMENTS * scale)), where, sync,
                          memory.windows[0]["elementwise"])
    elements = max(4096, int(ADAMW_ELEMENTS * scale))
    adamw_device = _adamw_rate(clock, elements, where, sync) if cuda else 0.0  # see below

    parts = {"model": limit - left if left > 1.0 else time.perf_counter() - started}
    # The decoder's and the disk's first windows ran before the kernels: in their time.
    parts["kernels, copies, decoder"] = time.perf_counter() - started - parts["model"]
    disk.append(probe(scale))
    # Both windows' bytes over both windows' seconds, each way: the disk here moves by half
    # from one half hour to the next, either way, and neither window says where it goes
    # next. A calibration is one moment of it; a plan that uses the disk is forecast with a
    # probe of its own folder (engine.planning.disk_speed.disk_now).
    disk_write, disk_read, disk_duplex = (len(disk) / sum(1 / r for r in rates)
                                          if all(rates) else 0.0
                                          for rates in zip(*disk, strict=True))
    parts["disk"] = time.perf_counter() - started - sum(parts.values())
    key, words = fingerprint()
    cal = Calibration(
        fingerprint=key, machine=words,
        device=torch.cuda.get_device_name() if cuda else "simulated",
        matmul=matmul, elementwise=0.0, h2d=0.0, d2h=0.0, adamw_host=0.0,
        adamw_device=adamw_device,
        disk_read=disk_read, disk_write=disk_write, disk_duplex=disk_duplex, op_overhead=0.0,
        fresh_pages=fresh_pages, random=random,
    )
    for reference in references:
        reference.time(clock)  # its second window, after the kernels, the copies and the disk
    memory.time()
    device.close()
    for name, rate in memory.speeds().items():
        setattr(cal, name, rate)
    # Both windows, for a machine whose speeds move.
    cal.extra["memory windows"], cal.extra["disk windows"] = memory.windows, disk
    if not cuda:
        cal.adamw_device = cal.adamw_host  # the simulated device's memory is the host's
    # New memory's price first: the half precision's decoder, with no kept one beside it,
    # takes it off its runs.
    cal.activation_pages = references[0].activation_pages(cal)
    cal.compute_factor, cal.compute_offset = references[0].fit(cal)
    if len(references) > 1:
        cal.half_factor, cal.half_offset = references[1].fit(cal)
    if kept is not None:
        kept.close()
        if all(references[0].kept):
            cal.extra["kept decoder"] = {"runs": references[0].runs,
                                         "kept": references[0].kept}
    del references
    parts["decoder"] = time.perf_counter() - started - sum(parts.values())
    cal.op_overhead = _op_overhead(cal, model, simulate,
                                   started + limit - time.perf_counter())
    cal.seconds = time.perf_counter() - started
    parts["engine steps"] = cal.seconds - sum(parts.values())
    cal.extra["seconds"] = parts  # where the time went, for a machine that takes longer
    # What else ran: busy cores slow every figure.
    cal.extra["load"] = load_beside(load, load_average(), cal.seconds, torch.get_num_threads())
    cal.measured_at = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return cal
