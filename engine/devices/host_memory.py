"""Giving freed host memory back to the operating system, and measuring a step's peak of it.

glibc serves a large allocation with a mapping of its own (returned to the system when it
is freed) and a small one from its heap, which keeps freed memory for reuse. The line
between them moves: after a large mapped block is freed, glibc raises it (up to 32 MiB on
64-bit) so that later tensors of that size come from the heap. A training step allocates
and frees activations, gradients and logits of many sizes, and a heap serving them
fragments. Measured on a 135M Llama with a 49k vocabulary and tied embeddings (fp32, batch
2 x 64), the process's peak was 3.32-3.56 GiB from one run to the next, 12-20% above the
2.95 GiB its live bytes and the usual allocator slack come to (engine.planning).

`steady_heap` fixes the line at 1 MiB for the rest of the process: every tensor of a MiB
or more is then mapped and unmapped, and resident memory is the live bytes plus a small
heap. Setting it also stops glibc from moving its trim threshold, so the heap's free top
goes back at 128 KiB as at start. Measured on that Llama (cpu policy, simulated device):
a peak of 3.05 GiB in every run, and resident memory steady from step to step. The price is a
fresh page for every page of each large tensor, every time: that was about twice the page
faults and 8-13% more CPU time per step on opt-125m, 20-30% on that Llama, most of it the
simulated device's chunk copies and gradient buffers, which came and went at every use.
The simulated device now keeps those (engine.devices.buffer_pool), so every run takes the
steady heap (tuitrain.training_run). The buffers fp32 gradients land in on the host are
fresh at every step (engine.placement.rules.grads_land_per_step), as plain PyTorch's
gradients are: on opt-125m under cpu, 306-314k faults a step against 159-218k when they
were kept, for a peak 0.2 GiB lower. The engine does not set it by itself: it is the
process's, and a program that trains with the engine in its own loop decides.

Trimming the heap walks it and costs time, so the engine does it at the rare moments when
a lot has been freed (after packing a model into chunks, and at close), not per step:
measured, a trim after every step costs about a third of a small model's step time in page
faults when the memory is used again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools

import psutil


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


# mallopt's parameters (malloc.h), and the mmap threshold the engine sets.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD = 1 << 20
KEPT_TOP = 2**31 - 1  # the most free memory a kept heap holds at its top (mallopt's int)
# glibc's own line never rises above this (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit): a block
# this large is mapped afresh at every allocation, whatever was freed before.
GLIBC_MMAP_MAX = 32 << 20
_mapped_from: list[int | None] = [GLIBC_MMAP_MAX]  # this process's line, as set here


def mapped_from() -> int | None:
    """The size from which this process's allocations are new memory every time (each page
    faulted in and zeroed when first written, unmapped when freed): MMAP_THRESHOLD under
    `steady_heap`, none under `kept_heap`, else glibc's own highest line (smaller blocks
    may be mapped too, until its line has risen past them)."""
    return _mapped_from[0]


@functools.cache
def steady_heap() -> bool:
    """Fix glibc's mmap threshold at MMAP_THRESHOLD for the rest of the process (see the
    module docstring); once per process. False where the C library has no mallopt (musl,
    macOS) or refuses: resident memory is then only less steady."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    if done and _mapped_from[0] is not None:
        _mapped_from[0] = MMAP_THRESHOLD
    return done


def kept_heap() -> bool:
    """The opposite of `steady_heap`, for measurements: glibc maps nothing and keeps what is
    freed (up to KEPT_TOP at the heap's top), so once a step has run, later steps touch no
    fresh page. On a virtual machine whose freed pages go back to the host (a balloon's free
    page reporting), a fresh page can wait for the host: measured on this project's machine,
    800 MiB touched afresh took 0.35 s to 8 s from one minute to the next, and plain
    PyTorch's opt-125m step, between engines' steps in one process
    (benchmarks/engine_overhead.py), 3.0 s with a kept heap against 5.7-7.7 s with glibc's
    own. A
    kept heap takes that wait out of every system compared alike. For the rest of the
    process; False where the C library has no mallopt."""
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    done = bool(libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, KEPT_TOP))
    if done:
        _mapped_from[0] = None
    return done


def release_free_host_memory() -> bool:
    """Return the heap's free memory to the OS (glibc's malloc_trim); False where the C
    library has no such call (musl, macOS), which is harmless."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True



# The kernel's per-process high-water mark of resident memory: writing "5" to clear_refs
# resets it to the current resident size (Linux 4.0+), and VmHWM in status reads it.
CLEAR_REFS = "/proc/self/clear_refs"
STATUS = "/proc/self/status"


class PeakResident:
    """This process's peak resident memory between `reset` and `read`.

    Where the kernel keeps a high-water mark that can be reset (Linux), `read` gives the
    true peak in between, so a block allocated and freed mid-step counts. Elsewhere, or
    where /proc is not writable, it is a sample of the resident size when read, and
    `exact` is False so that a screen can say so.
    """

    def __init__(self) -> None:
        self.exact = self._reset_mark()

    def reset(self) -> None:
        """Start a new interval: the high-water mark drops to what is resident now."""
        if self.exact:
            self.exact = self._reset_mark()

    def read(self) -> int:
        """Bytes: the peak since `reset` (or a sample of now, where not `exact`)."""
        if self.exact:
            peak = _status_bytes("VmHWM")
            if peak is not None:
                return peak
            self.exact = False
        return psutil.Process().memory_info().rss

    @staticmethod
    def _reset_mark() -> bool:
        try:
            with open(CLEAR_REFS, "w") as f:
                f.write("5")
        except OSError:
            return False
        return _status_bytes("VmHWM") is not None


def _status_bytes(field: str) -> int | None:
    """A `field: N kB` line of /proc/self/status in bytes; None where there is none."""
    try:
        with open(STATUS) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None
