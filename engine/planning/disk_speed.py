"""The disk tier's speed where a run puts its scratch: the probe the calibration runs, and
the same probe run again when a plan that uses the disk is forecast.

    cal = disk_now(cal, plan.disk_dir, say=print)  # the rates of that folder's disk, now

Why again: the calibration probes the default scratch folder once, but a run may put its
scratch on another disk (`--disk DIR`), and a disk's speed moves. This project's machine's
moved by half within an hour, either way: both ways at once 1.84 GiB/s at 16:22, 1.27-1.34
at 17:23 and 1.7 at 17:53 (2026-12-05); four rows of the time model's grid that ran in a
three-minute slow spell of it waited 2.15-4.13 s where the same plans had just waited
1.51-3.15 s. A probe takes about 2 s here: a plan that uses the disk is
forecast with what the disk does now, and one that does not never waits for it.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from engine.placement import disk_rules
from engine.planning.speeds import Calibration

__all__ = ["DISK_PROBE", "DISK_NOW_SECONDS", "disk_now", "fused_adamw", "probe"]

# The disk probe writes and reads back this many bytes, in pieces of the update's largest
# (DISK_PROBE_PIECE). At 64 MiB, six probes in a row here read 1.3-1.6 GiB/s; at 512 MiB,
# 1.6-2.1: a step moves a GiB or more, and the first reads of a probe are its slowest.
DISK_PROBE = 256 * 2**20
DISK_PROBE_PIECE = 8 * disk_rules.DISK_PIECE  # a piece of fp32 state: both moments
# How long one probe of a folder's disk stands for in this process (a tune forecasts many
# settings; a plan, a few rows): longer than a forecast takes, shorter than the spells the
# disk here kept a speed for (minutes).
DISK_NOW_SECONDS = 120.0

_probed: dict[str, tuple[float, tuple[float, float, float]]] = {}


def fused_adamw(elements: int, where: torch.device) -> Callable[[], None]:
    """The engine's update, once over one flat fp32 chunk of `elements`: PyTorch's fused
    AdamW (engine.step.optimizer)."""
    param, grad, m, v = (torch.full((elements,), 0.5, device=where) for _ in range(4))
    step = torch.ones((), device=where)

    def run() -> None:
        torch._fused_adamw_([param], [grad], [m], [v], [], [step], amsgrad=False,
                            maximize=False, lr=1e-4, beta1=0.9, beta2=0.999,
                            weight_decay=0.0, eps=1e-8)

    return run


def probe(scale: float = 1.0, base: str | Path | None = None) -> tuple[float, float, float]:
    """(write, read, both at once) bytes per second of the disk tier's steady I/O
    (engine.devices.disk.files.steady_bandwidth), DISK_PROBE x `scale` bytes each, in a
    folder of its own in `base` (default: the default scratch folder), removed after, with
    the folders the probe made to hold it; zeros when it cannot be written. The opt-125m and
    Llama-shaped updates with half their chunks on disk (1.0-1.5 GiB each way) moved
    1.7-1.9 GiB/s both ways together; a probe of blocks written for the first time, 1.2-1.6.

    Both at once with AdamW computing beside, as the update computes each piece while the
    tier reads the next and writes the last: six pairs of probes in turn moved 5-10% less so
    (1.40-1.52 GiB/s against 1.54-1.66 alone, at 256 MiB and at 1 GiB)."""
    from engine.devices.disk import default_disk_dir
    from engine.devices.disk.files import ALIGN, direct_io_supported, steady_bandwidth

    base = Path(base).expanduser() if base is not None else default_disk_dir()
    made = [p for p in (base, *base.parents) if not p.exists()]  # innermost first
    try:
        base.mkdir(parents=True, exist_ok=True)
        folder = Path(tempfile.mkdtemp(prefix=".calibrate-", dir=base))
    except OSError:
        _remove_empty(made)
        return 0.0, 0.0, 0.0
    try:
        size = max(ALIGN * 4, int(DISK_PROBE * scale) // ALIGN * ALIGN)
        piece = max(ALIGN, min(DISK_PROBE_PIECE, size // 4) // ALIGN * ALIGN)
        # A piece's worth of state: weights and both moments.
        update = fused_adamw(max(1024, piece // 16), torch.device("cpu"))
        return steady_bandwidth(folder, nbytes=size, piece=piece,
                                direct=direct_io_supported(folder), beside=update)
    except OSError:
        return 0.0, 0.0, 0.0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        _remove_empty(made)


def _remove_empty(folders: list[Path]) -> None:
    """Remove these folders, innermost first, while they are empty (a run that made its
    scratch there meanwhile keeps them: rmdir refuses)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def disk_now(cal: Calibration, folder: str | Path | None, *,
             say: Callable[[str], None] | None = None, max_age: float = DISK_NOW_SECONDS,
             clock: Callable[[], float] = time.monotonic) -> Calibration:
    """`cal` with the disk rates of `folder` (where a run's scratch goes; None: the default
    folder) as probed now, or less than `max_age` seconds ago in this process; `cal`
    itself where the folder cannot be written (the calibration's rates stand). `say` tells
    that it measures."""
    from engine.devices.disk import default_disk_dir

    where = Path(folder).expanduser() if folder is not None else default_disk_dir()
    key = str(where.resolve())
    at, rates = _probed.get(key, (None, (0.0, 0.0, 0.0)))
    if at is None or clock() - at >= max_age:
        if say is not None:
            say(f"measuring the disk where the scratch goes ({where}), about 2 s")
        rates = probe(base=where)
        _probed[key] = (clock(), rates)
    write, read, duplex = rates
    if not (write and read and duplex):
        return cal
    return dataclasses.replace(cal, disk_write=write, disk_read=read, disk_duplex=duplex,
                               source=f"{cal.source}, the disk measured now")
