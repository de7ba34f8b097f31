"""DiskTier: the scratch folder as a memory tier, with I/O that overlaps compute.

What goes through it are *regions*: a named span of a scratch file (a chunk's optimizer
state, its payload, ...), always read and written whole, through I/O buffers allocated once
(aligned for O_DIRECT; from the device's host allocator). Two threads do the I/O, one
reading and one writing, so a read of the next chunk and a write of the previous one both
overlap the update of the current one; each keeps its own order.

All bookkeeping (which buffer is free, which write is pending, which failed) is done by the
caller's thread; the I/O threads only move bytes. A buffer being written goes back to its
pool once the caller sees the write done (`reap`), never earlier. A write that fails keeps
its buffer: the bytes it held are the latest copy of that region, and the caller may still
read them (`load`) or retry the write (`retry_failed`); the pool gets a new buffer in its
place so the caller can go on.

Which regions exist and when they move is decided above (engine.chunks.spill, by the
placement rules); this module knows bytes and files only.
"""

from __future__ import annotations

import errno
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.config import format_size
from engine.devices.disk.files import (
    ALIGN,
    ScratchFile,
    aligned,
    aligned_empty,
    direct_io_supported,
    sequential_bandwidth,
)
from engine.devices.disk.scratch import ScratchFolder

BANDWIDTH_PROBE = 16 * 2**20  # bytes written and read back to measure the disk at start


