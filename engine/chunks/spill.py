"""Spill: the parts of chunks that live in the scratch folder (the disk tier).

A non-resident chunk is at one of three levels (engine.placement.rules.disk_placement picks
them under the host budget; the ChunkManager asks this class to carry them out):

- 0, all on the host.
- 1, `state_on_disk`: its optimizer state is on disk, read back for its update only. In
  bf16/fp16 that is the fp32 master and both moments (12 B/param); in fp32 the two moments
  (8 B/param: the master is the payload, which the forward needs).
- 2, `payload_on_disk` too: nothing of it stays on the host. The payload is read before
  each fetch to the device (ahead of use, from the trace); its gradients go to disk as they
  land (bf16/fp16: into the payload's own region, as on the host they land in the payload;
  fp32: a region of their own, beside the payload, which is the master); the update reads
  them back with the state.

Each chunk has one file of regions: "state", "payload" and (fp32) "grad". In a state
buffer the parts sit at block-aligned offsets: [master,] exp_avg, exp_avg_sq.

While a part is read into an I/O buffer, the chunk's tensor for it (chunk.master, ...) is a
view into that buffer; otherwise it is None. The buffers are the tier's (a few, allocated
once, counted apart from the chunk bytes); the chunk's host tensors are allocated and freed
through the manager's accounting (`alloc`, `free`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path

import torch

from engine.chunks.chunk import Chunk, squared_norm
from engine.config import format_size
from engine.devices.disk import ALIGN, DiskTier, Region, ScratchFolder
from engine.placement import rules

STATE = "state"  # the state region, and the pool of buffers that carries it
PAYLOAD = "payload"  # the payload region, and the pool for payloads and fp32 gradients
GRAD = "grad"  # fp32 only: the gradient region (carried by payload buffers)


def state_parts(chunk: Chunk) -> tuple[str, ...]:
    """The chunk's tensors (attribute names) that its state region holds, in order."""
    return ("exp_avg", "exp_avg_sq") if chunk.aliased else ("master", "exp_avg", "exp_avg_sq")


def disk_cost(chunk: Chunk) -> rules.DiskCost:
    return rules.disk_cost(chunk.numel, chunk.itemsize, ALIGN)


class ScratchTooSmall(ValueError):
    """The scratch folder's filesystem has less free space than the disk tier may need."""


def open_spill(chunks: list[Chunk], *, disk_dir: Path, need: int,
               empty: Callable[[int, torch.dtype], torch.Tensor],
               alloc: Callable[[int, torch.dtype], torch.Tensor],
               free: Callable[[torch.Tensor], None]) -> Spill:
    """A Spill over a new scratch folder under `disk_dir` that has room for `need` bytes.

    Raises ValueError naming the folder when it cannot be written, ScratchTooSmall (with
    what is needed and what is free) when its filesystem lacks the space."""
    folder = ScratchFolder(disk_dir)
    available = folder.free_bytes()
    if need > available:
        folder.remove()
        raise ScratchTooSmall(
            f"the host budget needs {format_size(need)} on disk, but the scratch folder "
            f"{folder.parent} has {format_size(available)} free; free some space, give "
            f"another folder (disk_dir) or a larger host budget")
    return Spill(chunks, DiskTier(folder, empty=empty), alloc=alloc, free=free)


