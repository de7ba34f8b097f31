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

Each chunk has one file with regions "state", "payload" and (fp32) "grad", each cut into
pieces of one size, at most disk_rules.DISK_PIECE elements (rules.piece_elements), which is
what is read and written: an I/O buffer holds one piece, whatever the chunk's size. In a
state piece the parts sit at block-aligned offsets: [master,] exp_avg, exp_avg_sq.

The I/O buffers are the tier's (a few, allocated once, counted apart from the chunk bytes);
the chunk's host tensors are allocated and freed through the manager's accounting (`alloc`,
`free`). While the update (engine.chunks.update_walk) or a fetch uses a piece, the tensors
it reads are views into the buffer that holds it.

Data parallel (a sharded chunk, engine.chunks.sharding), all of this is about the chunk's
home tensors, which hold this rank's shard: its file holds the shard's parts only, pieces
are cut from the shard, and a fetch reads the shard, which the caller copies into its
place in the device payload before the gather. Each rank has a scratch folder of its own.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from engine.chunks.chunk import Chunk, squared_norm
from engine.chunks.flight import UpdateInFlight
from engine.chunks.spill_regions import (
    GRAD,
    PAYLOAD,
    POOL,
    STATE,
    file_name,
    host_parts,
    state_parts,
    update_regions,
)
from engine.devices.disk import ALIGN, DiskTier, Region
from engine.placement import rules

Loaded = tuple[torch.Tensor, Future | None]  # a buffer and the read filling it (None: done)


class ScratchTooSmall(ValueError):
    """The scratch folder's filesystem has less free space than the disk tier may need."""


