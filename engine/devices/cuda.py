"""CudaDevice: a real GPU, capped at a budget.

- Copies never wait for the whole device: they are queued in stream order through pinned
  staging buffers (engine.devices.transfers); only a device-to-host copy whose bytes the
  host reads next makes the host wait, and then on that copy's own events.
- Host tensors are pageable; what is pinned is the staging ring, once (`pinned_bytes`).
- The budget is a hard cap: the caching allocator of this process may reserve no more
  (`torch.cuda.set_per_process_memory_fraction`), so a 6 GiB budget on a larger card
  behaves like a 6 GiB card. The cap is per process, so with several CudaDevices alive on
  one GPU (tests, benchmarks) the process gets the sum of their budgets, and the whole card
  again once none is left; each engine still keeps to its own budget by accounting.
- Capacity is re-read from the driver at each step's start (other processes and the
  allocator's cache change it), and NVML says what other processes hold.
- The allocator maps its memory as expandable segments (unless the user configured them
  in PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF): a chunk engine frees and allocates
  blocks of many sizes, and with fixed segments the reserved bytes ran 20% above the
  allocated ones on an H200 (opt-350m under auto), over a 6 GiB budget the count kept.
  What is left between reserved and allocated even so (2-3% measured) is kept free
  inside the cap: `ALLOCATOR_SHARE`.
"""

from __future__ import annotations

import os
import time
import weakref

import torch

from engine.config import format_size
from engine.devices.nvml import NvmlProbe
from engine.devices.streams import CudaStreams
from engine.devices.transfers import Staging, Transfers

DEFAULT_STAGING = Staging()
# The allocator reserves in segments (2 MiB for small blocks, 20 MiB for 1-10 MiB ones) and
# keeps cuBLAS's workspace (up to 32 MiB a stream on Hopper) among its blocks: below this a
# cap as small as the budget fails allocations the engine's byte count admits (the test
# suite's budgets of a few MiB). Larger budgets are capped exactly.
MIN_HARD_CAP = 256 * 2**20
# Share of the cap the engine's count leaves to the allocator (policy_plans.ALLOCATOR_SLACK
# is another figure, of the simulated device's host heap): its reserved bytes exceed
# its allocated ones by what rounding and split blocks waste. Measured on an H200 with
# expandable segments: 2.3% (opt-350m, 6 GiB, auto at margin 0.9) and 2.8% (opt-1.3b, 2 GiB,
# where 1.77 GiB allocated and 51 MiB more reserved left no room for the 198 MiB logits).
ALLOCATOR_SHARE = 0.05

# Every live CudaDevice, so that the process-wide cap can be the sum of their budgets.
_LIVE: weakref.WeakSet[CudaDevice] = weakref.WeakSet()
_TOTAL: dict[int, int] = {}  # bytes the driver reports per device, the cap's denominator


def _allocator_stats(index: int) -> dict:
    """The caching allocator's statistics, nested. One read costs about 20 us on an H200;
    `torch.cuda.memory_allocated` and `memory_reserved` flatten the same dictionary in
    Python first, about 160 us each: a step that read them at every placement decision
    spent ten times plain PyTorch's step on opt-125m."""
    return torch.cuda.memory_stats_as_nested_dict(index)


def allocator_slack(room: int, budget: int, unowned: int = 0) -> int:
    """Bytes of `room` (what a `budget` leaves the engine) its count must leave free inside
    the cap: the allocator's own (`ALLOCATOR_SHARE`) and `unowned` bytes (not the engine's,
    under the same cap), less what the cap gives beyond the budget (a budget under
    MIN_HARD_CAP is capped at MIN_HARD_CAP: a test's budget of a few MiB beside a 32 MiB
    cuBLAS workspace left by the reference it is compared with)."""
    cap = max(budget, MIN_HARD_CAP)
    return max(0, int(ALLOCATOR_SHARE * room) + unowned - (cap - budget))


