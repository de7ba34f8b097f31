"""Positioned reads and writes of scratch files, direct where the filesystem allows it.

`os.preadv` / `os.pwritev` take an offset (no shared file position, so any thread may use
any file) and release the GIL for the system call, so a thread doing I/O overlaps the main
thread's compute.

O_DIRECT moves bytes between the disk and our buffers without the page cache, which would
otherwise hold a second copy of everything the tier writes: exactly the memory the host
budget is keeping free. It needs the buffer address, the length and the offset aligned to
the device's logical block; ALIGN (4096) covers every common device. Whether a filesystem
accepts it is found by trying (`direct_io_supported`): some refuse the open (older tmpfs,
some FUSE and network filesystems), some refuse the first I/O. Where it is refused, I/O is
buffered, and each write is flushed and dropped from the cache (fdatasync, then
posix_fadvise DONTNEED: the advice drops clean pages only), each read dropped after it.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

ALIGN = 4096  # bytes: buffer address, length and file offset of every transfer
# One system call moves at most this much on Linux (2 GiB less a page): longer transfers
# are split, and each piece stays aligned.
MAX_TRANSFER = 0x7FFFF000


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to a whole number of ALIGN blocks."""
    return -(-nbytes // ALIGN) * ALIGN


def direct_io_supported(folder: Path) -> bool:
    """Whether files in `folder` take O_DIRECT reads and writes of ALIGN-aligned buffers."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return False  # macOS and others: no such flag
    path = folder / ".direct-probe"
    try:
        fd = os.open(path, os.O_CREAT | os.O_RDWR | flag, 0o600)
    except OSError:
        return False
    try:
        block = aligned_empty(ALIGN)
        os.pwritev(fd, [memoryview(block.numpy())], 0)
        os.preadv(fd, [memoryview(block.numpy())], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)


def aligned_empty(nbytes: int, empty=None) -> torch.Tensor:
    """A uint8 tensor of `nbytes` (a multiple of ALIGN) whose address is ALIGN-aligned,
    cut from a slightly larger allocation by `empty(numel, dtype)` (torch.empty by
    default; a device's host allocator, pinned where it has one)."""
    if nbytes % ALIGN:
        raise ValueError(f"an I/O buffer is a whole number of {ALIGN}-byte blocks, "
                         f"not {nbytes} bytes")
    raw = (empty or _empty)(nbytes + ALIGN, torch.uint8)
    skip = -raw.data_ptr() % ALIGN
    return raw[skip:skip + nbytes]


def _empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype)


class ScratchFile:
    """One scratch file of `size` bytes (reserved on disk at creation), read and written at
    offsets from aligned uint8 tensors.

    Reserving with posix_fallocate means a disk that fills up later (another process) cannot
    make an overwrite of a reserved block fail on most filesystems; copy-on-write ones
    (btrfs, ZFS) may still refuse a write with ENOSPC, which the tier reports cleanly.
    """

    def __init__(self, path: Path, size: int, *, direct: bool) -> None:
        self.path = path
        self.direct = direct
        flags = os.O_CREAT | os.O_RDWR | (getattr(os, "O_DIRECT", 0) if direct else 0)
        self.fd = os.open(path, flags, 0o600)
        try:
            if size:
                os.posix_fallocate(self.fd, 0, size)
        except OSError as e:
            if e.errno in (errno.EOPNOTSUPP, errno.EINVAL):  # no reservation; writes work
                return
            os.close(self.fd)
            path.unlink(missing_ok=True)
            raise

    def read(self, buf: torch.Tensor, offset: int) -> None:
        """Fill `buf` from the file at `offset`."""
        view = memoryview(buf.numpy())
        done, total = 0, len(view)
        while done < total:
            n = os.preadv(self.fd, [view[done:done + MAX_TRANSFER]], offset + done)
            if n <= 0:
                raise OSError(f"{self.path}: read {done} of {total} bytes at {offset}: "
                              f"end of file")
            done += n
        if not self.direct:
            os.posix_fadvise(self.fd, offset, total, os.POSIX_FADV_DONTNEED)

    def write(self, buf: torch.Tensor, offset: int) -> None:
        """Write `buf` to the file at `offset`; returns once the bytes are with the disk
        (direct) or flushed from the page cache (buffered)."""
        view = memoryview(buf.numpy())
        done, total = 0, len(view)
        while done < total:
            done += os.pwritev(self.fd, [view[done:done + MAX_TRANSFER]], offset + done)
        if not self.direct:
            os.fdatasync(self.fd)
            os.posix_fadvise(self.fd, offset, total, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def sequential_bandwidth(folder: Path, *, write_bytes: int, read_bytes: int, piece: int,
                         direct: bool) -> tuple[float, float]:
    """(write, read) bytes per second of sequential I/O in `folder`, `piece` bytes at a
    time: the writes flushed to the disk (O_DIRECT, or fsync'ed), the reads from the disk,
    not the page cache (O_DIRECT, or the cache dropped after the writes). Uses a file of
    its own, removed after."""
    size = max(write_bytes, read_bytes)
    size += -size % piece
    path = folder / "bandwidth.bin"
    file = ScratchFile(path, size, direct=direct)
    buffer = aligned_empty(piece)
    # Bytes that do not compress, from a generator of its own: the run's draws none.
    buffer.random_(0, 255, generator=torch.Generator().manual_seed(0))
    try:
        t0 = time.perf_counter()
        for offset in range(0, write_bytes, piece):
            file.write(buffer, offset)
        os.fsync(file.fd)
        write = time.perf_counter() - t0
        if not direct:
            os.posix_fadvise(file.fd, 0, size, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for offset in range(0, read_bytes, piece):
            file.read(buffer, offset)
        read = time.perf_counter() - t0
    finally:
        file.close()
        path.unlink()
    return write_bytes / max(write, 1e-9), read_bytes / max(read, 1e-9)


def steady_bandwidth(folder: Path, *, nbytes: int, piece: int, direct: bool,
                     beside: Callable[[], None] | None = None) -> tuple[float, float, float]:
    """(write, read, both) bytes per second of the disk tier's steady I/O in `folder`,
    `piece` bytes at a time: writes over blocks written before (a tier rewrites its regions
    at every step, and the first write of a newly reserved block costs more: 1.2-2.4 GiB/s
    here, against 1.8-3.9 rewriting), reads from the disk, and both directions at once, one
    thread reading while another writes, as the update reads each piece ahead and writes
    the last behind (their bytes together over their time together), with `beside` run
    over and over on this thread meanwhile, as the update computes between them. Uses a
    file of its own, of twice `nbytes`, removed after."""
    size = nbytes + (-nbytes % piece)
    path = folder / "bandwidth.bin"
    file = ScratchFile(path, 2 * size, direct=direct)
    written, read = aligned_empty(piece), aligned_empty(piece)
    # Bytes that do not compress, from a generator of its own: the run's draws none.
    written.random_(0, 255, generator=torch.Generator().manual_seed(0))
    failed: list[OSError] = []

    def write(lo: int) -> None:
        for offset in range(lo, lo + size, piece):
            file.write(written, offset)

    def write_back() -> None:
        try:
            write(size)
        except OSError as e:
            failed.append(e)

    def read_back() -> None:
        try:
            for offset in range(0, size, piece):
                file.read(read, offset)
        except OSError as e:
            failed.append(e)

    try:
        write(0)
        write(size)  # every block written once, as a tier's regions are after its first step
        t0 = time.perf_counter()
        write(0)
        os.fsync(file.fd)
        t1 = time.perf_counter()
        read_back()
        t2 = time.perf_counter()
        reader = threading.Thread(target=read_back, name="tuitrain-disk-probe")
        reader.start()
        try:
            if beside is None:
                write(size)
            else:
                writer = threading.Thread(target=write_back, name="tuitrain-disk-probe")
                writer.start()
                while writer.is_alive() or reader.is_alive():
                    beside()
                writer.join()
        finally:
            reader.join()
        os.fsync(file.fd)
        t3 = time.perf_counter()
        if failed:
            raise failed[0]
    finally:
        file.close()
        path.unlink()
    return (size / max(t1 - t0, 1e-9), size / max(t2 - t1, 1e-9),
            2 * size / max(t3 - t2, 1e-9))