class Spill:
    """Moves chunk parts between the host and the scratch folder for the ChunkManager.

    Args:
        chunks: every chunk of the engine.
        tier: the scratch folder, its I/O buffers and threads.
        piece: elements per piece (disk_rules.DISK_PIECE).
        flight: the update that may still be running (what undoes a step waits for it).
        alloc: a host tensor of (numel, dtype), counted in the manager's host bytes.
        free: uncount (and drop) a host tensor made by `alloc`.
    """

    def __init__(self, chunks: list[Chunk], tier: DiskTier, *, piece: int,
                 flight: UpdateInFlight, alloc: Callable[[int, torch.dtype], torch.Tensor],
                 free: Callable[[torch.Tensor], None]) -> None:
        self.chunks = chunks
        self.tier = tier
        self.piece = piece
        self.flight = flight
        self.alloc, self.free = alloc, free
        self.placement = rules.DiskPlacement(block=ALIGN)
        self._regions: dict[int, dict[str, Region]] = {}
        # Pieces read before they are asked for: payloads for the next fetches, and the
        # state of the next update's first pieces. (chunk, region, piece) -> Loaded.
        self._ahead: dict[tuple[int, str, int], Loaded] = {}
        for chunk in chunks:
            chunk.spill = self

    # --- geometry -------------------------------------------------------------------------------

    def cost(self, chunk: Chunk) -> rules.DiskCost:
        return rules.disk_cost(chunk.home_numel, chunk.itemsize, ALIGN, self.piece,
                               frozen=chunk.frozen)

    def spans(self, chunk: Chunk) -> list[tuple[int, int]]:
        """(lo, hi) of each piece of the chunk's home tensors (sharded: of its shard,
        counted from the shard's start)."""
        return rules.piece_spans(chunk.home_numel, self.piece)

    def _piece_bytes(self, chunk: Chunk, region: str) -> int:
        cost = self.cost(chunk)
        return {STATE: cost.state_piece, PAYLOAD: cost.payload_piece,
                GRAD: cost.grad_piece}[region]

    def region(self, chunk: Chunk, region: str, i: int) -> Region:
        """Piece `i` of one of the chunk's regions. The state has a file of its own, the
        payload another (with fp32's gradients), made (their space reserved) on first use
        and removed when the part comes home: the folder holds what the placement has on
        disk, no more (rules.DiskCost.state_region, payload_region)."""
        regions = self._regions.setdefault(chunk.index, {})
        if region not in regions:
            cost = self.cost(chunk)
            if region == STATE:
                sizes = {STATE: cost.pieces * cost.state_piece}
            else:
                sizes = {PAYLOAD: cost.pieces * cost.payload_piece}
                if cost.aliased:
                    sizes[GRAD] = cost.pieces * cost.grad_piece
            regions.update(self.tier.regions(file_name(chunk, region), sizes))
        whole = regions[region]
        size = self._piece_bytes(chunk, region)
        return Region(whole.file, whole.offset + i * size, size)

    def _remove_file(self, chunk: Chunk, region: str) -> None:
        """The part of `region` is home again: its file (and the space it reserved) goes."""
        regions = self._regions.get(chunk.index, {})
        for name in (STATE,) if region == STATE else (PAYLOAD, GRAD):
            regions.pop(name, None)
        self.tier.drop_file(file_name(chunk, region))

    def views(self, chunk: Chunk, region: str, buffer: torch.Tensor, numel: int
               ) -> dict[str, torch.Tensor]:
        """The tensors a buffer holding one piece (`numel` elements) of `region` holds,
        by the chunk attribute they stand for."""
        if region == STATE:
            stride = self._piece_bytes(chunk, STATE) // len(state_parts(chunk))
            return {name: buffer[i * stride:i * stride + 4 * numel].view(torch.float32)
                    for i, name in enumerate(state_parts(chunk))}
        if region == GRAD:
            return {"host_grad": buffer[:4 * numel].view(torch.float32)}
        return {"payload": buffer[:numel * chunk.itemsize].view(chunk.dtype)}

    @property
    def disk_bytes(self) -> int:
        """Bytes of chunk parts in the scratch folder now."""
        total = 0
        for c in self.chunks:
            cost = self.cost(c)
            total += cost.state_region if c.state_on_disk else 0
            total += cost.payload_region if c.payload_on_disk else 0
        return total

    # --- reading and writing pieces ------------------------------------------------------------

    def load_piece(self, chunk: Chunk, region: str, i: int, *, wait: bool = True,
              nbytes: int | None = None) -> Loaded | None:
        """Start reading a piece (one read ahead already is taken as is)."""
        ahead = self._ahead.pop((chunk.index, region, i), None)
        if ahead is not None:
            return ahead
        return self.tier.load((chunk.index, region, i), self.region(chunk, region, i),
                              POOL[region], wait=wait, nbytes=nbytes)

    def store_piece(self, chunk: Chunk, region: str, i: int, buffer: torch.Tensor) -> None:
        self.tier.store((chunk.index, region, i), self.region(chunk, region, i), buffer,
                        POOL[region])

    def give_back(self, region: str, loaded: Loaded) -> None:
        with contextlib.suppress(OSError):
            self.tier.finish(loaded[1])
        self.tier.release(POOL[region], loaded[0])

    def _write_out(self, chunk: Chunk, region: str, tensors: dict[str, torch.Tensor]) -> None:
        """Write a whole region from `tensors` (name -> whole-chunk tensor), piece by piece,
        waiting for each: the tensors are untouched, so a failure loses nothing."""
        for i, (lo, hi) in enumerate(self.spans(chunk)):
            buffer = self.tier.acquire(POOL[region])
            try:
                for name, view in self.views(chunk, region, buffer, hi - lo).items():
                    view.copy_(tensors[name][lo:hi])
                self.tier.write_now(self.region(chunk, region, i), buffer,
                                    (chunk.index, region, i))
            finally:
                self.tier.release(POOL[region], buffer)

    def _read_in(self, chunk: Chunk, region: str, tensors: dict[str, torch.Tensor]) -> None:
        """Read a whole region into `tensors`, piece by piece."""
        for i, (lo, hi) in enumerate(self.spans(chunk)):
            loaded = self.load_piece(chunk, region, i)
            try:
                self.tier.finish(loaded[1])
                for name, view in self.views(chunk, region, loaded[0], hi - lo).items():
                    tensors[name][lo:hi].copy_(view)
            finally:
                self.tier.release(POOL[region], loaded[0])

    def _forget_ahead(self, chunk: Chunk, region: str | None = None) -> None:
        """Drop the pieces read ahead of the chunk's `region` (all regions: None)."""
        for key in [k for k in self._ahead if k[0] == chunk.index and region in (None, k[1])]:
            self.give_back(key[1], self._ahead.pop(key))

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

        Each part is written before its host tensors are freed, so a failed write leaves
        the chunk as it was (DiskTierError)."""
        self._forget_ahead(chunk)
        if chunk.frozen:  # no optimizer state: level 1 moves nothing, it only marks it
            chunk.state_on_disk = level >= 1
        if level >= 1 and not chunk.state_on_disk:
            self._write_out(chunk, STATE, {n: getattr(chunk, n) for n in state_parts(chunk)})
            self._drop(chunk, STATE)
            chunk.state_on_disk = True
        if level >= 2 and not chunk.payload_on_disk:
            regions = [PAYLOAD, GRAD] if chunk.aliased and chunk.holds_grads else [PAYLOAD]
            for region in regions:
                self._write_out(chunk, region,
                                {n: getattr(chunk, n) for n in host_parts(chunk, region)})
            if chunk.holds_grads:
                chunk.grad_sq = squared_norm(chunk.host_grad if chunk.aliased else chunk.payload)
            for region in regions:
                self._drop(chunk, region)
            if chunk.aliased and not chunk.holds_grads and not chunk.frozen:
                self.free(chunk.host_grad)  # gradients land in a buffer when on disk
                chunk.host_grad = None
            chunk.payload_on_disk = True
        if level <= 1 and chunk.payload_on_disk:
            self._bring(chunk, PAYLOAD)
            if chunk.aliased:
                chunk.master = chunk.payload
                if chunk.holds_grads:
                    self._bring(chunk, GRAD)
                elif not chunk.frozen and chunk.sharded:  # else made as they land
                    chunk.host_grad = self.alloc(chunk.home_numel, torch.float32)
            chunk.payload_on_disk = False
            chunk.grad_sq = None
            self._remove_file(chunk, PAYLOAD)
        if level == 0 and chunk.state_on_disk:
            self._bring(chunk, STATE)
            chunk.state_on_disk = False
            self._remove_file(chunk, STATE)

    def _drop(self, chunk: Chunk, region: str) -> None:
        """Free the host tensors of a region that is on disk now."""
        for name in host_parts(chunk, region):
            self.free(getattr(chunk, name))
            setattr(chunk, name, None)
        if region == PAYLOAD and chunk.aliased:
            chunk.master = None

    def _bring(self, chunk: Chunk, region: str) -> None:
        """Read a region into new host tensors of the chunk (counted by `alloc`)."""
        dtypes = {"payload": chunk.dtype}
        homes = {n: self.alloc(chunk.home_numel, dtypes.get(n, torch.float32))
                 for n in host_parts(chunk, region)}
        try:
            self._read_in(chunk, region, homes)
        except BaseException:
            for home in homes.values():
                self.free(home)
            raise
        for i in range(len(self.spans(chunk))):
            self.tier.forget((chunk.index, region, i))  # a copy held after a failure
        for name, home in homes.items():
            setattr(chunk, name, home)

    # --- a whole chunk read back for a while (checkpoints, close) ------------------------------

    @contextlib.contextmanager
    def opened(self, chunk: Chunk, *, write: tuple[str, ...] = (),
               read: tuple[str, ...] | None = None) -> Iterator[None]:
        """Every part of the chunk on disk (of the regions in `read`, if given) read into
        whole temporary tensors, which the chunk's attributes point to for the `with`
        block; then the regions in `write` written back (waiting). Costs the host one
        chunk's parts on disk, beyond the budget, for the block. (fp32 gradients on disk
        are not read: nothing outside the update needs them.)"""
        regions = ([STATE] if chunk.state_on_disk and not chunk.frozen else []) + (
            [PAYLOAD] if chunk.payload_on_disk else [])
        regions = [r for r in regions if read is None or r in read]
        temps: dict[str, dict[str, torch.Tensor]] = {}
        for region in regions:
            dtypes = {"payload": chunk.dtype}
            temps[region] = {n: torch.empty(chunk.home_numel, dtype=dtypes.get(n, torch.float32))
                             for n in host_parts(chunk, region)}
            self._read_in(chunk, region, temps[region])
        try:
            for tensors in temps.values():
                for name, t in tensors.items():
                    setattr(chunk, name, t)
            if chunk.payload_on_disk and chunk.aliased:
                chunk.master = chunk.payload
            yield
            for region in write:
                if region in temps:
                    self._forget_ahead(chunk, region)
                    self._write_out(chunk, region, temps[region])
        finally:
            self._detach(chunk)

    def _detach(self, chunk: Chunk) -> None:
        if chunk.state_on_disk:
            for name in state_parts(chunk):
                setattr(chunk, name, None)
        if chunk.payload_on_disk:
            chunk.payload = chunk.master = chunk.host_grad = None

    def restore_payload(self, chunk: Chunk) -> None:
        """bf16/fp16: the payload holds gradients that will not be used; put the
        parameters back from the master, wherever the two are."""
        write = (PAYLOAD,) if chunk.payload_on_disk else ()
        with self.opened(chunk, write=write):
            chunk.payload.copy_(chunk.master)
        chunk.grad_sq = None

    # --- the update (engine.chunks.update_walk reads and writes through these) ---------------

    def read_ahead_state(self) -> None:
        """While the forward and backward run, read the state of the first pieces the
        next update needs into the state buffers they leave idle (never waiting; one
        buffer stays free for what the step needs now). The state does not change until
        the update, so what is read stays good, even across a step that fails."""
        if STATE not in self.placement.buffers:
            return
        room = self.placement.buffers[STATE][0] - 1 - sum(k[1] == STATE for k in self._ahead)
        for chunk in self.chunks:
            if room <= 0:
                return
            if not chunk.state_on_disk or not any(s.param.requires_grad for s in chunk.slots):
                continue
            for i in range(len(self.spans(chunk))):
                if room <= 0:
                    return
                if (chunk.index, STATE, i) in self._ahead:
                    continue
                loaded = self.tier.load((chunk.index, STATE, i), self.region(chunk, STATE, i),
                                        STATE, wait=False)
                if loaded is None:
                    return
                self._ahead[(chunk.index, STATE, i)] = loaded
                room -= 1

    def update_io(self, chunks: list[Chunk]) -> tuple[int, int]:
        """(bytes read, bytes written) the update of `chunks` will issue (UpdatePipeline):
        every piece of the regions it walks, read unless read ahead already (counted
        then), and written back but for fp32's gradients."""
        read = written = 0
        for chunk in (c for c in chunks if c.state_on_disk):
            for region in update_regions(chunk):
                size, pieces = self._piece_bytes(chunk, region), len(self.spans(chunk))
                ahead = sum((chunk.index, region, i) in self._ahead for i in range(pieces))
                read += (pieces - ahead) * size
                written += 0 if region == GRAD else pieces * size
        return read, written

    # --- payloads on disk, in the forward and backward -----------------------------------------

    def fetch(self, chunk: Chunk) -> Iterator[tuple[torch.Tensor, int, int]]:
        """What to copy to the device, piece by piece, for a chunk whose payload is on disk:
        yields (source, lo, hi), each read (or its read ahead finished) first, its buffer
        given back once the caller has copied it. lo..hi count in the home tensors: a
        sharded chunk's from its shard's start.

        A payload that holds gradients has the weights in the master: bf16/fp16 read it
        from the state pieces (the copy casts), fp32's payload region is the master."""
        master = chunk.holds_grads and not chunk.aliased
        region = STATE if master else PAYLOAD
        for i, (lo, hi) in enumerate(self.spans(chunk)):
            n = hi - lo
            # A state piece read ahead is the update's: the master is copied from it, and
            # it stays read ahead (a later micro-batch fetches the master again and again).
            key = (chunk.index, region, i)
            kept = master and key in self._ahead
            loaded = (self._ahead[key] if kept
                      else self.load_piece(chunk, region, i, nbytes=4 * n if master else None))
            try:
                self.tier.finish(loaded[1])
                if kept:
                    self._ahead[key] = (loaded[0], None)
                buffer = loaded[0]
                yield (buffer[:4 * n].view(torch.float32) if master
                       else buffer[:n * chunk.itemsize].view(chunk.dtype)), lo, hi
            finally:
                if not kept:
                    self.tier.release(POOL[region], loaded[0])

    def ready(self, index: int) -> bool:
        """Every payload piece of chunk `index` has been read ahead, and the reads are done."""
        for i in range(len(self.spans(self.chunks[index]))):
            loaded = self._ahead.get((index, PAYLOAD, i))
            if loaded is None or (loaded[1] is not None and not loaded[1].done()):
                return False
        return True

    def read_ahead(self, upcoming: Iterator[int], skip: Callable[[int], bool]) -> None:
        """Start reading the payload pieces of the next chunks on disk to be fetched, into
        at most half the payload buffers (rules.disk_read_ahead), never waiting for one."""
        if PAYLOAD not in self.placement.buffers:
            return
        held = sum(k[1] == PAYLOAD for k in self._ahead)
        slots = rules.payload_buffers(self.placement.aliased) // 2 - held
        if slots <= 0:
            return
        chosen = rules.disk_read_ahead(
            upcoming, slots=slots,
            wanted=lambda i: (self.chunks[i].payload_on_disk and not self.chunks[i].holds_grads
                              and not skip(i)),
            pieces=lambda i: [p for p in range(len(self.spans(self.chunks[i])))
                              if (i, PAYLOAD, p) not in self._ahead])
        for index, i in chosen:
            loaded = self.tier.load((index, PAYLOAD, i), self.region(self.chunks[index],
                                                                     PAYLOAD, i),
                                    PAYLOAD, wait=False)
            if loaded is None:
                return
            self._ahead[(index, PAYLOAD, i)] = loaded

    def cancel_read_ahead(self) -> None:
        """Give back the buffers of payloads read ahead and not fetched (end of backward)."""
        for key in [k for k in list(self._ahead) if k[1] == PAYLOAD]:
            self.give_back(PAYLOAD, self._ahead.pop(key))

    def land_grads(self, chunk: Chunk, grads: torch.Tensor,
                   copy: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """A chunk whose payload is on disk has all its gradients in `grads` (on the
        device; sharded, its shard's, reduced): their norm is taken there, and
        `copy(dst, src)` copies them, a piece at a time, into buffers that go to disk
        without waiting."""
        chunk.grad_sq = squared_norm(grads)
        self._forget_ahead(chunk, PAYLOAD)  # bf16/fp16: the payload region gets gradients
        region = GRAD if chunk.aliased else PAYLOAD
        dtype = torch.float32 if chunk.aliased else chunk.dtype
        for i, (lo, hi) in enumerate(self.spans(chunk)):
            buffer = self.tier.acquire(PAYLOAD)
            try:
                copy(buffer[:(hi - lo) * dtype.itemsize].view(dtype), grads[lo:hi])
            except BaseException:
                self.tier.release(PAYLOAD, buffer)
                raise
            self.store_piece(chunk, region, i, buffer)

    def add_grads(self, chunk: Chunk, grads: torch.Tensor,
                  to_host: Callable[[torch.Tensor, torch.Tensor], None],
                  to_device: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
        """More gradients, in `grads` (on the device), for a chunk whose gradients are on
        disk already (a later micro-batch, a module run twice): piece by piece, what the
        disk holds is read, `to_host(dst, src)` brings the new ones beside it, their sum
        (the same arithmetic as adding on the host) goes back to disk, and
        `to_device(dst, src)` into `grads`, whose norm is then the sum's. The host holds
        two I/O buffers for it, never the chunk."""
        region = GRAD if chunk.aliased else PAYLOAD
        dtype = torch.float32 if chunk.aliased else chunk.dtype
        self._forget_ahead(chunk, PAYLOAD)
        for i, (lo, hi) in enumerate(self.spans(chunk)):
            n = (hi - lo) * dtype.itemsize
            loaded = self.load_piece(chunk, region, i)
            arrived = self.tier.acquire(PAYLOAD)
            try:
                self.tier.finish(loaded[1])
                total = loaded[0][:n].view(dtype)
                new = arrived[:n].view(dtype)
                to_host(new, grads[lo:hi])
                total.add_(new)
                to_device(grads[lo:hi], total)
            except BaseException:
                self.tier.release(PAYLOAD, loaded[0])
                raise
            finally:
                self.tier.release(PAYLOAD, arrived)
            self.store_piece(chunk, region, i, loaded[0])
        chunk.grad_sq = squared_norm(grads)

    # --- the end --------------------------------------------------------------------------------

    def close(self) -> None:
        for key in list(self._ahead):
            self.give_back(key[1], self._ahead.pop(key))
        for chunk in self.chunks:
            chunk.spill = None
        self.tier.close()
