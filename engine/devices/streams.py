"""Streams and events: the few ordering primitives a copy between host and device needs.

A copy is *queued* on a stream and runs after everything queued there before it. An event
marks a point in a stream; the host can wait for it (only that point, not the whole
device), and another stream can be told to wait for it without the host waiting at all.

`CudaStreams` maps these onto CUDA streams and events. `HostStreams` is the simulated
device's: there is one timeline, a copy runs at once, and events are no-ops, so the same
copy code runs on both devices. Events are opaque handles: callers only pass them back.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Streams(Protocol):
    def compute(self) -> object:
        """The stream the model's kernels run on (the current one)."""
        ...

    def side(self) -> object:
        """A second stream for copies that overlap the compute stream."""
        ...

    def pinned(self, nbytes: int) -> torch.Tensor:
        """A uint8 host buffer the device can read and write asynchronously."""
        ...

    def dma(self, dst: torch.Tensor, src: torch.Tensor, stream: object) -> None:
        """Queue `dst.copy_(src)` on `stream`; the host does not wait for it."""
        ...

    def record(self, stream: object) -> object:
        """An event at the current end of `stream`."""
        ...

    def host_wait(self, event: object) -> None:
        """Block the host until `event` has passed (that stream's work up to it is done)."""
        ...

    def stream_wait(self, stream: object, event: object) -> None:
        """Make work queued on `stream` from now on wait for `event`; the host goes on."""
        ...

    def keep_alive(self, tensor: torch.Tensor, stream: object) -> None:
        """Tell the allocator that `stream` reads `tensor`, so freeing it on another stream
        does not hand its memory out before that read is done."""
        ...


class HostStreams:
    """The simulated device's timeline: everything runs at once, in program order."""

    def compute(self) -> object:
        return None

    def side(self) -> object:
        return None

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8)  # "pinned" is plain memory here

    def dma(self, dst: torch.Tensor, src: torch.Tensor, stream: object) -> None:
        dst.copy_(src)

    def record(self, stream: object) -> object:
        return None

    def host_wait(self, event: object) -> None:
        pass

    def stream_wait(self, stream: object, event: object) -> None:
        pass

    def keep_alive(self, tensor: torch.Tensor, stream: object) -> None:
        pass


def _power_of_two_ceil(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class CudaStreams:
    """CUDA streams of device `index`: the current stream computes, one side stream copies."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._side = torch.cuda.Stream(index)

    def compute(self) -> object:
        return torch.cuda.current_stream(self.index)

    def side(self) -> object:
        return self._side

    def pinned(self, nbytes: int) -> torch.Tensor:
        # PyTorch's pinned allocator rounds every block up to a power of two; asking for the
        # rounded size makes the tensor's storage report what is really pinned.
        return torch.empty(_power_of_two_ceil(nbytes), dtype=torch.uint8, pin_memory=True)

    def dma(self, dst: torch.Tensor, src: torch.Tensor, stream: object) -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record(self, stream: object) -> object:
        event = torch.cuda.Event()
        event.record(stream)
        return event

    def host_wait(self, event: object) -> None:
        event.synchronize()

    def stream_wait(self, stream: object, event: object) -> None:
        stream.wait_event(event)

    def keep_alive(self, tensor: torch.Tensor, stream: object) -> None:
        tensor.record_stream(stream)
