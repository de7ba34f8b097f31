"""Giving freed host memory back to the operating system.

glibc keeps freed heap memory for reuse, and after large frees it raises its mmap threshold,
so that later large tensors come from that heap too. Freed chunk buffers then stay in the
process's resident memory until the heap is trimmed. Trimming walks the heap and costs time,
so the engine does it at the rare moments when a lot has been freed (after packing a model
into chunks, and at close), not per step: measured, a trim after every step costs about a
third of a small model's step time in page faults when the memory is used again.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools


@functools.cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_free_host_memory() -> bool:
    """Return the heap's free memory to the OS (glibc's malloc_trim); False where the C
    library has no such call (musl, macOS), which is harmless."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True

