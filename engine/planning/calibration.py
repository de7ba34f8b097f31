"""This machine's speeds, measured once and kept: what the time model turns work into seconds
with (engine.planning.time_model).

    cal = calibration(say=print)           # the cached one, or measured now (at most ~30 s)
    cal.matmul_rate("fp32", hidden=768), cal.h2d, cal.adamw_host, cal.disk_read

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

The figures are cached under the user cache folder, one file per machine fingerprint: the
CPU model, vector instructions and cores, the torch version and the GPU's name, driver and
memory (engine.planning.machine). A different machine, or a new torch, measures again; so
does a quiet machine whose figures were measured while its cores were busy.

Runs teach it: beside the figures, a correction (measured / forecast step time, learned from
the steps a tune measured: `learn`) that every later forecast on this machine in the same
precision is multiplied by: the median of what the last LEARNED_RUNS runs measured, within
CORRECTION_BOUNDS, so that one run on a loaded machine moves it little and no run moves it
far. Each precision learns apart: the model's error is not the same in each (on this
project's machine, with bf16 units, bf16 steps took 1.37x their forecast where fp32's took
about their forecast). A new measurement starts them over.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import mmap
import select
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.data.tokenizer import atomic_write, cache_dir
from engine.devices.host_memory import mapped_from
from engine.planning.disk_speed import fused_adamw, probe
from engine.planning.machine import busy, fingerprint, load_average, load_beside, quiet

if TYPE_CHECKING:
    from engine.devices.device import ComputeDevice
    from engine.planning.flops import StepWork

__all__ = [
    "DTYPES",
    "Calibration",
    "calibration",
    "calibration_path",
    "fingerprint",
    "learn",
    "learned_path",
    "load_calibration",
    "measure",
    "save_calibration",
]

FORMAT = 15  # bump when what is measured changes: older files are measured again
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
COPY_BYTES = 64 * 2**20
# AdamW reads and writes four tensors of this many fp32 elements (256 MiB in all): a chunk's
# update runs from memory, not from a CPU's last-level cache. At 4M elements (64 MiB) this
# machine's probe gave 2.4-4.4 G elements/s where the engine's update of opt-125m's chunks
# ran at 1.6 G/s.
ADAMW_ELEMENTS = 16 * 2**20
# The elementwise probe reads two tensors of this many fp32 elements and writes a third (192
# MiB in all), from memory as well: at 4M elements (48 MiB, in a last-level cache part of the
# time) runs of it read 59-99 GiB/s by the wall clock here, and calibrations 62.5, 100.6,
# 173.5 and 179.3 GiB/s in a day; at 16M, 44-50 GiB/s run to run.
ELEMENTWISE_ELEMENTS = 16 * 2**20
# Dropout's mask is drawn over an activation's elements: opt-125m's at 2 x 128 are 196k.
RANDOM_ELEMENTS = 2**20
FRESH_BYTES = 64 * 2**20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# The correction is the median of the last runs' measured / uncorrected forecast, so that a
# run whose steps waited for cores (a shared machine) is one voice among several; and it
# stays within bounds: a run 2x or more off its forecast was disturbed (seen: x12 at a load
# of 30 on 2 cores), and would rank the next tune's candidates by that moment's load.
LEARNED_RUNS = 9
CORRECTION_BOUNDS = (0.5, 2.0)
CORRECTION_RANGE = (1e-3, 1e3)  # beyond these a run measured nonsense: it teaches nothing


@dataclass
class Calibration:
    """A machine's speeds. Rates are per second: FLOPs, bytes or AdamW elements."""

    fingerprint: str
    machine: str  # the fingerprint in words
    device: str  # "simulated" or the GPU's name
    matmul: dict[str, dict[int, float]]  # dtype -> width -> FLOPs per second on the device
    elementwise: float  # bytes per second that non-matmul ops read and write on the device
    h2d: float  # copy bandwidth host -> device
    d2h: float  # device -> host
    adamw_host: float  # elements per second of the fused AdamW update on the host
    adamw_device: float  # ... on the device
    disk_read: float  # the scratch folder's sequential bandwidth (0: not measured)
    disk_write: float
    op_overhead: float  # the engine's seconds per op beyond the op itself (hooks, counting)
    # Bytes per second of new host memory beyond writing it: mapped, each page faulted in
    # and zeroed at its first write, unmapped when freed (0: not measured, costs nothing).
    fresh_pages: float = 0.0
    # Bytes per second of the new memory a forward and backward take for their activations,
    # gradients and logits, beyond writing it: the reference decoder in the process's heap
    # against the same decoder in a kept heap, which maps nothing afresh (REFERENCE). A
    # step's own new pages went 1.3-1.8x as fast as the probe's above on one boot of this
    # project's machine (opt-125m: 1.0 GiB faulted a step, 0.18-0.21 s, against 0.29-0.33
    # s at the probe's rate) and 0.8-0.95x on the next (4.1-4.85 GiB/s against 4.9-5.4);
    # the probe still prices the copies' new buffers: written by one copy each, as its own
    # are. 0: not measured (no kept heap to compare with): the probe's rate.
    activation_pages: float = 0.0
    # Random numbers per second drawn on the device (dropout's mask: `bernoulli_` over fp32
    # elements) beyond the bytes that writes, which `elementwise` prices (0: not measured,
    # or a device that draws them as fast as it writes them).
    random: float = 0.0
    # Bytes per second read and written together in the scratch folder, one thread reading
    # while another writes, as the update reads each piece ahead and writes the last behind
    # (engine.chunks.update_walk) (0: not measured; one after the other at the rates above).
    disk_duplex: float = 0.0
    # A real decoder's forward and backward measured over what the FLOPs and bytes above
    # forecast for it, per second of that forecast (the slope between two depths, see
    # REFERENCE): the small matmuls, the barriers between a parallel kernel's threads,
    # and the dispatch of each op, which kernels measured alone at their best do not show.
    # In fp32; `half_factor` the same in the half precision runs here default to (bf16, or
    # fp16 on a GPU without bf16; the other half precision takes it too), where the
    # matmuls' speed-up is not the ops' around them: on a CPU with AMX, bf16 matmuls ran
    # 4-6x fp32's and opt-125m's step 1.5x. 0: not measured (a CPU without bf16 units,
    # which runs in fp32 and would take seconds a run in bf16): fp32's stands for it.
    compute_factor: float = 1.0
    half_factor: float = 0.0
    # Seconds every micro-batch's forward and backward take beyond factor x their kernels'
    # forecast (`compute_seconds`), fitted with the factor on the decoder at two depths; in
    # fp32 and in that half precision. Negative where the shallow decoder ran faster than
    # the deep one's slope.
    compute_offset: float = 0.0
    half_offset: float = 0.0
    measured_at: str = ""  # ISO time
    seconds: float = 0.0  # how long the measurement took
    # Where the device's figures come from: "this machine's calibration", or a hardware profile's
    # published specs (engine.planning.hardware) beside this host's measured figures.
    source: str = "this machine's calibration"
    extra: dict = field(default_factory=dict)
    # What runs in `taught_for` (a precision) on this machine taught (`learn`), kept in a
    # file of its own beside this one: the correction, how many runs taught it, and the
    # uncorrected measured / forecast ratios of the last LEARNED_RUNS of them, oldest first.
    correction: float = 1.0
    learned_from: int = 0
    learned: list[float] = field(default_factory=list)
    taught_for: str = "fp32"

    def matmul_rate(self, precision: str, hidden: int) -> float:
        """FLOPs per second of this precision's matmuls at a model width of `hidden`,
        interpolated (in log width) between the measured widths, flat beyond them."""
        table = self.matmul.get(precision) or self.matmul["fp32"]
        widths = sorted(table)
        if hidden <= widths[0]:
            return table[widths[0]]
        if hidden >= widths[-1]:
            return table[widths[-1]]
        for lo, hi in zip(widths, widths[1:], strict=False):
            if lo <= hidden <= hi:
                t = (math.log(hidden) - math.log(lo)) / (math.log(hi) - math.log(lo))
                return table[lo] * (table[hi] / table[lo]) ** t
        return table[widths[-1]]

    def kernel_seconds(self, precision: str, hidden: int, flops: float, nbytes: float,
                       random: float = 0.0) -> float:
        """Seconds of kernels at the rates alone (no factor, no new memory): `flops` of
        matmuls at a model width of `hidden`, `nbytes` that other ops read and write, and
        `random` numbers drawn."""
        seconds = flops / self.matmul_rate(precision, hidden) + nbytes / self.elementwise
        return seconds + (random / self.random if self.random > 0 else 0.0)

    def factor(self, precision: str) -> float:
        """The compute factor of a step computed in `precision`."""
        if precision != "fp32" and self.half_factor > 0:
            return self.half_factor
        return self.compute_factor

    def compute_seconds(self, precision: str, kernels: float) -> float:
        """Seconds of a micro-batch's forward and backward whose kernels the rates forecast
        at `kernels` seconds: the factor times them, plus the offset; at least half the
        factor's alone (a model far smaller than the decoder the offset was fitted on)."""
        half = precision != "fp32" and self.half_factor > 0
        offset = self.half_offset if half else self.compute_offset
        scaled = self.factor(precision) * kernels
        return max(scaled + offset, scaled / 2)

    def fresh_seconds(self, nbytes: float) -> float:
        """Seconds that `nbytes` of new host memory cost beyond the writes into it: a copy's
        new buffer."""
        return nbytes / self.fresh_pages if self.fresh_pages > 0 else 0.0

    def activation_seconds(self, nbytes: float) -> float:
        """Seconds that `nbytes` of a forward's or backward's new host memory cost beyond
        the writes into it."""
        rate = self.activation_pages or self.fresh_pages
        return nbytes / rate if rate > 0 else 0.0

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["matmul"] = {k: {str(w): r for w, r in v.items()} for k, v in self.matmul.items()}
        out["format"] = FORMAT
        for learned in ("correction", "learned_from", "learned", "taught_for"):  # beside
            out.pop(learned)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> Calibration:
        data = dict(data)
        data.pop("format", None)
        data["matmul"] = {k: {int(w): float(r) for w, r in v.items()}
                          for k, v in data["matmul"].items()}
        return cls(**data)


