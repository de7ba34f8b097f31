"""What other processes hold on our GPU, from NVML (nvidia-ml-py's `pynvml`).

The caching allocator only knows this process. A desktop, a second training run or a
notebook on the same GPU shrink what is really free, which is what makes offload planners
OOM; NVML lists every process with a context on the GPU. Anything NVML cannot say (not
installed, no driver, a MIG slice, Windows' WDDM hiding per-process use, a container
whose process ids NVML reports from outside) is None, which the UI shows as "N/A".
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any


def others_from(processes: Iterable[Any], pid: int) -> int | None:
    """Bytes held by every process in `processes` except `pid`.

    Args:
        processes: NVML process records (`.pid`, `.usedGpuMemory`; a process with both a
            compute and a graphics context may appear twice).
        pid: this process. If it is not listed (NVML sees the host's process ids), the one
            listed process is taken to be us; with more, which one is us is unknown: None.
    """
    used: dict[int, int | None] = {}
    for p in processes:
        used[p.pid] = p.usedGpuMemory
    if pid not in used:
        if len(used) > 1:
            return None
        return 0
    others = [b for p, b in used.items() if p != pid]
    if any(b is None for b in others):
        return None  # NVML_VALUE_NOT_AVAILABLE (WDDM): some use is unknown
    return int(sum(others))


class NvmlProbe:
    """Reads NVML for the GPU whose NVML UUID is `uuid` ("GPU-" + the CUDA device's uuid);
    None when the CUDA build does not report one."""

    def __init__(self, uuid: str | None) -> None:
        self.uuid = uuid
        self._handle: Any = None
        self._nvml: Any = None
        self._failed = False

    def _open(self) -> bool:
        if self._handle is not None:
            return True
        if self._failed or self.uuid is None:
            return False
        try:
            import pynvml

            pynvml.nvmlInit()
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(self.uuid)
            self._nvml = pynvml
        except Exception:  # ImportError, NVMLError_* (no driver, unknown UUID, MIG)
            self._failed = True
            return False
        return True

    def other_processes_bytes(self) -> int | None:
        """Bytes other processes hold on this GPU, or None where NVML cannot tell."""
        if not self._open():
            return None
        nvml = self._nvml
        try:
            processes = [*nvml.nvmlDeviceGetComputeRunningProcesses(self._handle),
                         *nvml.nvmlDeviceGetGraphicsRunningProcesses(self._handle)]
        except nvml.NVMLError:
            return None
        return others_from(processes, os.getpid())
