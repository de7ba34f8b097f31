"""Compute devices: where chunks go when they are "on the device".

`SimulatedDevice` (engine.devices.simulated) stands in for a GPU on machines without one;
`CudaDevice` (engine.devices.cuda) is a real GPU. Both copy through the same stream-ordered
code (engine.devices.transfers), so the engine never asks which one it has, except for how
non-model bytes are measured.

Which one `make_device` picks: what the caller says (`simulate`), else the environment
(`TUITRAIN_SIMULATE=1` asks for the simulated device; the test suite sets it so that its
CPU tests stay CPU tests on a GPU machine, worker processes included), else CUDA when
there is a GPU.
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from engine.devices.cuda import CudaDevice
from engine.devices.simulated import SimulatedDevice

__all__ = ["ComputeDevice", "CudaDevice", "DeviceOutOfMemory", "SIMULATE_ENV",
           "SimulatedDevice", "default_precision", "host_has_bf16", "make_device",
           "uses_cuda"]

SIMULATE_ENV = "TUITRAIN_SIMULATE"


class DeviceOutOfMemory(RuntimeError):
    """The device cannot hold what the step needs, even after evicting every idle chunk."""


class ComputeDevice(Protocol):
    torch_device: torch.device
    simulated: bool
    budget: int

    def describe(self) -> str: ...

    def set_budget(self, budget: int) -> None: ...

    def capacity(self, budget: int | None = None) -> int:
        """Bytes the engine can hold on the device now, under `budget` (default: the
        device's own)."""
        ...

    def other_processes_bytes(self) -> int | None:
        """Bytes other processes hold on the same GPU; None where unknown ("N/A")."""
        ...

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A device tensor for a chunk's copy or gradients, uninitialised, in memory kept
        from an earlier buffer of its size where the device keeps any; give it back with
        `drain(t.untyped_storage())`."""
        ...

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give an empty device storage `nbytes` of memory, uninitialised (as `buffer`)."""
        ...

    def drain(self, storage: torch.UntypedStorage) -> None:
        """Take a device storage's memory back, leaving it empty."""
        ...

    def trim(self, keep_at_most: int | None = None) -> None:
        """Free the memory kept for later buffers (the step changed, and so their sizes),
        and from now hold at most `keep_at_most` in buffers, in use and kept (default:
        the budget)."""
        ...

    def kept_bytes(self) -> int:
        """Memory kept for later buffers (on the simulated device, host memory)."""
        ...

    def own(self, t: torch.Tensor) -> None:
        """`t`, which the model's ops made (autograd's gradient a chunk keeps), is on the
        device: a copy from it goes to the host (the simulated device tells a copy's
        direction by the tensors it made; on CUDA the tensor says where it is)."""
        ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, host_reads: bool = True) -> float:
        """Stream-ordered copy; device -> host without `host_reads` lands by `settle_host`."""
        ...

    def copy_ahead(self, dst: torch.Tensor, src: torch.Tensor, *,
                   src_kept: bool = False) -> tuple[object, float]:
        """A host-to-device copy that may run while the host goes on; returns (pending,
        seconds). `wait(pending)` before `dst` is read or given back. With `src_kept` the
        host writes `src` no sooner than that wait (else at once): the simulated device's
        copy thread may read it late; CUDA has staged it by the time this returns."""
        ...

    def wait(self, pending: object) -> None: ...

    def settle_host(self) -> float:
        """Land every device-to-host copy made without `host_reads`; returns seconds."""
        ...

    def pinned_bytes(self) -> int:
        """Page-locked host bytes the device holds for copies (0 on the simulated device)."""
        ...

    def synchronize(self) -> None:
        """Wait until the work queued on the device has run (a step's time ends there)."""
        ...

    def begin_step(self, model_bytes: int = 0) -> None:
        """Start measuring a step; bytes allocated now beyond `model_bytes` are not ours."""
        ...

    def allocator_bytes(self) -> int | None: ...

    def allocator_reading(self) -> tuple[int, int]:
        """(allocator_bytes(), allocator_peak()) at once; only where those are not None."""
        ...

    def reset_peak(self) -> None: ...

    def allocator_peak(self) -> int | None: ...

    def close(self) -> None: ...


def simulation_requested() -> bool:
    """Whether the environment asks for the simulated device (TUITRAIN_SIMULATE=1)."""
    value = os.environ.get(SIMULATE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{SIMULATE_ENV} must be 1 (simulate) or 0, not {value!r}")
    return value == "1"


def uses_cuda(simulate: bool | None = None) -> bool:
    """Whether `make_device(..., simulate)` picks CUDA: the caller's word, else the
    environment's, else whether there is a GPU. For callers that choose defaults by
    device (precision, budget, the planner's device model)."""
    if simulate is None:
        simulate = simulation_requested() or not torch.cuda.is_available()
    return not simulate


def host_has_bf16() -> bool:
    """Whether this CPU has bf16 units (AVX512-BF16 or AMX), which run bf16 matmuls faster
    than fp32 ones: on a Xeon with AMX, the calibration's bf16 matmuls came to 1.6-2.7
    TFLOPS against fp32's 0.43, and opt-125m's step on the simulated device took 0.66 s in
    bf16 against 1.00 s in fp32. A CPU without them emulates bf16 and runs it several times
    slower than fp32 (opt-1.3b on an AMD EPYC without them: about 40 min a step)."""
    cpu = getattr(torch, "cpu", None)
    checks = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(callable(getattr(cpu, name, None)) and getattr(cpu, name)() for name in checks)


def default_precision(cuda: bool) -> str:
    """The precision a run computes in unless told: bf16 on a GPU that has it, fp16 on
    older GPUs; on the simulated device bf16 where the CPU has bf16 units, else fp32."""
    if cuda:
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if host_has_bf16() else "fp32"


def make_device(budget: int | None, simulate: bool | None = None) -> ComputeDevice:
    """CUDA when `uses_cuda(simulate)`, else a simulated device of `budget`."""
    if not uses_cuda(simulate):
        if budget is None:
            raise ValueError("the simulated device needs a device_budget (e.g. '6GiB')")
        return SimulatedDevice(budget)
    return CudaDevice(budget)
