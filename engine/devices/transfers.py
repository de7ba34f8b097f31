"""Copies between host memory and the device, in stream order, through pinned staging.

Why staging: an asynchronous copy needs page-locked ("pinned") host memory, but pinning
every chunk's host tensors costs more than the tensors (PyTorch's pinned allocator rounds
each block up to a power of two and keeps freed blocks: ~25-30 GB pinned for the 18.4 GB
of opt-1.3b's bf16 host state), and a copy from pageable memory makes the host wait for
the whole compute stream first. So host tensors stay pageable, and every copy streams
through a small ring of pinned buffers allocated once: the host fills (or drains) one
buffer while the device copies another, so the memcpy overlaps the DMA.

Ordering, with no wait on the whole device anywhere:

- To the device (`to_device`): piece by piece, host -> staging buffer (a memcpy, which may
  also cast), then staging -> device queued on the compute stream. The host returns once
  the last piece is queued and may write `src` again at once. It waits only when a
  staging buffer is still being read by an earlier copy (backpressure: the host runs at
  most the ring's size ahead of the device).
- Ahead of time (`to_device_ahead`, a prefetch): the same on the side stream, which first
  waits for the compute stream (the destination block may have been freed there a moment
  ago). Returns an event; `wait(event)` makes the compute stream wait for it.
- To the host (`to_host`): device -> staging queued on the side stream after what the
  compute stream has queued so far; the staging -> `dst` memcpy happens when the host
  needs the buffer or the bytes: at once with `host_reads=True` (a wait on this copy's
  own events), else later ("landing"): before a copy that reads or overwrites that host
  memory, when the buffer is reused, or at `settle_host()`. Until it lands, the host must
  not read `dst`, and the device must not write `src` (freeing it is fine).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine.devices.streams import Streams

MiB = 2**20


@dataclass(frozen=True)
class Staging:
    """A ring of pinned staging buffers that every copy streams through.

    The defaults hold a regular opt-1.3b chunk (25.6M elements: 51 MB in bf16) in one
    buffer, so a prefetch, an on-demand fetch and a gradient copy-out can all be in flight
    without the host waiting; larger copies (the fp32 master, a big embedding) go in
    pieces, two or more buffers deep.
    """

    buffers: int = 4  # at least 2, so that filling one overlaps copying the other
    buffer_bytes: int = 64 * MiB  # a power of two: the pinned allocator rounds up to one

    def __post_init__(self) -> None:
        if self.buffers < 2:
            raise ValueError(f"staging needs at least 2 buffers to overlap, not {self.buffers}")
        if self.buffer_bytes < 16:
            raise ValueError(f"a staging buffer needs at least 16 bytes (one element of any "
                             f"dtype), not {self.buffer_bytes}")


class _Slot:
    """One staging buffer and the copy that last used it."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        self.event: object = None  # queued after the last copy that reads or writes it
        self.busy = False  # `event` has not been waited for
        self.landing: torch.Tensor | None = None  # host piece a device-to-host copy fills
        self.staged: torch.Tensor | None = None  # where that piece sits in the buffer


def _span(t: torch.Tensor) -> tuple[int, int]:
    storage = t.untyped_storage()
    return storage.data_ptr(), storage.data_ptr() + storage.nbytes()


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, a1 = _span(a)
    b0, b1 = _span(b)
    return a0 < b1 and b0 < a1 and a0 != a1 and b0 != b1


