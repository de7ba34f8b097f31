"""The calibration's probes of single operations, each on the engine's own path, and of the
engine's own cost:

- new host memory (`_fresh_pages_rate`): a page faulted in, zeroed and unmapped, beyond
  writing it;
- random numbers (`_random_rate`): dropout's masks, beyond the bytes they write;
- what memory's speed sets (`_MemorySpeeds`): the bytes per second that ops other than
  matmuls read and write, copies each way through the device's transfers (the staging ring
  on CUDA) and PyTorch's fused AdamW, the engine's update, on the host; in two windows
  apart, since a machine's memory moves from moment to moment;
- AdamW on the device (`_adamw_rate`);
- the engine's own seconds per op (`_op_overhead`: hooks, chunk states, the live-byte
  counter), from a few steps of the `tiny` model, less what the rates say its arithmetic,
  copies and update take.

Each takes its share of the calibration's time limit from a `_Clock` (engine.planning
.clock). The matmuls are timed by engine.planning.measurement itself, the disk by
engine.planning.disk_speed, a real decoder by engine.planning.reference_decoder.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.devices.host_memory import mapped_from
from engine.planning.clock import whole_runs
from engine.planning.disk_speed import fused_adamw
from engine.planning.reference_decoder import _fresh, _kernels

if TYPE_CHECKING:
    from engine.devices.device import ComputeDevice
    from engine.planning.clock import _Clock
    from engine.planning.speeds import Calibration

__all__ = [
    "ADAMW_ELEMENTS",
    "COPY_BYTES",
    "ELEMENTWISE_ELEMENTS",
    "FRESH_BYTES",
    "RANDOM_ELEMENTS",
]

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
