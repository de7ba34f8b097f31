"""Compute devices: where chunks go when they are "on the device".

`SimulatedDevice` stands in for a GPU on machines without one: tensors "on the device" are
separate CPU tensors, a move is a real copy, and the budget is enforced by the engine's
accounting. `CudaDevice` is a real GPU. The engine never asks which one it has, except for
how non-model bytes are measured.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

from engine.config import format_size


class DeviceOutOfMemory(RuntimeError):
    """The device cannot hold what the step needs, even after evicting every idle chunk."""


class ComputeDevice(Protocol):
    torch_device: torch.device
    simulated: bool
    budget: int

    def describe(self) -> str: ...

    def set_budget(self, budget: int) -> None: ...

    def capacity(self) -> int: ...

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> float: ...

    def copy_ahead(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[object, float]: ...

    def wait(self, pending: object) -> None: ...

    def allocator_bytes(self) -> int | None: ...

    def reset_peak(self) -> None: ...

    def allocator_peak(self) -> int | None: ...


class SimulatedDevice:
    """A device of `budget` bytes that lives in CPU memory."""

    simulated = True

    def __init__(self, budget: int) -> None:
        if budget <= 0:
            raise ValueError(f"the simulated device needs a positive budget, not {budget}")
        self.budget = int(budget)
        self.torch_device = torch.device("cpu")

    def describe(self) -> str:
        return f"simulated, {format_size(self.budget)}"

    def set_budget(self, budget: int) -> None:
        self.budget = int(budget)

    def capacity(self) -> int:
        return self.budget

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> float:
        t0 = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - t0

    def copy_ahead(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[object, float]:
        """A prefetch: here as real and as synchronous as any copy, nothing left pending."""
        return None, self.copy(dst, src)

    def wait(self, pending: object) -> None:
        pass

    def allocator_bytes(self) -> int | None:
        return None  # non-model bytes are counted by the tracer instead

    def reset_peak(self) -> None:
        pass

    def allocator_peak(self) -> int | None:
        return None


class CudaDevice:
    """The current CUDA device, optionally capped at `budget` bytes.

    Capacity is re-read from the driver on every call: other processes and fragmentation
    change what is really free, and ignoring that is what makes offload planners OOM.
    """

    simulated = False

    def __init__(self, budget: int | None = None, index: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevice needs CUDA; use SimulatedDevice on this machine")
        self.index = torch.cuda.current_device() if index is None else index
        self.torch_device = torch.device("cuda", self.index)
        total = torch.cuda.get_device_properties(self.index).total_memory
        self.total = total
        self.budget = int(min(budget, total) if budget else total)
        # Prefetches run here, so a copy for the next module overlaps this one's kernels.
        self.side_stream = torch.cuda.Stream(self.index)

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.index)
        return f"{name}, {format_size(self.budget)}"

    def set_budget(self, budget: int) -> None:
        self.budget = int(min(budget, self.total))

    def capacity(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.index)
        return int(min(self.budget, free + torch.cuda.memory_allocated(self.index)))

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # Pinned once at allocation and reused for the life of the chunk: pinning on the fly
        # is slower than a plain copy.
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> float:
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.current_stream(self.index).synchronize()
        return time.perf_counter() - t0

    def copy_ahead(self, dst: torch.Tensor, src: torch.Tensor) -> tuple[object, float]:
        """Start a host-to-device copy on the side stream; returns (pending, 0.0).

        Safe because: the side stream first waits for everything queued on the compute
        stream (the block `dst` occupies may have been freed there a moment ago); `dst` was
        allocated on the compute stream, which waits for the copy (`wait`) before it reads
        or frees `dst`, so the allocator never hands the block out mid-copy; `src` is pinned
        host memory that nothing writes until the step's optimizer, after every wait. The
        host does not block, so no transfer time is counted; a wait that stalls the compute
        stream shows in the forward or backward time instead.
        """
        compute = torch.cuda.current_stream(self.index)
        self.side_stream.wait_stream(compute)
        with torch.cuda.stream(self.side_stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.side_stream)
        return done, 0.0

    def wait(self, pending: object) -> None:
        """Make the compute stream wait for a prefetch before it touches its tensor."""
        torch.cuda.current_stream(self.index).wait_event(pending)

    def allocator_bytes(self) -> int | None:
        return int(torch.cuda.memory_allocated(self.index))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)

    def allocator_peak(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.index))


def make_device(budget: int | None, simulate: bool | None = None) -> ComputeDevice:
    """CUDA when present (unless told to simulate), else a simulated device of `budget`."""
    if simulate is None:
        simulate = not torch.cuda.is_available()
    if simulate:
        if budget is None:
            raise ValueError("the simulated device needs a device_budget (e.g. '6GiB')")
        return SimulatedDevice(budget)
    return CudaDevice(budget)