def _flat_pair(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether the copy can go in flat pieces (chunk tensors always can)."""
    return dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel()


class Transfers:
    """Host <-> device copies of one device, ordered by `streams`, staged if `staging`.

    Without staging every copy is queued directly (on the simulated device that is a plain
    copy; on CUDA a copy from pageable memory, which the driver makes synchronous).
    """

    def __init__(self, streams: Streams, staging: Staging | None) -> None:
        self.streams = streams
        self.staging = staging
        self._ring = ([_Slot(streams.pinned(staging.buffer_bytes)) for _ in range(staging.buffers)]
                      if staging else [])
        self._next = 0
        self._landings: deque[_Slot] = deque()  # slots with a landing, oldest first

    def pinned_bytes(self) -> int:
        """Host bytes pinned for staging: constant, however many chunks there are."""
        return sum(slot.buffer.untyped_storage().nbytes() for slot in self._ring)

    # --- to the device --------------------------------------------------------------------

    def to_device(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue `src` (host) -> `dst` (device) on the compute stream."""
        self._copy_in(dst, src, self.streams.compute())

    def to_device_ahead(self, dst: torch.Tensor, src: torch.Tensor) -> object:
        """Queue the copy on the side stream; returns the event `wait` takes."""
        side = self.streams.side()
        self.streams.stream_wait(side, self.streams.record(self.streams.compute()))
        self._copy_in(dst, src, side)
        return self.streams.record(side)

    def wait(self, pending: object) -> None:
        """Make the compute stream wait for a `to_device_ahead` copy."""
        self.streams.stream_wait(self.streams.compute(), pending)

    def _copy_in(self, dst: torch.Tensor, src: torch.Tensor, stream: object) -> None:
        self._land_overlapping(src)
        if not self._ring or not _flat_pair(dst, src):
            self.streams.dma(dst, src, stream)
            return
        d, s = dst.view(-1), src.view(-1)
        for a, b in self._pieces(d.numel(), dst.element_size()):
            slot = self._take()
            staged = slot.buffer[: (b - a) * dst.element_size()].view(dst.dtype)
            staged.copy_(s[a:b])
            self.streams.dma(d[a:b], staged, stream)
            self._mark(slot, stream)

    # --- to the host ------------------------------------------------------------------------

    def to_host(self, dst: torch.Tensor, src: torch.Tensor, *, host_reads: bool) -> None:
        """Queue `src` (device) -> `dst` (host); with `host_reads`, return once `dst` holds
        the bytes, else let them land later (see the module docstring)."""
        compute = self.streams.compute()
        if not self._ring or not _flat_pair(dst, src):
            self._land_overlapping(dst)  # an older landing there would overwrite this copy
            self.streams.dma(dst, src, compute)
            self.streams.host_wait(self.streams.record(compute))
            return
        side = self.streams.side()
        self.streams.stream_wait(side, self.streams.record(compute))
        self.streams.keep_alive(src, side)
        d, s = dst.view(-1), src.view(-1)
        last = None
        for a, b in self._pieces(d.numel(), src.element_size()):
            slot = last = self._take()
            staged = slot.buffer[: (b - a) * src.element_size()].view(src.dtype)
            self.streams.dma(staged, s[a:b], side)
            self._mark(slot, side)
            slot.landing, slot.staged = d[a:b], staged
            self._landings.append(slot)
        if host_reads and last is not None:
            self._land_through(self._landings.index(last) + 1)

    def settle_host(self) -> None:
        """Land every device-to-host copy still in a staging buffer."""
        self._land_through(len(self._landings))

    def close(self) -> None:
        self.settle_host()
        for slot in self._ring:
            self._finish(slot)
        self._ring = []

    # --- the ring -------------------------------------------------------------------------

    def _pieces(self, numel: int, itemsize: int) -> list[tuple[int, int]]:
        per = self.staging.buffer_bytes // itemsize
        return [(a, min(a + per, numel)) for a in range(0, numel, per)]

    def _take(self) -> _Slot:
        """The next buffer in the ring, once its previous copy is done with it."""
        slot = self._ring[self._next]
        self._next = (self._next + 1) % len(self._ring)
        if slot.landing is not None:
            # The ring hands out buffers in the order it filled them, so this is the
            # oldest landing: everything before it has landed already.
            self._land_through(self._landings.index(slot) + 1)
        self._finish(slot)
        return slot

    def _mark(self, slot: _Slot, stream: object) -> None:
        slot.event, slot.busy = self.streams.record(stream), True

    def _finish(self, slot: _Slot) -> None:
        if slot.busy:
            self.streams.host_wait(slot.event)
            slot.event, slot.busy = None, False
        if slot.landing is not None:
            slot.landing.copy_(slot.staged)
            slot.landing = slot.staged = None

    def _land_through(self, count: int) -> None:
        """Land the `count` oldest pending device-to-host pieces, in the order issued."""
        for _ in range(count):
            self._finish(self._landings.popleft())

    def _land_overlapping(self, host: torch.Tensor) -> None:
        """Land pending pieces up to the last one that writes memory `host` shares."""
        last = max((i for i, slot in enumerate(self._landings) if _overlap(slot.landing, host)),
                   default=-1)
        self._land_through(last + 1)
