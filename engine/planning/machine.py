"""What a calibration depends on and what disturbs it: the machine's fingerprint (the CPU
model, the vector instructions torch's kernels use on it, the cores, the torch version, the
GPU) and how busy its cores are.

The vector instructions are in it because a CPU's model name does not tell them: a cloud
machine named "AMD EPYC" was measured here with AVX2 and no bf16 instructions one day
(bf16 matmuls about 13x slower than fp32) and with AVX-512 and bf16 ones another (bf16
twice as fast as fp32), under the same name and core count.

A calibration times kernels on the CPU's cores; other processes taking those cores slow
every figure down (one taken at a load of 11-22 on this project's 2-core machine forecast
steps 2.25 times too slow). So a measurement records the load it was taken under, and one
taken while the cores were busy is measured again once they are quiet
(engine.planning.calibration.calibration).
"""

from __future__ import annotations

import hashlib
import math
import os
import platform
from pathlib import Path

import torch

__all__ = ["busy", "fingerprint", "load_average", "quiet"]


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpu() -> str:
    """The GPU's name, driver and memory, or "" without one (or when simulating)."""
    from engine.devices.device import uses_cuda

    if not uses_cuda():
        return ""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    driver = ""
    try:
        import pynvml

        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:  # NVML absent or failing: the name and memory still tell the GPU
        driver = "driver ?"
    return f"{props.name}, {driver}, {props.total_memory // 2**20} MiB"


def _cpu_capability() -> str:
    """The widest vector instructions torch's CPU kernels use here ("AVX2", "AVX512",
    "DEFAULT", ...), or "" where this torch does not say."""
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except (AttributeError, RuntimeError):
        return ""


def fingerprint() -> tuple[str, str]:
    """(a short hash, the same in words) of what a calibration depends on."""
    capability = _cpu_capability()
    words = (f"{_cpu_model()}{f' ({capability})' if capability else ''}, "
             f"{os.cpu_count()} cores; torch {torch.__version__}; "
             f"{_gpu() or 'no GPU (simulated device)'}")
    return hashlib.sha256(words.encode()).hexdigest()[:16], words


def load_average() -> float | None:
    """Runnable processes over the last minute (the 1-minute load average), or None where
    the system does not say."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def load_beside(start: float | None, end: float | None, seconds: float, own: int
                ) -> float | None:
    """The load other work put on the machine while a measurement ran for `seconds` on
    `own` threads, from the 1-minute load averages at its start and its end. The average
    moves toward what runs by 1 - exp(-seconds / 60) of the way: what it moved beyond the
    measurement's own threads is the others'. The start's own figure lags by up to a
    minute: a calibration started just as another job did read 0.9 on 2 cores, ran beside
    it (its reference decoder at 2.3x its forecast, against 1.3-1.4 when quiet) and was
    kept as quiet. Where the measurement is too short for the average to move, the higher
    of the two; None where the system gives no load average."""
    if start is None or end is None:
        return start if end is None else end
    moved = 1 - math.exp(-seconds / 60)
    if moved < 0.05:
        return max(start, end)
    return max(start, (end - start * (1 - moved)) / moved - own)


def busy(load: float | None) -> bool:
    """Other work held more than half the cores (not `quiet`): a measurement's parallel
    kernels then wait for cores. Measured on 2 cores: at a load of 1.8, fp32 matmuls of
    width 768 ran at 123 GFLOP/s, where a quiet machine gives 435."""
    return load is not None and not quiet(load)


def quiet(load: float | None) -> bool:
    """At most half the cores taken: a measurement now sees the machine's own speed."""
    return load is not None and load <= (os.cpu_count() or 1) / 2
