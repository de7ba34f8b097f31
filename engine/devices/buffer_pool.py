"""BufferPool: the simulated device's chunk buffers, kept for the next use of their size.

A chunk's copy on the device, and its gradient buffer in backward, come and go at every use:
under policy cpu every chunk comes in for forward and again for a backward that reads its
weights, and every gradient buffer opens and closes once a step. On a GPU the caching
allocator keeps the freed blocks for the next tensor of their size. On the simulated
device they are host memory, and with glibc's mmap threshold fixed
(engine.devices.host_memory.steady_heap) each one is mapped and unmapped: a fresh page for
every page of it, every time. Measured on opt-125m, that was most of the 8-13% of CPU time
per step a steady heap cost.

So the simulated device keeps what a released copy or gradient buffer held, by size (the
chunks of a model have few distinct sizes), and hands it to the next one of that size
instead of allocating. A kept buffer holds no chunk: for the device budget it is free
memory (the engine's counts of device bytes never see it), for the host it is resident
memory, which the plan counts (engine.planning.host_memory). The memory moves between
storages (`UntypedStorage._swap_data_ptr_`), never the storages: a chunk's parameters and
every tensor autograd saved from them view the chunk's own storage for the whole run,
and a storage given back is left empty, so a stale view fails loudly instead of reading
another chunk's bytes.

How much is kept is `HeldBytes`' rule, which the planner's replay runs too: every buffer
given back is kept, within `limit` (the device budget) in all; what a new size needs beyond
that is made by dropping kept buffers of other sizes. A step that repeats the last one
takes exactly what that one gave back, so the memory stays the same from step to step.
`trim` drops every kept buffer where the step changes (a new trace, new settings).
"""

from __future__ import annotations

import torch

__all__ = ["BufferPool", "HeldBytes", "settled_fresh"]


class HeldBytes:
    """The pool's rule, in bytes only: which buffers it keeps and which it drops.

    `in_use`: bytes of buffers handed out; `kept`: bytes held for reuse, by size;
    `peak`: the most bytes the pool held at once (handed out and kept). With `keeps`
    False it keeps nothing, as a device without a pool (what a measurement of the
    allocator's own total needs: benchmarks/true_peak.py)."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.keeps = True
        self.in_use = 0
        self.kept: dict[int, int] = {}  # size -> buffers of that size held for reuse
        self.kept_bytes = 0
        self.peak = 0
        self.fresh = 0  # bytes of buffers taken that no kept one served: new memory

    @property
    def total(self) -> int:
        return self.in_use + self.kept_bytes

    def take(self, nbytes: int) -> tuple[bool, list[int]]:
        """A buffer of `nbytes` is needed. Returns whether a kept one serves, and the sizes
        of the kept buffers to drop first (largest first) so that a new one fits the limit."""
        self.in_use += nbytes
        if self.kept.get(nbytes):
            self._unkeep(nbytes)
            return True, []
        self.fresh += nbytes
        dropped = []
        if self.total > self.limit:
            for size in sorted(self.kept, reverse=True):
                while self.kept.get(size) and self.total > self.limit:
                    self._unkeep(size)
                    dropped.append(size)
        self.peak = max(self.peak, self.total)
        return False, dropped

    def give(self, nbytes: int) -> bool:
        """A buffer of `nbytes` is given back; returns whether it is kept."""
        self.in_use -= nbytes
        if not self.keeps or self.total + nbytes > self.limit:
            return False
        self.kept[nbytes] = self.kept.get(nbytes, 0) + 1
        self.kept_bytes += nbytes
        return True

    def trim(self, limit: float | None = None) -> list[int]:
        """Drop kept buffers until the pool holds at most `limit` (None: drop them all, and
        count the peak from here); returns the sizes dropped. A new `limit` stays the
        pool's."""
        if limit is not None:
            self.limit = limit
        dropped = []
        for size in sorted(self.kept, reverse=True):
            while self.kept.get(size) and (limit is None or self.total > self.limit):
                self._unkeep(size)
                dropped.append(size)
        if limit is None:
            self.peak = self.total  # a new placement's peak starts here
        return dropped

    def _unkeep(self, size: int) -> None:
        self.kept[size] -= 1
        if not self.kept[size]:
            del self.kept[size]
        self.kept_bytes -= size


class BufferPool:
    """The simulated device's kept buffers (see the module docstring), within `limit` bytes."""

    def __init__(self, limit: int) -> None:
        self.bytes = HeldBytes(limit)
        self._kept: dict[int, list[torch.UntypedStorage]] = {}

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Give `storage` `nbytes` of memory, uninitialised: a kept buffer of that size, or
        new memory. `storage` is empty, or holds `nbytes` that nothing has written yet (a
        fresh torch.empty, whose pages the system has not handed out), which a kept buffer
        then replaces."""
        reused, dropped = self.bytes.take(nbytes)
        self._drop(dropped)
        if reused:
            # The kept storage takes what `storage` held (nothing, or untouched memory) and
            # goes, freeing it.
            storage._swap_data_ptr_(self._kept[nbytes].pop())
        elif storage.nbytes() != nbytes:
            storage.resize_(nbytes)

    def drain(self, storage: torch.UntypedStorage) -> None:
        """Take `storage`'s memory back, leaving it empty; kept for the next buffer of its
        size where the limit allows, freed otherwise."""
        nbytes = storage.nbytes()
        holder = torch.UntypedStorage(0)
        holder._swap_data_ptr_(storage)
        if self.bytes.give(nbytes):
            self._kept.setdefault(nbytes, []).append(holder)

    def trim(self, limit: int | None = None) -> None:
        """Free kept buffers until the pool holds at most `limit` (None: free them all)."""
        self._drop(self.bytes.trim(limit))

    @property
    def kept_bytes(self) -> int:
        return self.bytes.kept_bytes

    def _drop(self, sizes: list[int]) -> None:
        for size in sizes:
            self._kept[size].pop()


def settled_fresh(limit: float, resident: int, moves: list[int]) -> int:
    """Bytes of new memory a pool of `limit` takes in a step that follows one like it: the
    buffers the step takes (+bytes) and gives back (-bytes), `moves` in order, run twice
    beside `resident` bytes of buffers held for good, counted the second time. Each step
    starts with the buffers the last one left in use given back: a copy left on the device
    is used again (or let go) before the next update."""
    pool = HeldBytes(limit)
    pool.take(resident)
    held: list[int] = []  # buffers in use, by size
    for _ in range(2):
        for nbytes in held:
            pool.give(nbytes)
        held.clear()
        pool.fresh = 0
        for nbytes in moves:
            if nbytes > 0:
                pool.take(nbytes)
                held.append(nbytes)
            else:
                pool.give(-nbytes)
                held.remove(-nbytes)
    return pool.fresh
