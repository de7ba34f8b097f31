"""Streams and events: the few ordering primitives a copy between host and device needs.

A copy is *queued* on a stream and runs after everything queued there before it. An event
marks a point in a stream; the host can wait for it (only that point, not the whole
device), and another stream can be told to wait for it without the host waiting at all.

`CudaStreams` maps these onto CUDA streams and events. `HostStreams` is one timeline: a
copy runs at once, and events are no-ops, so the same copy code runs everywhere.
`CopyingHostStreams`, the simulated device's, runs the side stream's copies on a thread of
their own, as a GPU's copy engine runs beside its kernels: the host is the compute stream,
and meets a side copy only where it waits for it (its event), as on CUDA. Events are
opaque handles: callers only pass them back.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
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


class _Side:
    """The simulated device's copy engine: one thread that runs copies queued on it, in
    order, while the host computes (as a GPU's copy engine runs beside its kernels). The
    thread starts with the first copy, in the process that queues it (a forked child gets
    a thread of its own)."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._pid = 0
        self.last: Future | None = None
        self._failed: BaseException | None = None  # the first failure nobody was told of
        # What may still run, oldest first: (its future, the storages it uses).
        self._queued: deque[tuple[Future, tuple[int, ...]]] = deque()

    def submit(self, fn: Callable[..., object], *args: object,
               uses: tuple[int, ...] = ()) -> None:
        """Run `fn(*args)` after everything queued before it; `uses`: the data pointers of
        the storages it reads or writes (`wait_for`)."""
        if self._executor is None or self._pid != os.getpid():
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tuitrain-copies")
            self._pid, self.last = os.getpid(), None
            self._queued.clear()
        while self._queued and self._queued[0][0].done():
            self._queued.popleft()
        self.last = self._executor.submit(self._run, fn, args)
        if uses:
            self._queued.append((self.last, uses))

    def _run(self, fn: Callable[..., object], args: tuple) -> None:
        try:
            fn(*args)
        except BaseException as error:
            if self._failed is None:
                self._failed = error
            raise

    def wait(self, event: Future) -> None:
        """Until the work `event` ends is done; raises the first failure since the last
        wait, whichever copy it was."""
        try:
            event.result()
        finally:
            failed, self._failed = self._failed, None
        if failed is not None:
            raise failed

    def wait_for(self, data_ptr: int) -> None:
        """Until nothing queued uses the storage at `data_ptr` (see `wait`)."""
        last = next((future for future, uses in reversed(self._queued) if data_ptr in uses),
                    None)
        if last is not None and self._pid == os.getpid():
            self.wait(last)

    def drain(self) -> None:
        """Wait for everything queued (see `wait`)."""
        last, self.last = self.last, None
        self._queued.clear()
        if last is not None and self._pid == os.getpid():  # a parent's copies are not ours
            self.wait(last)

    def close(self) -> None:
        with contextlib.suppress(Exception):  # a failure nobody waited for: closing anyway
            self.drain()
        if self._executor is not None and self._pid == os.getpid():
            self._executor.shutdown(wait=True)
        self._executor = None


@functools.cache
def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def spare_core() -> bool:
    """Whether a core is left beside torch's threads for the simulated device's copy thread.
    Measured on a machine of 2 cores: with torch on one, fetches ahead on the other took
    3-4 points off a step under cpu; with torch on both, the same copies beside its OpenMP
    team added 5-7 points (a thread of the team waits for the core the copy took)."""
    return torch.get_num_threads() < _cores()


def _plain_bytes(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether `dst.copy_(src)` is one block of bytes (a chunk's payload always is)."""
    return (dst.dtype == src.dtype and dst.numel() == src.numel()
            and dst.is_contiguous() and src.is_contiguous())


def _memmove(dst: torch.Tensor, src: torch.Tensor) -> None:
    # One thread's memmove, not torch's copy kernel: that one splits a large copy over an
    # OpenMP team of its own, whose threads would take the cores from the compute's.
    ctypes.memmove(dst.data_ptr(), src.data_ptr(), dst.nbytes)


class CopyingHostStreams(HostStreams):
    """HostStreams whose side stream is a thread: a copy queued there (a prefetch) runs
    beside the host's compute, and the host waits for it only where it waits on CUDA.
    Where torch's threads take every core (`spare_core`), a side copy runs at once."""

    def __init__(self) -> None:
        self._side = _Side()

    def side(self) -> object:
        return self._side

    def dma(self, dst: torch.Tensor, src: torch.Tensor, stream: object) -> None:
        if stream is self._side:
            if spare_core():
                copy = _memmove if _plain_bytes(dst, src) else torch.Tensor.copy_
                self._side.submit(copy, dst, src, uses=(dst.untyped_storage().data_ptr(),
                                                        src.untyped_storage().data_ptr()))
                return
            self._side.drain()  # in order behind what the thread may still have
        dst.copy_(src)

    def record(self, stream: object) -> object:
        return self._side.last if stream is self._side else None

    def host_wait(self, event: object) -> None:
        if event is not None:
            self._side.wait(event)

    def stream_wait(self, stream: object, event: object) -> None:
        if stream is not self._side:
            self.host_wait(event)  # the host is the compute stream

    def synchronize(self) -> None:
        """Until every side copy is done."""
        self._side.drain()

    def wait_for(self, storage: torch.UntypedStorage) -> None:
        """Until no side copy reads or writes `storage`."""
        if storage.data_ptr():
            self._side.wait_for(storage.data_ptr())

    def close(self) -> None:
        self._side.close()


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