def _expandable_segments() -> None:
    """Map the allocator's memory as expandable segments, unless the user chose."""
    chosen = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") + os.environ.get(
        "PYTORCH_ALLOC_CONF", "")
    if "expandable_segments" in chosen:
        return
    # torch 2.10 on: the accelerator-wide setter (the CUDA one warns that it is deprecated).
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) or getattr(
        torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return  # a torch without them: fixed segments
    try:
        setter("expandable_segments:True")
    except RuntimeError:
        pass


def _apply_process_cap(index: int) -> None:
    """Cap this process on GPU `index` at the sum of its live devices' budgets."""
    budgets = sum(max(d.budget, MIN_HARD_CAP) for d in list(_LIVE) if d.index == index)
    fraction = min(1.0, budgets / _TOTAL[index]) if budgets else 1.0
    torch.cuda.set_per_process_memory_fraction(fraction, index)


class CudaDevice:
    """The current (or `index`) CUDA device, capped at `budget` bytes.

    Args:
        budget: bytes this engine may use on the GPU; None = the whole GPU.
        index: CUDA device index; None = the current device.
        staging: the pinned ring copies stream through; None copies from pageable memory
            directly (each such copy makes the host wait for the compute stream).
    """

    simulated = False

    def __init__(self, budget: int | None = None, index: int | None = None, *,
                 staging: Staging | None = DEFAULT_STAGING) -> None:
        if not torch.cuda.is_available():
            raise RuntimeError("CudaDevice needs CUDA; use SimulatedDevice on this machine")
        _expandable_segments()
        self.index = torch.cuda.current_device() if index is None else index
        self.torch_device = torch.device("cuda", self.index)
        props = torch.cuda.get_device_properties(self.index)
        self.total = int(props.total_memory)
        self.budget = int(min(budget, self.total) if budget else self.total)
        self.transfers = Transfers(CudaStreams(self.index), staging)
        uuid = getattr(props, "uuid", None)  # NVML names a GPU by it, whatever the index
        self._nvml = NvmlProbe(f"GPU-{uuid}" if uuid is not None else None)
        self._foreign = 0  # bytes allocated at the step's start that are not this engine's
        self._before_steps: int | None = None  # the same, at the first step's start
        # Of those, what sits inside this device's share of the cap: what came with the
        # engine's steps (cuBLAS's workspaces, one per handle and stream, up to 32 MiB each
        # on Hopper, made by the first step and kept), and what was there before unless
        # another live device holds it (its chunks are under its own share; begin_step).
        self.unowned = 0
        self.reserved_peak = 0  # see allocator_reading
        self.allocated_peak = 0  # likewise, the allocator's own highest allocated bytes
        self._room: int | None = None  # free + reserved at the step's start (capacity)
        _TOTAL.setdefault(self.index, int(torch.cuda.mem_get_info(self.index)[1]))
        _LIVE.add(self)
        _apply_process_cap(self.index)
        # A device dropped without close() gives its share of the cap back when collected
        # (not at exit, when CUDA may be gone already).
        weakref.finalize(self, _apply_process_cap, self.index).atexit = False

    def describe(self) -> str:
        name = torch.cuda.get_device_name(self.index)
        return f"{name}, {format_size(self.budget)}"

    def set_budget(self, budget: int) -> None:
        smaller = budget < self.budget
        self.budget = int(min(budget, self.total))
        self._room = None
        _apply_process_cap(self.index)
        if smaller:
            # Blocks cached above the new cap would still be reused: hand them back.
            torch.cuda.empty_cache()

    def capacity(self, budget: int | None = None) -> int:
        """What this engine can hold now under `budget` (default: this device's, a budget
        about to be set otherwise): free memory plus what its allocator reserved
        (its cache included, which it reuses), never more than the budget, less what the
        allocator holds for the engine's steps that is not the engine's (`unowned`): that
        sits inside the hard cap too, and an engine that filled the whole budget would
        find the allocator out of memory before its own count said full.

        Free plus reserved is read from the driver at each step's start (`begin_step`),
        not at each of the hundreds of placement decisions a step makes: this process's
        own allocations, frees and emptied cache move bytes between the two and leave the
        sum as it was, and another process's show at the next step. Before the first step
        and after a budget change it is read at each call."""
        if self._room is None:
            free, _ = torch.cuda.mem_get_info(self.index)
            room = free + _allocator_stats(self.index)["reserved_bytes"]["all"]["current"]
        else:
            room = self._room
        budget = self.budget if budget is None else int(min(budget, self.total))
        room = min(budget, room)
        return int(max(0, room - allocator_slack(room, budget, self.unowned)))

    def other_processes_bytes(self) -> int | None:
        """Bytes other processes hold on this GPU (NVML), or None where NVML cannot tell."""
        return self._nvml.other_processes_bytes()

    # --- tensors and copies ---------------------------------------------------------------

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, device=self.torch_device)

    def own(self, t: torch.Tensor) -> None:
        pass  # a CUDA tensor says where it is

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        # Pageable: copies stream through the pinned staging ring instead.
        return torch.empty(numel, dtype=dtype)

    # The caching allocator keeps freed blocks for the next tensor of their size: a chunk
    # buffer needs no pool of the engine's here.

    def buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return self.empty(numel, dtype)

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        storage.resize_(nbytes)

    def drain(self, storage: torch.UntypedStorage) -> None:
        storage.resize_(0)

    def trim(self, keep_at_most: int | None = None) -> None:
        pass

    def kept_bytes(self) -> int:
        return 0

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, host_reads: bool = True) -> float:
        """Copy `src` into `dst` in stream order; returns the seconds the host spent.

        Host -> device: queued on the compute stream; `src` may be written again as soon
        as this returns, and kernels queued later see `dst`. Device -> host: with
        `host_reads` (the default) `dst` holds the bytes when this returns (a wait on
        this copy's events only); without, they land later, and the host must not read
        `dst` before `settle_host()` (a copy that reads `dst` settles it by itself).
        """
        t0 = time.perf_counter()
        if dst.is_cuda and not src.is_cuda:
            self.transfers.to_device(dst, src)
        elif src.is_cuda and not dst.is_cuda:
            self.transfers.to_host(dst, src, host_reads=host_reads)
        else:
            dst.copy_(src)  # same side: an ordinary kernel or memcpy
        return time.perf_counter() - t0

    def copy_ahead(self, dst: torch.Tensor, src: torch.Tensor, *,
                   src_kept: bool = False) -> tuple[object, float]:
        """Start a host-to-device copy on the side stream; returns (pending, seconds).

        Safe because: the side stream first waits for everything queued on the compute
        stream (the block `dst` occupies may have been freed there a moment ago); `dst` was
        allocated on the compute stream, which waits for the copy (`wait`) before it reads
        or frees `dst`, so the allocator never hands the block out mid-copy; `src` has been
        copied into staging by the time this returns. The seconds are the host's memcpy
        into staging; a wait that stalls the compute stream shows in forward or backward.
        """
        t0 = time.perf_counter()
        pending = self.transfers.to_device_ahead(dst, src)
        return pending, time.perf_counter() - t0

    def wait(self, pending: object) -> None:
        """Make the compute stream wait for a prefetch before it touches its tensor."""
        self.transfers.wait(pending)

    def settle_host(self) -> float:
        """Land every device-to-host copy made without `host_reads`; returns seconds."""
        t0 = time.perf_counter()
        self.transfers.settle_host()
        return time.perf_counter() - t0

    def pinned_bytes(self) -> int:
        """Page-locked host bytes this device holds (the staging ring), constant."""
        return self.transfers.pinned_bytes()

    def synchronize(self) -> None:
        """Wait until every kernel and copy queued on this GPU has run."""
        torch.cuda.synchronize(self.index)

    # --- measuring the step --------------------------------------------------------------

    def begin_step(self, model_bytes: int = 0) -> None:
        """Start measuring a step: peaks reset, and whatever is allocated now beyond the
        engine's `model_bytes` (another model, a plain-PyTorch baseline) is someone else's,
        so `allocator_bytes` and `allocator_peak` leave it out."""
        self.transfers.settle_host()
        stats = _allocator_stats(self.index)
        self._keep_peaks(stats)  # since the last reset, which no reading may have seen
        torch.cuda.reset_peak_memory_stats(self.index)
        free, _ = torch.cuda.mem_get_info(self.index)
        self._room = free + int(stats["reserved_bytes"]["all"]["current"])
        allocated = int(stats["allocated_bytes"]["all"]["current"])
        self._foreign = max(0, allocated - int(model_bytes))
        if self._before_steps is None:
            # Another live device's bytes are under its own share of the cap; with none
            # alive, what is there (a closed engine's cuBLAS workspaces, a library's
            # tensors) is under this device's: not room.
            others = any(d is not self and d.index == self.index for d in list(_LIVE))
            self._before_steps = self._foreign if others else 0
        self.unowned = max(0, self._foreign - self._before_steps)

    def allocator_bytes(self) -> int | None:
        """Bytes allocated now, less what was someone else's at `begin_step`."""
        allocated = _allocator_stats(self.index)["allocated_bytes"]["all"]["current"]
        return max(0, int(allocated) - self._foreign)

    def allocator_reading(self) -> tuple[int, int]:
        """(bytes allocated now, peak since `begin_step` or `reset_peak`), less what was
        someone else's at `begin_step`, from one read of the allocator's statistics."""
        stats = _allocator_stats(self.index)
        allocated = stats["allocated_bytes"]["all"]
        self._keep_peaks(stats)
        return (max(0, int(allocated["current"]) - self._foreign),
                max(0, int(allocated["peak"]) - self._foreign))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)

    def allocator_peak(self) -> int | None:
        """Peak bytes allocated since `begin_step` (or `reset_peak`), less the same."""
        stats = _allocator_stats(self.index)
        self._keep_peaks(stats)
        return max(0, int(stats["allocated_bytes"]["all"]["peak"]) - self._foreign)

    def _keep_peaks(self, stats: dict) -> None:
        """The run's highest reserved and allocated bytes (`reserved_peak`,
        `allocated_peak`): the peaks are reset at every reading and step, so each reading
        and each step's start keeps the highest so far here."""
        self.reserved_peak = max(self.reserved_peak, int(stats["reserved_bytes"]["all"]["peak"]))
        self.allocated_peak = max(self.allocated_peak,
                                  int(stats["allocated_bytes"]["all"]["peak"]))

    def close(self) -> None:
        """Land pending copies, give the staging ring back and drop this budget from the
        process cap."""
        self.transfers.close()
        _LIVE.discard(self)
        _apply_process_cap(self.index)
