"""ChunkTiers: the chunk manager's bytes on the device and the host, counted exactly.

Every tensor a chunk allocates or frees goes through `_alloc` / `_free`, so `device_bytes`
and `host_bytes` are counted, never estimated; every copy between the tiers goes through
`_copy`, which counts its bytes and seconds. The parts of engine.chunks.manager.ChunkManager
(device copies, gradients, residency, the disk side) build on these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.chunks import spill as disk
from engine.chunks.chunk import Chunk, DeviceCopy
from engine.chunks.data_parallel import DataParallel
from engine.chunks.flight import UpdateInFlight
from engine.chunks.state import TensorState
from engine.devices.device import ComputeDevice
from engine.placement import disk_rules, rules
from engine.placement.policy import Policy
from engine.placement.trace import Trace

S = TensorState


class ChunkTiers:
    """The state every part of the manager shares, and the exact byte accounting."""

    def __init__(self, chunks: list[Chunk], device: ComputeDevice, *,
                 non_model_now: Callable[[], int], on_change: Callable[[], None]) -> None:
        self.chunks = chunks
        self.device = device
        self.policy = Policy.AUTO
        self.rules = rules.rules_for(self.policy)
        self.trace: Trace | None = None  # the warm-up trace the rules forecast from
        self.non_model_now = non_model_now
        self.on_change = on_change
        self.device_bytes = 0
        self.host_bytes = 0
        self.grad_bytes = 0  # device gradient buffers alive now
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.transfer_seconds = 0.0
        self.strict = True  # raise when room cannot be made; off while tracing
        self.overrun = 0  # most bytes over capacity seen while not strict
        # A quiet micro-batch (engine.step.counting), as the runner found it at its start:
        # every chunk resident, placed as the counted one placed them, so the hooks idle
        # and no gradient needs room made (keep_slot_grad).
        self.quiet = False
        self._last_use: dict[int, int] = {}  # chunk -> position of its latest use (LRU)
        self.fetched_ahead: set[int] = set()  # copies prefetched, not used yet
        self.host_budget: int | None = None  # chunk bytes + I/O buffers on the host
        self.disk_piece = disk_rules.DISK_PIECE  # elements per piece of disk I/O
        self.spill: disk.Spill | None = None  # the disk tier, when the host budget needs it
        self._disk_base = (0, 0, 0.0)  # the tier's counters when a step last reported
        self.flight = UpdateInFlight()  # the last step's update, while the next forward runs
        # Chunk -> the parameters (offsets) whose late gradients (add_late_grad) its device
        # buffer holds, while that buffer gathers them.
        self._late: dict[int, set[int]] = {}
        self.sharding: DataParallel | None = None  # data parallel (engine.chunks.sharding)


    # --- accounting -------------------------------------------------------------------

    def count_host(self, chunks: list[Chunk]) -> None:
        """Take the host bytes of freshly packed chunks into the count (each tensor once:
        in fp32 the payload is the master)."""
        tensors = {id(t): t for c in chunks
                   for t in (c.payload, c.master, c.exp_avg, c.exp_avg_sq, c.host_grad)
                   if t is not None}
        self.host_bytes += sum(t.nbytes for t in tensors.values())
        self.on_change()

    def _alloc(self, where: str, numel: int, dtype: torch.dtype, zero: bool = False
               ) -> torch.Tensor:
        if where == "device":
            t = self.device.empty(numel, dtype)
            self.device_bytes += t.nbytes
        else:
            t = self.device.host_empty(numel, dtype)
            self.host_bytes += t.nbytes
        if zero:
            t.zero_()
        self.on_change()
        return t

    def _free(self, where: str, t: torch.Tensor | None) -> None:
        if t is None:
            return
        if where == "device":
            self.device_bytes -= t.nbytes
        else:
            self.host_bytes -= t.nbytes
        self.on_change()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, direction: str, *,
              host_reads: bool = True) -> None:
        """Copy between the tiers. `host_reads=False`: nothing on the host reads `dst` until
        the device settles it (ComputeDevice.settle_host), so the host need not wait."""
        self.transfer_seconds += self.device.copy(dst, src, host_reads=host_reads)
        if direction == "h2d":
            self.bytes_h2d += src.nbytes
        elif direction == "d2h":
            self.bytes_d2h += src.nbytes

    def _move(self, t: torch.Tensor, to: str) -> torch.Tensor:
        """A real move: copy to the other location, free the source."""
        src = "host" if to == "device" else "device"
        dst = self._alloc(to, t.numel(), t.dtype)
        self._copy(dst, t, "h2d" if to == "device" else "d2h")
        self._free(src, t)
        return dst

    def _buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A device buffer for a chunk's gradients, in memory the device kept from an
        earlier one where it keeps any (engine.devices.buffer_pool); `_free_buffer` gives
        it back."""
        t = self.device.buffer(numel, dtype)
        self.device_bytes += t.nbytes
        self.on_change()
        return t

    def _free_buffer(self, t: torch.Tensor) -> None:
        """Give a `_buffer` back; `t` is left without memory, so a stale use fails."""
        self._free("device", t)
        self.device.drain(t.untyped_storage())

    def _storage_resize(self, chunk: Chunk, on: bool) -> None:
        """Give the chunk's device copy its memory, or take it back (the parameters keep
        viewing the same storage, empty while the copy is absent)."""
        storage = chunk.device_payload.untyped_storage()
        if on:
            self.device.fill(storage, chunk.nbytes)
        else:
            self.device.drain(storage)
        chunk.set_copy(DeviceCopy.FRESH if on else DeviceCopy.ABSENT)
        self.device_bytes += chunk.nbytes if on else -chunk.nbytes
        self.on_change()

    def free_bytes(self, extra_non_model: int = 0, non_model: int | None = None) -> int:
        """Device bytes left beside `extra_non_model` more; `non_model`: the non-model
        bytes now, where the caller has read them already."""
        if non_model is None:
            non_model = self.non_model_now()
        return self.device.capacity() - self.device_bytes - non_model - extra_non_model