# --- the machine ----------------------------------------------------------------------


def calibration_path(key: str | None = None) -> Path:
    """The cache file of the machine with fingerprint `key` (default: this one)."""
    return cache_dir() / "calibration" / f"{key or fingerprint()[0]}.json"


def learned_path(key: str | None = None) -> Path:
    """The file of what runs taught the calibration of machine `key` (default: this one)."""
    return calibration_path(key).with_suffix(".learned.json")


def load_calibration(key: str | None = None, precision: str = "fp32") -> Calibration | None:
    """The cached calibration of this machine, with what runs in `precision` taught it, or
    None (none, unreadable, or outdated)."""
    try:
        data = json.loads(calibration_path(key).read_text(encoding="utf-8"))
        if data.get("format") != FORMAT:
            return None
        cal = Calibration.from_dict(data)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    cal.taught_for = precision
    taught = _learned(cal).get(precision)
    if taught is not None:
        try:
            ratios = [float(r) for r in taught["ratios"]]
            cal.learned = ratios[-LEARNED_RUNS:]
            cal.correction = _correction(cal.learned)
            cal.learned_from = int(taught["runs"])
        except (ValueError, TypeError, KeyError):
            pass
    return cal


def _learned(cal: Calibration) -> dict[str, dict]:
    """What runs taught `cal`'s measurement, by precision (empty: nothing, or what they
    taught an older measurement)."""
    try:
        learned = json.loads(learned_path(cal.fingerprint).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(learned, dict) or learned.get("measured_at") != cal.measured_at:
        return {}
    taught = learned.get("precisions")
    return taught if isinstance(taught, dict) else {}


def _correction(ratios: list[float]) -> float:
    low, high = CORRECTION_BOUNDS
    return min(high, max(low, statistics.median(ratios))) if ratios else 1.0


def learn(cal: Calibration, ratio: float) -> Calibration:
    """What a run measured teaches the calibration: `ratio` is its step times over their
    forecasts (made with `cal`, its correction included, in `cal.taught_for`). The new
    correction is the median of the last LEARNED_RUNS runs' ratios, within
    CORRECTION_BOUNDS; kept beside the calibration for the next forecast in that precision,
    and returned. A ratio beyond CORRECTION_RANGE teaches nothing.

    Raises OSError when the file cannot be written."""
    low, high = CORRECTION_RANGE
    if not low <= ratio <= high:
        return cal
    # Against the model alone, so that every run's voice is comparable whatever the
    # correction its forecast carried.
    ratios = [*cal.learned, ratio * cal.correction][-LEARNED_RUNS:]
    taught = dataclasses.replace(cal, correction=_correction(ratios), learned=ratios,
                                 learned_from=cal.learned_from + 1)
    path = learned_path(cal.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    precisions = {**_learned(cal), cal.taught_for: {
        "correction": taught.correction, "ratios": ratios, "runs": taught.learned_from}}
    text = json.dumps({"measured_at": cal.measured_at, "precisions": precisions},
                      indent=2) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return taught


def save_calibration(cal: Calibration) -> Path:
    path = calibration_path(cal.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(cal.to_dict(), indent=2) + "\n",
                                                  encoding="utf-8"))
    return path


def calibration(*, refresh: bool = False, say: Callable[[str], None] | None = None,
                measure_fn: Callable[..., Calibration] | None = None,
                precision: str = "fp32") -> Calibration:
    """This machine's calibration, with what runs in `precision` taught it: the cached one,
    or measured now and cached (`refresh`: measured now whatever the cache holds). `say`
    hears one line before a measurement."""
    cached = None if refresh else load_calibration(precision=precision)
    if cached is not None and not (busy(cached.extra.get("load")) and quiet(load_average())):
        return cached
    if say is not None:
        why = ("" if cached is None else f"the cached one was measured while the machine was "
               f"busy (load {cached.extra['load']:.1f}); now it is quiet: ")
        say(f"{why}calibrating this machine's speeds (at most {TIME_LIMIT:.0f} s, once per "
            f"machine; `tuitrain calibrate` shows them)...")
    cal = (measure_fn or measure)()
    cal.taught_for = precision
    try:
        save_calibration(cal)
        learned_path(cal.fingerprint).unlink(missing_ok=True)  # taught the old figures
    except OSError as error:  # a read-only cache: forecast anyway, and measure next time
        if say is not None:
            say(f"calibration not cached ({error.strerror or error}): "
                f"{calibration_path(cal.fingerprint)}")
    return cal


# --- measuring ------------------------------------------------------------------------


class _Clock:
    """Shares the time limit out: each measurement repeats until its share is spent.

    Timed by `timer`: on the simulated device the measuring thread's CPU seconds, which are
    a kernel's duration on a quiet machine (that thread is OpenMP's thread 0 in every
    parallel kernel) and which a loaded one, taking the cores away between its slices,
    stretches far less than the wall clock. A GPU's kernels run while it waits: wall."""

    def __init__(self, limit: float, shares: int,
                 timer: Callable[[], float] = time.perf_counter,
                 wall: Callable[[], float] = time.perf_counter) -> None:
        self.share = limit / shares
        self.deadline = time.perf_counter() + limit
        self.timer, self.wall = timer, wall

    def rate(self, work: float, run: Callable[[], None], sync: Callable[[], None], *,
             typical: bool = False, runs: int = 3, shares: float = 1.0) -> float:
        """`work` per second of `run`'s fastest run of `times`. The fastest: what the
        machine does when nothing else takes its cores, which a busy moment during the
        measurement must not change for every later forecast. `typical`: the median run
        instead, what a step of many such runs takes (the median of its steps is what a
        run's step time is judged by)."""
        times = self.times(run, sync, runs=runs, shares=shares, whole=not typical)
        return work / max(statistics.median(times) if typical else min(times), 1e-9)

    def times(self, run: Callable[[], None], sync: Callable[[], None], *, runs: int = 3,
              shares: float = 1.0, whole: bool = False) -> list[float]:
        """The seconds of `run`'s runs, as many as `shares` shares allow (one warm-up
        excluded; at least `runs` unless the whole limit is spent); `whole`: only those the
        timer saw whole (`whole_runs`), as the fastest of them must be."""
        run()
        sync()
        times: list[float] = []
        walls: list[float] = []
        start = time.perf_counter()
        while not times or (
                (len(times) < runs or time.perf_counter() - start < self.share * shares)
                and len(times) < 50 and time.perf_counter() < self.deadline):
            t0, w0 = self.timer(), self.wall()
            run()
            sync()
            times.append(self.timer() - t0)
            walls.append(self.wall() - w0)
        return whole_runs(times, walls) if whole else times


# A run timed by the measuring thread's clock counts where that clock ran for at least this
# share of the wall clock's time (whole_runs).
WHOLE = 0.8


def whole_runs(seconds: list[float], walls: list[float]) -> list[float]:
    """The runs (`seconds` by the measuring thread's clock, `walls` by the wall clock's)
    that the thread's clock saw whole. A parallel kernel's thread 0, done with its part
    first, waits at the kernel's end for the others, and where one of them was held up (a
    core taken by another job) it sleeps there, its clock stopped: that run reads faster
    than the kernel ran (seen here: of 300 runs of the elementwise probe, some took up to
    3.1x by the wall clock what they took by the thread's), and the fastest run is what a
    rate keeps. So where the fastest run is taken, a run counts only where the thread's
    clock kept up with the wall clock (WHOLE); if none did (a machine busy throughout), all
    do: the thread's clock is still what load stretches least. Timed by the wall clock
    alone (a GPU), every run counts."""
    whole = [s for s, w in zip(seconds, walls, strict=True) if s >= WHOLE * w]
    return whole or seconds


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


def _fresh_pages_rate(clock: _Clock, size: int) -> float:
    """Bytes per second of new host memory beyond writing it: a mapping of `size` bytes
    written once and unmapped, against the same write into memory already resident. A
    mapping of its own, whatever line the process's allocator draws (engine.devices
    .host_memory), and private, as the allocator's are: Python's default, a shared one, is
    backed by the system's shared memory and cost half as much again per page here (3.4-3.6
    against 5.0-5.5 GiB/s; a tensor that glibc maps, 5.0-6.2). The median run: on a virtual
    machine a fresh page may wait for the host, and a step takes what its pages typically
    cost. 0 where it cannot be told."""
    kept = torch.empty(size, dtype=torch.uint8)
    kept.fill_(0)
    private = {"flags": mmap.MAP_PRIVATE} if hasattr(mmap, "MAP_PRIVATE") else {}

    def fresh() -> None:
        with mmap.mmap(-1, size, **private) as mapping:
            written = torch.frombuffer(mapping, dtype=torch.uint8)
            written.fill_(1)
            del written  # the mapping closes once nothing holds it

    new = size / clock.rate(size, fresh, lambda: None, typical=True, shares=0.5)
    resident = size / clock.rate(size, lambda: kept.fill_(1), lambda: None, typical=True,
                                 shares=0.5)
    return size / (new - resident) if new > resident else 0.0


def _random_rate(clock: _Clock, elements: int, where: torch.device,
                 sync: Callable[[], None], elementwise: float) -> float:
    """Random numbers per second of dropout's mask (`bernoulli_` over fp32 elements)
    beyond the bytes it reads and writes at `elementwise`; 0 where drawing is no slower
    than that. The run's random numbers stay untouched."""
    mask = torch.empty(elements, device=where)
    devices = [where.index or 0] if where.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        drawn = clock.rate(elements, lambda: mask.bernoulli_(0.9), sync)
    beyond = elements / drawn - 2 * mask.nbytes / elementwise
    return elements / beyond if beyond > 0 else 0.0


class _MemorySpeeds:
    """The rates that memory's speed sets: the elementwise probe, the copies each way and
    AdamW on the host, each the median of its runs, in two windows that take one share
    each between them: one beside the decoder's first window, one beside its second.

    The slower window counts. This machine's memory runs at one of two speeds about 2x
    apart, the slower most of the time: an fp32 add over 16M elements sampled every half
    second for a minute took 4.3-5.6 ms, but for two spells of a second or so 2.4-2.6 ms
    (2026-12-05). A calibration whose probes fell in such a spell read copies at 47 GiB/s
    and AdamW at 4.6 G elements/s, where the one before read 20 and 2.4, and the runs that
    followed took the slower speed; their fastest run, as compute rates are taken, is that
    spell's."""

    def __init__(self, clock: _Clock, device: ComputeDevice, sync: Callable[[], None],
                 scale: float) -> None:
        self.clock, self.device, self.sync, self.scale = clock, device, sync, scale
        self.windows: list[dict[str, float]] = []

    def time(self) -> None:
        """One window (the tensors of each probe freed before the next is made)."""
        self.windows.append({"elementwise": self._elementwise(), **self._copies(),
                             "adamw_host": _adamw_rate(
                                 self.clock, max(4096, int(ADAMW_ELEMENTS * self.scale)),
                                 torch.device("cpu"), lambda: None, typical=True,
                                 shares=0.5)})

    def _elementwise(self) -> float:
        where, n = self.device.torch_device, max(4096, int(ELEMENTWISE_ELEMENTS * self.scale))
        x, y = torch.full((n,), 0.5, device=where), torch.full((n,), 0.25, device=where)
        out = torch.empty(n, device=where)
        # Two tensors read, one written.
        return self.clock.rate(3 * out.nbytes, lambda: torch.add(x, y, out=out), self.sync,
                               typical=True, shares=0.5)

    def _copies(self) -> dict[str, float]:
        device, numel = self.device, max(4096, int(COPY_BYTES * self.scale)) // 4
        host, dev = device.host_empty(numel, torch.float32), device.empty(numel, torch.float32)
        host.fill_(1.0)
        return {"h2d": self.clock.rate(host.nbytes, lambda: device.copy(dev, host), self.sync,
                                       typical=True, shares=0.5),
                "d2h": self.clock.rate(host.nbytes, lambda: device.copy(host, dev), self.sync,
                                       typical=True, shares=0.5)}

    def speeds(self) -> dict[str, float]:
        """Each rate's slower window."""
        return {name: min(w[name] for w in self.windows) for name in self.windows[0]}


def _adamw_rate(clock: _Clock, elements: int, where: torch.device,
                sync: Callable[[], None], **how: object) -> float:
    """Elements per second of the engine's update (`fused_adamw`). `how`: as `_Clock.rate`'s."""
    return clock.rate(elements, fused_adamw(elements, where), sync, **how)


# The decoder the compute factor is measured on: opt-125m's layers at a batch of 2 x 128
# with a small vocabulary (so that its head does not dominate), at two depths. Why two:
# the slope between the depths is what a layer adds, and the shallow decoder's rest is an
# offset per micro-batch. On the simulated device the factor is fitted on the decoder in a
# kept heap (_KeptDecoder), which takes no new memory: there such decoders ran at one factor
# from 1 to 12 layers, at either vocabulary (1.08-1.14x the rates' forecast on 2026-12-04,
# 1.29-1.31 on 2026-12-05's machine), with an offset near nothing. The steady heap's runs
# beside it price the new memory (`activation_pages`). Fitted on the steady heap's runs
# alone, their new memory taken off at the probe's rate, the factor moved from 1.14 to
# 1.41 between calibrations of one afternoon, and the forecasts of a grid with it.
REFERENCE = {"model": "opt-125m", "layers": (1, 6), "vocab": 8192, "batch": 2, "seq_len": 128}
# On a GPU, opt-1.3b's layers at 4 x 1024: opt-125m's at 2 x 128 are launch-bound there and
# measured a factor of 3.6 (fp32) and 7.1 (bf16) on an H200, which multiplied every
# model's arithmetic, opt-1.3b's too (2.91 s forecast, 0.20 s measured). Three layers deep
# at most: both precisions' decoders are held at once, and a laptop's 6 GB must hold them
# with one run's activations (by count about half a GB a layer in fp32 at this batch; not
# yet measured on a GPU).
CUDA_REFERENCE = {"model": "opt-1.3b", "layers": (1, 3), "vocab": 8192, "batch": 4,
                  "seq_len": 1024}
# Its median run at each depth, the two taken in turn, of at least REFERENCE_RUNS in each of
# two windows that take REFERENCE_SHARES between them: one run moves by a quarter from one
# moment to the next here, and the fastest of a few is the luckiest, not what a step takes.
REFERENCE_RUNS = 3
REFERENCE_SHARES = 12
# The fitted factor stays within these multiples of the deep decoder's own (its run over its
# forecast): two depths a few runs each can disagree by a slow spell, and a slope from them
# alone could then make a layer cost nothing, or twice what it does.
SLOPE_BOUNDS = (0.5, 2.0)


class _Reference:
    """A real decoder's forward and backward (REFERENCE, or CUDA_REFERENCE on a GPU; plain
    PyTorch, no engine, no generation cache, as the engine runs a model) at two depths,
    timed in turn in two windows, one before the kernels and one after them: on a shared
    machine a slow spell lasts seconds (the same decoder ran 220 ms, then 370 ms, then 260
    ms a run here, each for several seconds), so that one spell is one window of two, and
    it slows both depths alike. `fit`: the factor and the offset that turn the calibration's
    forecast for the FLOPs and bytes (engine.planning.flops) of each depth into its median
    run. The rates are each kernel's fastest and these are medians, so the factor also
    carries how far a typical step of many kernels falls behind their best."""

    def __init__(self, where: torch.device, sync: Callable[[], None], scale: float,
                 precision: str = "fp32", shape: dict | None = None,
                 kept: _KeptDecoder | None = None) -> None:
        from transformers import AutoModelForCausalLM

        from engine.models.training import prepare_for_training
        from engine.models.zoo import model_config

        shape = shape or REFERENCE
        self.configs, self.models = [], []
        for layers in shape["layers"]:
            config = model_config("tiny" if scale < 1.0 else shape["model"])
            config.num_hidden_layers = layers
            config.vocab_size = min(config.vocab_size, shape["vocab"])
            with torch.random.fork_rng(devices=[]):  # the run's random numbers stay untouched
                model = AutoModelForCausalLM.from_config(config).to(
                    where, DTYPES[precision]).train()
            prepare_for_training(model)
            self.configs.append(config)
            self.models.append(model)
        self.sync = sync
        self.batch, self.seq = shape["batch"], max(8, int(shape["seq_len"] * scale))
        self.ids = torch.zeros(self.batch, self.seq, dtype=torch.long, device=where)
        self.precision = precision
        self.runs: tuple[list[float], list[float]] = ([], [])  # shallow, deep
        self.kept_decoder = kept
        self.kept: tuple[list[float], list[float]] = ([], [])  # the same in a kept heap
        self.beyond: list[list[float]] = []  # each window's deep runs less their kept pairs
        self.shares = REFERENCE_SHARES * (2 if kept is not None else 1)
        self._work: list[StepWork] = []

    def _run(self, model: torch.nn.Module) -> None:
        model(input_ids=self.ids, labels=self.ids).loss.backward()
        model.zero_grad(set_to_none=True)

    def run_each(self, timer: Callable[[], float]) -> list[float]:
        """`timer`'s seconds of one run of each depth, in turn."""
        seconds = []
        for model in self.models:
            start = timer()
            self._run(model)
            self.sync()
            seconds.append(timer() - start)
        return seconds

    def time(self, clock: _Clock) -> None:
        """One window: half of its `shares` of `clock`'s time, each depth in turn, and
        after them the kept decoder's (each pair of runs in the same moment)."""
        timed: tuple[list[float], ...] = ([], [], [], [])  # shallow, deep, and kept

        def both() -> None:
            for runs, seconds in zip(timed, self.run_each(clock.timer), strict=False):
                runs.append(seconds)
            if self.kept_decoder is not None:
                kept = self.kept_decoder.run()
                if kept is None:  # it failed: these runs are fitted alone
                    self.kept_decoder = None
                    self.kept, self.beyond = ([], []), []
                    return
                for runs, seconds in zip(timed[2:], kept, strict=True):
                    runs.append(seconds)

        with torch.random.fork_rng(devices=[]):  # its dropout draws none of the run's
            clock.times(both, self.sync, runs=REFERENCE_RUNS, shares=self.shares / 2)
        if self.kept_decoder is None:
            timed = timed[:2]
        for runs, window in zip(self.runs + self.kept, timed, strict=False):
            runs += window[1:]  # the first ran to warm up
        if self.kept_decoder is not None:
            self.beyond.append([s - k for s, k in zip(timed[1][1:], timed[3][1:], strict=True)])

    def _works(self) -> list[StepWork]:
        from engine.planning.flops import step_work

        self._work = self._work or [
            step_work(config, DTYPES[self.precision], batch_size=self.batch, seq_len=self.seq,
                      checkpointing=False, mapped_from=mapped_from())
            for config in self.configs]
        return self._work

    def activation_pages(self, cal: Calibration) -> float:
        """Bytes per second of the deep decoder's new memory: its bytes (engine.planning
        .flops: the tensors new in this process's heap) over what its runs took beyond the
        kept decoder's, the median of the pairs run in turn in the last window, within
        ACTIVATION_BOUNDS of the probe's rate. 0 where no kept decoder ran beside it (the
        probe's rate stands).

        The last window alone: in the first, run seconds after the models were built, this
        process's runs took up to twice what they took later (opt-125m's width at 6
        layers: 0.47-0.78 s, then 0.37-0.41 as in a loop of its own, with its new pages
        faulted in alike), where the kept decoder's took 0.30 s throughout (2026-12-05)."""
        fresh = self._works()[1]
        nbytes = fresh.forward_fresh + fresh.backward_fresh
        if not self.beyond or not self.beyond[-1] or nbytes <= 0 or cal.fresh_pages <= 0:
            return 0.0
        took = statistics.median(self.beyond[-1])
        low, high = (bound * cal.fresh_pages for bound in ACTIVATION_BOUNDS)
        return high if took <= nbytes / high else max(low, nbytes / took)

    def fit(self, cal: Calibration) -> tuple[float, float]:
        """(factor, offset): a micro-batch of forward and backward whose kernels the rates
        forecast at k seconds takes factor x k + offset (engine.planning.time_model), its
        new memory apart: fitted on the kept decoder's runs, which take no new memory,
        where it ran; else on these, their new memory taken off at its price."""
        kept = all(self.kept)
        points = []
        for work, runs, kept_runs in zip(self._works(), self.runs, self.kept, strict=True):
            # New memory is priced at its own measured rate, not scaled by the factor: the
            # tensors new in this process's heap.
            points.append((_kernels(cal, work, self.precision),
                           statistics.median(kept_runs) if kept else
                           _less_fresh(statistics.median(runs), _fresh(cal, work))))
        (shallow, shallow_run), (deep, deep_run) = points
        own = _factor(deep_run, 0.0, deep)
        if deep <= shallow:
            return own, 0.0
        low, high = SLOPE_BOUNDS
        slope = min(high * own, max(low * own, (deep_run - shallow_run) / (deep - shallow)))
        return slope, shallow_run - slope * shallow


# The activations' rate of new memory stays within these multiples of the probe's: a pair of
# runs that a slow spell split could make it cost nothing, or more than it costs written
# alone. Measured here: 0.8-1.8x.
ACTIVATION_BOUNDS = (0.5, 4.0)
KEPT_WAIT = 60.0  # seconds the kept decoder may take to answer before it counts as failed
# The shortest time limit a calibration starts the kept decoder in: its imports take seconds.
KEPT_LIMIT = 10.0


class _KeptDecoder:
    """The reference's decoders in a process of their own whose heap maps nothing afresh
    (engine.devices.host_memory.kept_heap), run on request, so that the decoder in this
    process's heap and in a kept one are timed at the same moment: their difference is
    what the new memory of a step's activations costs, and the kept runs are the kernels
    alone. A process of its own: glibc's thresholds, once a kept heap has held a step,
    do not give a steady heap back (a step then faulted 310-516 MiB afresh where it had
    faulted 1,013), and a fork cannot run the parent's OpenMP kernels (its first parallel
    kernel waits forever). None where it cannot start (a C library without a kept heap)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.process = process

    @classmethod
    def start(cls, shape: dict, scale: float) -> _KeptDecoder | None:
        if mapped_from() is None:  # this process keeps its heap: nothing to compare with
            return None
        what = json.dumps({"shape": shape, "scale": scale, "threads": torch.get_num_threads()})
        try:
            return cls(subprocess.Popen(
                [sys.executable, "-c", "from engine.planning.calibration import kept_decoder;"
                 f"kept_decoder({what!r})"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                text=True, bufsize=1, cwd=Path(__file__).resolve().parents[2]))
        except OSError:
            return None

    def ready(self, deadline: float) -> _KeptDecoder | None:
        """This, once its decoders are built; None (and it is stopped) where it failed or
        is not ready by `deadline`."""
        try:
            if self._answer(deadline) == "ready":
                return self
        except (OSError, ValueError):  # a system whose pipes select cannot wait on
            pass
        self.close(kill=True)
        return None

    def run(self) -> list[float] | None:
        """The thread seconds of one run of each depth, in turn; None where the process
        has failed."""
        try:
            self.process.stdin.write("run\n")
            self.process.stdin.flush()
            seconds = [float(s) for s in (self._answer(time.perf_counter() + KEPT_WAIT)
                                          or "").split()]
        except (OSError, ValueError):
            return None
        return seconds if len(seconds) == 2 else None

    def _answer(self, deadline: float) -> str | None:
        ready, _, _ = select.select([self.process.stdout], [], [],
                                    max(0.0, min(deadline - time.perf_counter(), 3600.0)))
        return self.process.stdout.readline().strip() if ready else None

    def close(self, *, kill: bool = False) -> None:
        """Stop the process: at the end of its input, or at once (`kill`)."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()
        try:
            self.process.wait(timeout=0 if kill else 10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.process.stdout.close()


def kept_decoder(what: str) -> None:
    """`_KeptDecoder`'s process: the reference decoders built in a kept heap; each line
    "run" on stdin runs each depth once and answers their thread seconds."""
    from engine.devices.host_memory import kept_heap

    kept = kept_heap()
    asked = json.loads(what)
    torch.set_num_threads(asked["threads"])
    reference = _Reference(torch.device("cpu"), lambda: None, asked["scale"], "fp32",
                           asked["shape"])
    print("ready" if kept else "no kept heap", flush=True)
    for line in sys.stdin:
        if line.strip() != "run":
            break
        with torch.random.fork_rng(devices=[]):
            seconds = reference.run_each(time.thread_time)
        print(" ".join(f"{s:.6f}" for s in seconds), flush=True)


def _factor(run: float, fresh: float, kernels: float) -> float:
    """The reference decoder's `run` seconds, less its `fresh` seconds of new memory (priced
    apart: `_less_fresh`), over its `kernels`' forecast at the rates."""
    if kernels <= 0:
        return 1.0
    return _less_fresh(run, fresh) / kernels


def _less_fresh(run: float, fresh: float) -> float:
    """`run` seconds less `fresh` seconds of new memory, taken off at most down to half the
    run: its probe can meet the host's page handling at a slow moment (the same 800 MiB took
    0.35 s to 8 s here), and taken off whole it left a factor of 0, which makes every compute
    forecast nothing."""
    return max(run - fresh, run / 2)


def _op_overhead(cal: Calibration, model: torch.nn.Module, simulate: bool | None,
                 limit: float) -> float:
    """The engine's own seconds per op (its hooks and live-byte counter see every op): a
    few steps of `tiny` under cpu, whose many small ops cost more than their arithmetic,
    less what its arithmetic, copies and update take.

    Timed in the stepping thread's CPU seconds: the engine's own work is Python on that
    thread, and a busy machine stretches its wall time by however many others share the
    cores, which is no property of the engine."""
    from engine.config import EngineConfig
    from engine.models.zoo import model_config
    from engine.planning.flops import step_work
    from engine.step.engine import Engine

    batch, seq = 2, 32
    config = EngineConfig(policy="cpu", device_budget="1GiB", precision="fp32", seed=0,
                          simulate=simulate)
    ids = torch.arange(batch * seq).remainder(model.config.vocab_size).view(batch, seq)
    times: list[float] = []
    work = step_work(model_config("tiny"), torch.float32, batch_size=batch, seq_len=seq,
                     checkpointing=False, mapped_from=mapped_from())
    deadline = time.perf_counter() + limit
    walls: list[float] = []  # one more step must end before the deadline: as long as the last
    with Engine(model, config) as eng:
        # The traced step and one more at least; more while the limit lasts (a loaded
        # machine spends it on the first two).
        while len(times) < 2 or (time.perf_counter() + walls[-1] < deadline
                                 and len(times) < 30):
            t0, w0 = time.thread_time(), time.perf_counter()
            stats = eng.step({"input_ids": ids, "labels": ids})
            times.append(time.thread_time() - t0)
            walls.append(time.perf_counter() - w0)
    # The traced step left out; the fastest whole one, as in _Clock.rate.
    steady = min(whole_runs(times[1:], walls[1:]))
    ops = (cal.compute_seconds("fp32", _kernels(cal, work)) + _fresh(cal, work)
           + stats.bytes_h2d / cal.h2d + stats.bytes_d2h / cal.d2h
           + sum(p.numel() for p in model.parameters()) / cal.adamw_host)
    return max(0.0, (steady - ops) / work.ops)


def _kernels(cal: Calibration, work: StepWork, precision: str = "fp32") -> float:
    """Seconds of a plain forward and backward at the rates alone (no factor, no new
    memory)."""
    return cal.kernel_seconds(precision, work.hidden, work.forward_flops + work.backward_flops,
                              work.forward_bytes + work.backward_bytes,
                              work.forward_random + work.backward_random)


def _fresh(cal: Calibration, work: StepWork) -> float:
    return cal.activation_seconds(work.forward_fresh + work.backward_fresh)