def probe_bytes(region_bytes: int) -> int:
    """Bytes the bandwidth probe of a tier for `region_bytes` of regions writes: at most
    BANDWIDTH_PROBE, and no more than the regions will take (whole probe pieces), so that a
    disk with room for the regions has room for the probe (its file goes before any region
    is made)."""
    piece = 4 * ALIGN  # the probe writes in 4 pieces, each a whole block
    return min(BANDWIDTH_PROBE, max(piece, region_bytes // piece * piece))


def space_needed(region_bytes: int) -> int:
    """Free bytes a new tier needs for `region_bytes` of regions, its probe counted."""
    return max(region_bytes, probe_bytes(region_bytes))

Empty = Callable[[int, torch.dtype], torch.Tensor]


class DiskTierError(OSError):
    """A read or write of the scratch folder failed; says what, where, and why. The data
    it concerned is not lost (see the module docstring)."""


@dataclass(frozen=True)
class Region:
    """A span of one scratch file."""

    file: ScratchFile
    offset: int
    nbytes: int  # a multiple of ALIGN


@dataclass
class _Pool:
    """Equal I/O buffers of one size; `count` is how many the placement asked for."""

    nbytes: int
    count: int
    free: list[torch.Tensor] = field(default_factory=list)
    # The pool's buffers wherever they are (free, with the caller, being written), by id.
    # A buffer that holds a failed write is the failure's, not the pool's.
    members: dict[int, torch.Tensor] = field(default_factory=dict)

    def grow(self, empty: Empty | None) -> None:
        while len(self.members) < self.count:
            buffer = aligned_empty(self.nbytes, empty)
            self.members[id(buffer)] = buffer
            self.free.append(buffer)


@dataclass
class _Write:
    key: Hashable
    region: Region
    buffer: torch.Tensor
    pool: str
    future: Future


class DiskTier:
    """Regions in a ScratchFolder, and the buffers and threads that move them.

    Args:
        folder: the run's own scratch folder (removed by `close`).
        empty: the host allocator I/O buffers come from (the device's `host_empty`).
        direct: use O_DIRECT; None = where the filesystem accepts it.
        probe: bytes written and read to measure the disk (probe_bytes).
    """

    def __init__(self, folder: ScratchFolder, *, empty: Empty | None = None,
                 direct: bool | None = None, probe: int = BANDWIDTH_PROBE) -> None:
        self.folder = folder
        self.empty = empty
        self.direct = direct_io_supported(folder.path) if direct is None else direct
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="tuitrain-disk-read")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="tuitrain-disk-write")
        self._files: dict[str, ScratchFile] = {}
        self._pools: dict[str, _Pool] = {}
        self._writes: deque[_Write] = deque()  # pending, in issue order
        self._failed: dict[Hashable, _Write] = {}  # region key -> the write that failed
        self.bytes_read = 0  # issued, since the counters were last reset
        self.bytes_written = 0
        # The thread that made the tier (the engine's) blocked on the disk; an update that
        # overlaps the next step waits in its own thread, alongside the step, uncounted.
        self.wait_seconds = 0.0
        self._owner = threading.get_ident()
        self.read_seconds = 0.0  # the reading thread busy (for throughput)
        self.write_seconds = 0.0
        self.busy_seconds = 0.0  # either thread busy: the disk's time spent on the tier
        self._busy = 0
        self._busy_since = 0.0
        self._busy_lock = threading.Lock()
        self.errors: list[DiskTierError] = []  # writes that failed, until take_errors()
        self.failing = False  # a write failed, and no retry has succeeded since
        self.closed = False
        # The disk's sequential (write, read) bytes per second, measured once here with
        # `probe` bytes: what the tier's own throughput is shown against.
        try:
            self.bandwidth = sequential_bandwidth(folder.path, write_bytes=probe,
                                                  read_bytes=probe, piece=probe // 4,
                                                  direct=self.direct)
        except OSError as e:
            self.close()
            raise self._error(f"could not measure the disk with {format_size(probe)} "
                              f"in {folder.path}", e) from e

    # --- files and buffers ----------------------------------------------------------------

    def regions(self, name: str, sizes: dict[str, int]) -> dict[str, Region]:
        """A new file `name` holding one region per entry of `sizes` (bytes, each rounded
        up to ALIGN), reserved on disk now. Raises DiskTierError when the disk is full."""
        offsets, end = {}, 0
        for part, nbytes in sizes.items():
            offsets[part] = (end, aligned(nbytes))
            end += aligned(nbytes)
        path = self.folder.file(name)
        try:
            file = ScratchFile(path, end, direct=self.direct)
        except OSError as e:
            raise self._error(f"could not reserve {format_size(end)} for {path}", e) from e
        self._files[name] = file
        return {part: Region(file, off, n) for part, (off, n) in offsets.items()}

    def drop_file(self, name: str) -> None:
        """Delete file `name`, once the writes still going to it are done (and what failed
        writes of it held is let go: the caller has the bytes home)."""
        file = self._files.pop(name, None)
        if file is None:
            return
        for write in [w for w in self._writes if w.region.file is file]:
            self._wait_write(write)
        for key in [k for k, w in self._failed.items() if w.region.file is file]:
            self.forget(key)
        file.close()
        file.path.unlink(missing_ok=True)

    def size_pools(self, sizes: dict[str, tuple[int, int]]) -> None:
        """Pools named in `sizes` get (count, bytes per buffer): a pool whose buffers are
        of another size is made anew (the placement counts the size it names, smaller
        too), one with too few is topped up, one no longer named is freed once idle."""
        self.reap()
        for name, (count, nbytes) in sizes.items():
            nbytes = aligned(nbytes)
            pool = self._pools.get(name)
            if pool is None or pool.nbytes != nbytes:
                if pool is not None:
                    self._drain(name)
                pool = self._pools[name] = _Pool(nbytes, count)
            pool.count = count
            pool.grow(self.empty)
        for name in [n for n in self._pools if n not in sizes]:
            self._drain(name)
            if not self._pools[name].members:
                del self._pools[name]

    def _drain(self, name: str) -> None:
        """Wait for the pool's writes; free its idle buffers."""
        for write in [w for w in self._writes if w.pool == name]:
            self._wait_write(write)
        pool = self._pools[name]
        for buffer in pool.free:
            del pool.members[id(buffer)]
        pool.free.clear()

    @property
    def buffer_bytes(self) -> int:
        """Host bytes of the I/O buffers (those holding failed writes included). Safe to ask
        from any thread (a snapshot while an update runs)."""
        pools = sum(len(p.members) * (p.nbytes + ALIGN) for p in list(self._pools.values()))
        return pools + sum(w.buffer.numel() + ALIGN for w in list(self._failed.values()))

    def acquire(self, pool: str, *, wait: bool = True) -> torch.Tensor | None:
        """A free buffer of `pool`; without `wait`, None when none is free now. Waiting
        means waiting for the oldest write of that pool to finish."""
        self.reap()
        p = self._pools[pool]
        while not p.free:
            pending = [w for w in self._writes if w.pool == pool]
            if not wait:
                return None
            if not pending:
                raise RuntimeError(f"no {pool} I/O buffer is free and none is being written: "
                                   f"the caller holds all {p.count}")
            self._wait_write(pending[0])
        return p.free.pop()

    def release(self, pool: str, buffer: torch.Tensor) -> None:
        """Give a buffer back to its pool. One that is not the pool's (it held a failed
        write, or its pool was resized) is the failure's to keep, or freed."""
        p = self._pools.get(pool)
        if p is None or id(buffer) not in p.members or p.members[id(buffer)] is not buffer:
            return
        if len(p.members) > p.count:
            del p.members[id(buffer)]
            return
        p.free.append(buffer)

    # --- moving regions ---------------------------------------------------------------------

    def pending_write(self, key: Hashable) -> bool:
        return any(w.key == key for w in self._writes)

    def load(self, key: Hashable, region: Region, pool: str, *, wait: bool = True,
             nbytes: int | None = None) -> tuple[torch.Tensor, Future | None] | None:
        """Start reading `region` (its first `nbytes`, default all) into a buffer of `pool`.

        Returns (buffer, future): `finish(future)` before reading the buffer. A region
        whose last write failed comes back in the buffer that holds it, with no future; the
        failure keeps that buffer until the region is stored again (or `forget`), so giving
        it back loses nothing. Without `wait` (read-ahead), None when that would mean
        waiting: for a buffer, or for a write of the same region, which must land before
        the region is read back.
        """
        self.reap()
        if self.pending_write(key):
            if not wait:
                return None
            for write in [w for w in self._writes if w.key == key]:
                self._wait_write(write)
        failed = self._failed.get(key)
        if failed is not None:
            return failed.buffer, None
        buffer = self.acquire(pool, wait=wait)
        if buffer is None:
            return None
        n = region.nbytes if nbytes is None else aligned(nbytes)
        self.bytes_read += n
        future = self._reader.submit(self._timed, "read_seconds", region.file.read,
                                     buffer[:n], region.offset)
        return buffer, future

    def finish(self, future: Future | None) -> None:
        """Wait for a read started by `load`; raises DiskTierError if it failed."""
        if future is None:
            return
        t0 = time.perf_counter()
        try:
            future.result()
        except OSError as e:
            raise self._error("could not read from the scratch folder", e) from e
        finally:
            self._waited(time.perf_counter() - t0)

    def store(self, key: Hashable, region: Region, buffer: torch.Tensor, pool: str) -> None:
        """Start writing `buffer` (its first region.nbytes) to `region`; the buffer is the
        tier's until the write is done, and goes back to `pool` then."""
        self.forget(key)  # an older copy held after a failure is outdated
        self.bytes_written += region.nbytes
        future = self._writer.submit(self._timed, "write_seconds", region.file.write,
                                     buffer[:region.nbytes], region.offset)
        self._writes.append(_Write(key, region, buffer, pool, future))

    def forget(self, key: Hashable) -> None:
        """Drop what a failed write of `key` held: outdated, or kept elsewhere now. (Its
        buffer was replaced in the pool when the write failed: it is simply let go, once
        whoever still uses it is done.)"""
        self._failed.pop(key, None)

    def write_now(self, region: Region, buffer: torch.Tensor,
                  key: Hashable | None = None) -> None:
        """Write and wait (placement changes, checkpoints); raises DiskTierError. A region
        `key` held after a failed write is no longer held once this succeeds."""
        self.bytes_written += region.nbytes
        t0 = time.perf_counter()
        try:
            self._timed("write_seconds", region.file.write, buffer[:region.nbytes],
                        region.offset)
        except OSError as e:
            raise self._error(f"could not write {format_size(region.nbytes)} to "
                              f"{region.file.path}", e) from e
        finally:
            self._waited(time.perf_counter() - t0)
        if key is not None:
            self.forget(key)

    def _waited(self, seconds: float) -> None:
        if threading.get_ident() == self._owner:
            self.wait_seconds += seconds

    def _timed(self, counter: str, fn: Callable, *args: object) -> None:
        with self._busy_lock:
            t0 = time.perf_counter()
            if self._busy == 0:
                self._busy_since = t0
            self._busy += 1
        try:
            fn(*args)
        finally:
            with self._busy_lock:
                t1 = time.perf_counter()
                setattr(self, counter, getattr(self, counter) + t1 - t0)
                self._busy -= 1
                if self._busy == 0:
                    self.busy_seconds += t1 - self._busy_since

    # --- writes finishing -----------------------------------------------------------------

    def reap(self) -> None:
        """Take back the buffers of writes that are done (the caller's thread only)."""
        while self._writes and self._writes[0].future.done():
            self._settle(self._writes.popleft())

    def _wait_write(self, write: _Write) -> None:
        t0 = time.perf_counter()
        try:
            write.future.exception()  # waits; raises nothing
        finally:
            self._waited(time.perf_counter() - t0)
        self._writes.remove(write)
        self._settle(write)

    def _settle(self, write: _Write) -> None:
        error = write.future.exception()
        if error is None:
            self.release(write.pool, write.buffer)
            return
        write.future = _failed_future(error)
        self.errors.append(self._error(f"could not write {format_size(write.region.nbytes)} "
                                       f"to {write.region.file.path}", error))
        self._failed[write.key] = write  # replaces an older failure of the same region
        self.failing = True
        pool = self._pools[write.pool]
        if pool.members.get(id(write.buffer)) is write.buffer:
            del pool.members[id(write.buffer)]  # the failure's now; a new one for the pool
            pool.grow(self.empty)

    def flush(self) -> None:
        """Wait for every pending write."""
        while self._writes:
            self._wait_write(self._writes[0])

    def take_errors(self) -> list[DiskTierError]:
        """The writes that failed since the last call (their regions may be held still)."""
        self.reap()
        errors, self.errors = self.errors, []
        return errors

    @property
    def held_bytes(self) -> int:
        """Bytes of regions held in memory because their write failed."""
        return sum(w.region.nbytes for w in self._failed.values())

    def retry_failed(self) -> None:
        """Write every region held after a failure again, now; raises DiskTierError (and
        keeps holding what still fails) if one fails again. Once one has failed, the writes
        still pending are waited for first: they may have failed too."""
        if not self.failing:
            return
        self.flush()
        self.errors.clear()  # what they said is what the retry will say, if it fails
        for key, write in list(self._failed.items()):
            self.write_now(write.region, write.buffer, key)
            self.release(write.pool, write.buffer)
        self.failing = False

    def _error(self, what: str, error: BaseException | None) -> DiskTierError:
        reason = getattr(error, "strerror", None) or str(error)
        try:
            free = f"{format_size(self.folder.free_bytes())} free there"
        except OSError:
            free = "free space unknown"
        return DiskTierError(getattr(error, "errno", None) or errno.EIO,
                             f"{what}: {reason} ({free})")

    # --- the end ------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the threads, close and delete every file, remove the folder."""
        if self.closed:
            return
        self.closed = True
        for write in self._writes:
            write.future.exception()
        self._writes.clear()
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        for name in list(self._files):
            self.drop_file(name)
        self._pools.clear()
        self._failed.clear()
        self.folder.remove()

    @property
    def path(self) -> Path:
        return self.folder.path


def _failed_future(error: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(error)
    return future