class Spill:
    """Moves chunk parts between the host and the scratch folder for the ChunkManager.

    Args:
        chunks: every chunk of the engine.
        tier: the scratch folder, its I/O buffers and threads.
        alloc: a host tensor of (numel, dtype), counted in the manager's host bytes.
        free: uncount (and drop) a host tensor made by `alloc`.
    """

    def __init__(self, chunks: list[Chunk], tier: DiskTier, *,
                 alloc: Callable[[int, torch.dtype], torch.Tensor],
                 free: Callable[[torch.Tensor], None]) -> None:
        self.chunks = chunks
        self.tier = tier
        self.alloc, self.free = alloc, free
        self.placement = rules.DiskPlacement(block=ALIGN)
        self._regions: dict[int, dict[str, Region]] = {}
        # Payloads read ahead of their fetch: chunk -> (buffer, read in flight).
        self._ahead: dict[int, tuple[torch.Tensor, Future | None]] = {}
        for chunk in chunks:
            chunk.spill = self

    # --- what is where ------------------------------------------------------------------------

    def regions(self, chunk: Chunk) -> dict[str, Region]:
        """The chunk's file, made (and its space reserved) on first use."""
        if chunk.index not in self._regions:
            cost = disk_cost(chunk)
            sizes = {STATE: cost.state_region, PAYLOAD: cost.payload_region}
            if chunk.aliased:
                sizes[GRAD] = cost.grad_region
            self._regions[chunk.index] = self.tier.regions(f"chunk-{chunk.index:05d}", sizes)
        return self._regions[chunk.index]

    @property
    def disk_bytes(self) -> int:
        """Bytes of chunk parts in the scratch folder now."""
        total = 0
        for c in self.chunks:
            cost = disk_cost(c)
            total += cost.state_region if c.state_on_disk else 0
            total += cost.payload_region + cost.grad_region if c.payload_on_disk else 0
        return total

    def _views(self, chunk: Chunk, region: str, buffer: torch.Tensor) -> dict[str, torch.Tensor]:
        """The chunk's tensors that `buffer`, holding `region`, holds, as views into it."""
        n = chunk.numel
        if region == STATE:
            step = disk_cost(chunk).state_region // len(state_parts(chunk))
            return {name: buffer[i * step:i * step + 4 * n].view(torch.float32)
                    for i, name in enumerate(state_parts(chunk))}
        if region == GRAD:
            return {"host_grad": buffer[:4 * n].view(torch.float32)}
        payload = buffer[:chunk.nbytes].view(chunk.dtype)
        return {"payload": payload, "master": payload} if chunk.aliased else {"payload": payload}

    @staticmethod
    def _pool(region: str) -> str:
        return STATE if region == STATE else PAYLOAD

    # --- placement: moving parts between the host and the disk --------------------------------

    def prepare(self, placement: rules.DiskPlacement) -> None:
        """Buffers for both the placement in force and `placement`, before moving to it."""
        pools = dict(self.placement.buffers)
        for name, (count, nbytes) in placement.buffers.items():
            old = pools.get(name, (0, 0))
            pools[name] = (max(count, old[0]), max(nbytes, old[1]))
        self.tier.size_pools(pools)

    def settle(self, placement: rules.DiskPlacement) -> None:
        """`placement` is in force: keep only the buffers it needs."""
        self.placement = placement
        self.tier.size_pools(placement.buffers)

    def move(self, chunk: Chunk, level: int) -> None:
        """Bring a non-resident chunk to disk level `level` (0, 1 or 2), synchronously.

        Each step writes first and frees after, so a failed write leaves the chunk as it
        was (DiskTierError)."""
        if level >= 1 and not chunk.state_on_disk:
            self._write_out(chunk, STATE)
            self._drop(chunk, STATE)
            chunk.state_on_disk = True
        if level >= 2 and not chunk.payload_on_disk:
            self._ahead_drop(chunk)
            grads = chunk.host_grad if chunk.aliased else chunk.payload
            moving = [PAYLOAD, GRAD] if chunk.aliased and chunk.holds_grads else [PAYLOAD]
            for region in moving:
                self._write_out(chunk, region)
            if chunk.holds_grads:
                chunk.grad_sq = squared_norm(grads)
            for region in moving:
                self._drop(chunk, region)
            if chunk.aliased and not chunk.holds_grads:
                self.free(chunk.host_grad)  # gradients land in a buffer when on disk
                chunk.host_grad = None
            chunk.payload_on_disk = True
        if level <= 1 and chunk.payload_on_disk:
            self._ahead_drop(chunk)
            self._in(chunk, PAYLOAD)
            if chunk.aliased:
                if chunk.holds_grads:
                    self._in(chunk, GRAD)
                else:
                    chunk.host_grad = self.alloc(chunk.numel, torch.float32)
            chunk.payload_on_disk = False
            chunk.grad_sq = None
        if level == 0 and chunk.state_on_disk:
            self._in(chunk, STATE)
            chunk.state_on_disk = False

    def _host_parts(self, chunk: Chunk, region: str) -> list[str]:
        """The chunk's host tensors that `region` holds (fp32's master is its payload)."""
        if region == STATE:
            return list(state_parts(chunk))
        return ["host_grad"] if region == GRAD else ["payload"]

    def _write_out(self, chunk: Chunk, region: str) -> None:
        """Write the region from the chunk's host tensors, and wait (they stay as they are)."""
        pool = self._pool(region)
        buffer = self.tier.acquire(pool)
        try:
            views = self._views(chunk, region, buffer)
            for name in self._host_parts(chunk, region):
                views[name].copy_(getattr(chunk, name))
            self.tier.write_now(self.regions(chunk)[region], buffer, (chunk.index, region))
        finally:
            self.tier.release(pool, buffer)

    def _drop(self, chunk: Chunk, region: str) -> None:
        """Free the host tensors of a region that is on disk now."""
        for name in self._host_parts(chunk, region):
            self.free(getattr(chunk, name))
            setattr(chunk, name, None)
        if region == PAYLOAD and chunk.aliased:
            chunk.master = None

    def _in(self, chunk: Chunk, region: str) -> None:
        pool = self._pool(region)
        key = (chunk.index, region)
        buffer, future = self.tier.load(key, self.regions(chunk)[region], pool)
        try:
            self.tier.finish(future)
            views = self._views(chunk, region, buffer)
            homes = {}
            for name in self._host_parts(chunk, region):
                homes[name] = self.alloc(chunk.numel, views[name].dtype)
                homes[name].copy_(views[name])
            self.tier.forget(key)  # held after a failed write: on the host now
        finally:
            self.tier.release(pool, buffer)
        for name, home in homes.items():
            setattr(chunk, name, home)
        if region == PAYLOAD and chunk.aliased:
            chunk.master = chunk.payload

    # --- a chunk's parts read into buffers for a while ---------------------------------------

    @contextlib.contextmanager
    def opened(self, chunk: Chunk, *, write: tuple[str, ...] = (),
               grads: bool = False) -> Iterator[None]:
        """Every part of the chunk on disk read into I/O buffers, the chunk's tensors views
        into them, for the `with` block; then the regions in `write` written back (waiting)
        and the buffers given back. `grads`: the fp32 gradient region too."""
        loaded = self._load_all(chunk, grads=grads, wait=True)
        try:
            for region, (buffer, future) in loaded.items():
                self.tier.finish(future)
                self._attach(chunk, region, buffer)
            yield
            for region in write:
                if region in loaded:
                    self.tier.write_now(self.regions(chunk)[region], loaded[region][0],
                                        (chunk.index, region))
        finally:
            for region, (buffer, future) in loaded.items():
                with contextlib.suppress(OSError):
                    self.tier.finish(future)
                self.tier.release(self._pool(region), buffer)
            self._detach(chunk)

    def _wanted(self, chunk: Chunk, grads: bool) -> list[str]:
        wanted = [STATE] if chunk.state_on_disk else []
        if chunk.payload_on_disk:
            wanted.append(PAYLOAD)
            if chunk.aliased and grads:
                wanted.append(GRAD)
        return wanted

    def _load_all(self, chunk: Chunk, *, grads: bool, wait: bool,
                  have: dict | None = None) -> dict[str, tuple[torch.Tensor, Future | None]]:
        """Start reading the chunk's regions on disk (those not in `have` yet). Without
        `wait`, stops at the first region with no buffer free now."""
        loaded = dict(have or {})
        for region in self._wanted(chunk, grads):
            if region in loaded:
                continue
            got = self.tier.load((chunk.index, region), self.regions(chunk)[region],
                                 self._pool(region), wait=wait)
            if got is None:
                break
            loaded[region] = got
        return loaded

    def _attach(self, chunk: Chunk, region: str, buffer: torch.Tensor) -> None:
        for name, view in self._views(chunk, region, buffer).items():
            setattr(chunk, name, view)

    def _detach(self, chunk: Chunk) -> None:
        if chunk.state_on_disk:
            for name in state_parts(chunk):
                setattr(chunk, name, None)
        if chunk.payload_on_disk:
            chunk.payload = chunk.master = chunk.host_grad = None

    # --- the update: read ahead, update, write behind ------------------------------------------

    def update_pipeline(self, chunks: list[Chunk]) -> UpdatePipeline:
        return UpdatePipeline(self, chunks)

    # --- payloads on disk, in the forward and backward -----------------------------------------

    def fetch_source(self, chunk: Chunk) -> tuple[torch.Tensor, str, torch.Tensor]:
        """What to copy to the device for a chunk whose payload is on disk, read (or its
        read ahead finished) now: (source tensor, pool, buffer to give back after).

        A payload that holds gradients has the weights in the master: bf16/fp16 read it
        from the state region (the copy casts), fp32's payload region is the master."""
        if chunk.holds_grads and not chunk.aliased:
            pool = STATE
            buffer, future = self.tier.load((chunk.index, STATE), self.regions(chunk)[STATE],
                                            STATE, nbytes=4 * chunk.numel)
            view = buffer[:4 * chunk.numel].view(torch.float32)
        else:
            pool = PAYLOAD
            entry = self._ahead.pop(chunk.index, None)
            if entry is None:
                entry = self.tier.load((chunk.index, PAYLOAD), self.regions(chunk)[PAYLOAD],
                                       PAYLOAD)
            buffer, future = entry
            view = buffer[:chunk.nbytes].view(chunk.dtype)
        try:
            self.tier.finish(future)
        except BaseException:
            self.tier.release(pool, buffer)
            raise
        return view, pool, buffer

    def give_back(self, pool: str, buffer: torch.Tensor) -> None:
        self.tier.release(pool, buffer)

    def ready(self, index: int) -> bool:
        """Chunk `index`'s payload has been read ahead and the read is done."""
        entry = self._ahead.get(index)
        return entry is not None and (entry[1] is None or entry[1].done())

    def read_ahead(self, upcoming: list[int], skip: Callable[[int], bool]) -> None:
        """Start reading the payloads of the next chunks on disk to be fetched, into at most
        half the payload buffers (rules.disk_read_ahead), never waiting for one."""
        if PAYLOAD not in self.placement.buffers:
            return
        slots = rules.payload_buffers(self.placement.aliased) // 2 - len(self._ahead)
        wanted = [i for i in rules.disk_read_ahead(
            upcoming, slots=max(0, slots),
            wanted=lambda i: (self.chunks[i].payload_on_disk and i not in self._ahead
                              and not self.chunks[i].holds_grads and not skip(i)))]
        for index in wanted:
            chunk = self.chunks[index]
            got = self.tier.load((index, PAYLOAD), self.regions(chunk)[PAYLOAD], PAYLOAD,
                                 wait=False)
            if got is None:
                return
            self._ahead[index] = got

    def _ahead_drop(self, chunk: Chunk) -> None:
        entry = self._ahead.pop(chunk.index, None)
        if entry is not None:
            with contextlib.suppress(OSError):
                self.tier.finish(entry[1])
            self.tier.release(PAYLOAD, entry[0])

    def cancel_read_ahead(self) -> None:
        """Give back the buffers of payloads read ahead and not fetched (end of backward)."""
        for index in list(self._ahead):
            self._ahead_drop(self.chunks[index])

    def land_grads(self, chunk: Chunk, copy: Callable[[torch.Tensor], None]) -> None:
        """A chunk whose payload is on disk has all its gradients: `copy(dst)` copies them
        from the device into a buffer, which goes to disk (without waiting) after their
        norm is taken."""
        self._ahead_drop(chunk)  # bf16/fp16: the payload region is about to hold gradients
        buffer = self.tier.acquire(PAYLOAD)
        dtype = torch.float32 if chunk.aliased else chunk.dtype
        grads = buffer[:chunk.numel * dtype.itemsize].view(dtype)
        try:
            copy(grads)
            chunk.grad_sq = squared_norm(grads)
        except BaseException:
            self.tier.release(PAYLOAD, buffer)
            raise
        region = GRAD if chunk.aliased else PAYLOAD
        self.tier.store((chunk.index, region), self.regions(chunk)[region], buffer, PAYLOAD)

    def restore_payload(self, chunk: Chunk) -> None:
        """bf16/fp16: the payload holds gradients that will not be used; put the
        parameters back from the master, wherever the two are."""
        write = (PAYLOAD,) if chunk.payload_on_disk else ()
        with self.opened(chunk, write=write):
            chunk.payload.copy_(chunk.master)
        chunk.grad_sq = None

    # --- the end --------------------------------------------------------------------------------

    def close(self) -> None:
        self.cancel_read_ahead()
        for chunk in self.chunks:
            chunk.spill = None
        self.tier.close()


