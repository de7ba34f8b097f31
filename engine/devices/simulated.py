"""SimulatedDevice: a device of `budget` bytes that lives in CPU memory.

Stands in for a GPU on machines without one: tensors "on the device" are separate CPU
tensors, a move is a real copy, and the budget is enforced by the engine's accounting.
Copies run the same code as on CUDA (engine.devices.transfers). A fetch ahead of use whose
source stays put until it is waited for runs on a copy thread beside the step, as a GPU's
copy engine does (engine.devices.streams.CopyingHostStreams); every other copy is done by
the time it returns. Given `staging`, copies also go through staging buffers (plain
memory here), so that path is tested without a GPU, its side stream on the thread too.
Chunk buffers given back are kept for the next of their size, as a GPU's caching allocator
keeps them (engine.devices.buffer_pool).
"""

from __future__ import annotations

import time

import torch
from torch.utils.weak import WeakIdKeyDictionary

from engine.config import format_size
from engine.devices.buffer_pool import BufferPool
from engine.devices.streams import CopyingHostStreams
from engine.devices.transfers import Staging, Transfers


class SimulatedDevice:
    """A device of `budget` bytes that lives in CPU memory.

    Args:
        budget: bytes the device holds; the engine keeps model and non-model bytes under it.
        staging: copy through a ring of staging buffers as CUDA does (default: copy
            directly, which is what a CPU does best). Their bytes are `pinned_bytes()`.
    """

    simulated = True

    def __init__(self, budget: int, *, staging: Staging | None = None) -> None:
        if budget <= 0:
            raise ValueError(f"the simulated device needs a positive budget, not {budget}")
        self.budget = int(budget)
        self.torch_device = torch.device("cpu")
        self.streams = CopyingHostStreams()
        self.transfers = Transfers(self.streams, staging)
        # Device and host tensors are both CPU tensors; this tells a copy's direction.
        self._device_tensors = WeakIdKeyDictionary()
        self.pool = BufferPool(self.budget)

    def describe(self) -> str:
        return f"simulated, {format_size(self.budget)}"

    def set_budget(self, budget: int) -> None:
        self.budget = int(budget)
        self.pool.trim(self.budget)

    def capacity(self, budget: int | None = None) -> int:
        return self.budget if budget is None else budget

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(numel, dtype=dtype)
        self._device_tensors[t] = True
        return t

    def own(self, t: torch.Tensor) -> None:
        self._device_tensors[t] = True

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor in memory the pool kept, where it kept one of its size."""
        t = self.empty(numel, dtype)  # untouched memory, which a kept buffer replaces
        self.pool.fill(t.untyped_storage(), t.nbytes)
        return t

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        self.pool.fill(storage, nbytes)

    def drain(self, storage: torch.UntypedStorage) -> None:
        self.streams.wait_for(storage)  # no copy still uses what is given back
        self.pool.drain(storage)

    def trim(self, keep_at_most: int | None = None) -> None:
        self.pool.trim()
        self.pool.bytes.limit = self.budget if keep_at_most is None else keep_at_most

    def kept_bytes(self) -> int:
        return self.pool.kept_bytes

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, host_reads: bool = True) -> float:
        """Copy `src` into `dst`; see CudaDevice.copy for what `host_reads` promises."""
        t0 = time.perf_counter()
        if src in self._device_tensors and dst not in self._device_tensors:
            self.transfers.to_host(dst, src, host_reads=host_reads)
        else:
            self.transfers.to_device(dst, src)
        return time.perf_counter() - t0

    def copy_ahead(self, dst: torch.Tensor, src: torch.Tensor, *,
                   src_kept: bool = False) -> tuple[object, float]:
        """A prefetch: the same code as on CUDA. On the copy thread where `src` is kept (or
        staged), else done by the time it returns."""
        t0 = time.perf_counter()
        if src_kept or self.transfers.staging is not None:
            pending = self.transfers.to_device_ahead(dst, src)
        else:
            self.transfers.to_device(dst, src)
            pending = None
        return pending, time.perf_counter() - t0

    def wait(self, pending: object) -> None:
        self.transfers.wait(pending)

    def settle_host(self) -> float:
        t0 = time.perf_counter()
        self.streams.synchronize()
        self.transfers.settle_host()
        return time.perf_counter() - t0

    def pinned_bytes(self) -> int:
        return self.transfers.pinned_bytes()

    def synchronize(self) -> None:
        self.streams.synchronize()

    def begin_step(self, model_bytes: int = 0) -> None:
        self.settle_host()

    def allocator_bytes(self) -> int | None:
        return None  # non-model bytes are counted by the tracer instead

    def reset_peak(self) -> None:
        pass

    def allocator_peak(self) -> int | None:
        return None

    def other_processes_bytes(self) -> int | None:
        return None  # no GPU to share

    def close(self) -> None:
        self.pool.trim()
        self.transfers.close()
        self.streams.close()