class UpdatePipeline:
    """The optimizer's walk over chunks, in order, with their parts on disk read ahead and
    written behind: while chunk k is updated, chunk k+1 is read and chunk k-1 written, as
    far as the buffers go (three state buffers: one each).

        pipe = spill.update_pipeline(chunks); pipe.start()
        for chunk in chunks:
            pipe.load(chunk); update(chunk); pipe.store(chunk)

    A write that fails does not stop the walk: the buffer keeps that chunk's state (the
    tier holds it and reports it, see DiskTier), and the update of every other chunk goes
    on, so the step is whole either way.
    """

    def __init__(self, spill: Spill, chunks: list[Chunk]) -> None:
        self.spill = spill
        self.queue = deque(c for c in chunks if c.state_on_disk)
        self._loading: dict[int, dict[str, tuple[torch.Tensor, Future | None]]] = {}
        self._held: dict[int, dict[str, torch.Tensor]] = {}

    def start(self) -> None:
        """Start the first reads (before the global norm, so that they overlap it)."""
        self._ahead()

    def _ahead(self) -> None:
        for chunk in self.queue:
            have = self._loading.get(chunk.index, {})
            got = self.spill._load_all(chunk, grads=True, wait=False, have=have)
            self._loading[chunk.index] = got
            if len(got) < len(self.spill._wanted(chunk, grads=True)):
                return  # out of buffers: later chunks wait their turn, in order

    def load(self, chunk: Chunk) -> None:
        """The chunk's parts are in buffers and its tensors point there (no-op for a chunk
        with nothing on disk)."""
        if not chunk.state_on_disk:
            return
        if self.queue and self.queue[0] is chunk:
            self.queue.popleft()
        loaded = self.spill._load_all(chunk, grads=True, wait=True,
                                      have=self._loading.pop(chunk.index, {}))
        for region, (buffer, future) in loaded.items():
            self.spill.tier.finish(future)
            self.spill._attach(chunk, region, buffer)
        self._held[chunk.index] = {region: buffer for region, (buffer, _) in loaded.items()}
        self._ahead()

    def store(self, chunk: Chunk) -> None:
        """Write what the update changed (state; payload, which is the new parameters or
        fp32's master), without waiting; the gradients' buffer is given back."""
        held = self._held.pop(chunk.index, None)
        if held is None:
            return
        tier, regions = self.spill.tier, self.spill.regions(chunk)
        for region, buffer in held.items():
            if region == GRAD:  # used up: a copy held after a failed write is, too
                tier.forget((chunk.index, GRAD))
                tier.release(PAYLOAD, buffer)
            else:
                tier.store((chunk.index, region), regions[region], buffer,
                           self.spill._pool(region))
        chunk.grad_sq = None
        self.spill._detach(chunk)

    def cancel(self) -> None:
        """Give back every buffer read ahead and not used (a skipped or failed update)."""
        for index, loaded in list(self._loading.items()) + [
                (i, {r: (b, None) for r, b in held.items()}) for i, held in self._held.items()]:
            for region, (buffer, future) in loaded.items():
                with contextlib.suppress(OSError):
                    self.spill.tier.finish(future)
                self.spill.tier.release(self.spill._pool(region), buffer)
            self.spill._detach(self.spill.chunks[index])
        self._loading.clear()
        self._held.clear()
        self.queue.clear()


class NoDisk:
    """The update walk when nothing is on disk: nothing to read or write."""

    def start(self) -> None:
        pass

    def load(self, chunk: Chunk) -> None:
        pass

    def store(self, chunk: Chunk) -> None:
        pass

    def cancel(self) -> None:
        pass
