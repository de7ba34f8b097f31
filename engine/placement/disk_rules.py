"""The disk tier's rules: what goes to the scratch folder under a host budget, and when it
comes back.

The host is the second tier; when its budget (EngineConfig.host_budget) cannot hold every
chunk that is not resident on the device, parts of them go to disk. A non-resident chunk is
at one of three levels: 0, all on the host; 1, its optimizer state on disk (needed only for
its update); 2, its payload on disk too (read back before each use). `disk_placement`
chooses the levels from each chunk's DiskCost, as few parts as will do; `disk_read_ahead`
chooses the payload pieces to read ahead of use.

Disk I/O goes a piece at a time: each region of a chunk (state, payload and, in fp32, its
gradients) is cut into pieces of at most DISK_PIECE elements (`piece_elements`), and each
piece passes through an I/O buffer of its size, so the buffers stay small however large the
largest chunk; `disk_piece` shrinks the pieces for a host budget too small for them. The
buffers count against the host budget beside the chunk bytes (DiskPlacement.host_total).

Like the rest of the placement rules (engine.placement.rules, which offers these under its
own name), these are pure functions over chunk indices and byte counts: the chunk manager
carries them out on tensors (engine.chunks.spill), the planner counts their bytes
(engine.planning.disk).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from engine.sizes import format_size


class HostBudgetTooSmall(ValueError):
    """The host budget cannot hold even what must stay on the host with everything that may
    go to disk on disk; says what it needs."""


STATE_BUFFERS = 3  # the update reads piece k+1's state while updating k and writing k-1
# Elements per piece: the unit of disk I/O. A chunk larger than this is read, updated and
# written a piece at a time (AdamW is elementwise, so that is the same arithmetic), which
# keeps the I/O buffers the size of a piece however large the largest chunk (opt-125m's
# embedding alone is 38.6M elements). 4M elements: 32 MiB of fp32 moments per state piece,
# long enough for a disk to stream at full speed.
DISK_PIECE = 2**22


# Parameters sit in chunks at multiples of this many elements (64 bytes in fp32:
# engine.chunks.chunk), and disk pieces are cut at multiples of it too. A vectorised
# kernel rounds its vector body and its scalar tail differently, so a parameter split
# across two pieces is updated bit for bit as it is whole only where each part starts
# where it would in the whole.
ELEMENT_ALIGN = 32


# The smallest piece the I/O buffers shrink to for a model whose pieces at DISK_PIECE would
# not leave the host budget room (`disk_piece`): 16K elements, 128 KiB of fp32 moments per
# state piece, still 32 of the disk's blocks per read and write.
MIN_DISK_PIECE = 2**14


def disk_piece(numel: Sequence[int], itemsize: int, *, host_budget: int | None,
               block: int, frozen: Sequence[bool] = ()) -> int:
    """Elements per piece of disk I/O for chunks of `numel` elements: DISK_PIECE, or, when
    the I/O buffers of pieces that size would not leave the host budget room for the chunk
    bytes the host must keep (a small model, whose largest chunk's pieces are a large part
    of it), the largest half of it down to MIN_DISK_PIECE that does. With all chunks on the
    host (the most any placement sends to disk). None of them fitting, the smallest: what
    HostBudgetTooSmall then says is the least the host can do with. `frozen`: which chunks
    are frozen (none if empty)."""
    piece = DISK_PIECE
    frozen = list(frozen) or [False] * len(numel)
    while True:
        costs = [disk_cost(n, itemsize, block, piece, frozen=f)
                 for n, f in zip(numel, frozen, strict=True)]
        try:
            disk_placement(costs, on_host=range(len(costs)), host_budget=host_budget,
                           block=block)
            return piece
        except HostBudgetTooSmall:
            if piece // 2 < MIN_DISK_PIECE:
                return piece
            piece //= 2


def payload_buffers(aliased: bool) -> int:
    """Payload-piece-sized I/O buffers when payloads are on disk. An update holds one per
    stage (read, update, write), and in fp32 a second one for the gradients (the payload is
    the master there, so they have their own region); in the forward and backward, reads
    ahead take at most half of them, so that a fetch and gradients landing always find one."""
    return 2 * STATE_BUFFERS if aliased else STATE_BUFFERS + 1


@dataclass(frozen=True)
class DiskCost:
    """A non-resident chunk's bytes by where they can go: what moving them to disk frees
    on the host, and what they take there, piece by piece (each piece of each region
    rounded up to whole disk blocks; a piece is also the size of the I/O buffer that
    carries it)."""

    host_state: int  # optimizer state: bf16/fp16 the fp32 master and two moments; fp32 moments
    host_payload: int  # the rest: the payload (fp32: it is the master) and fp32's gradients
    pieces: int  # how many pieces the chunk's regions are cut into
    state_piece: int
    payload_piece: int
    grad_piece: int  # fp32 only: gradients beside the payload, which is the master

    @property
    def aliased(self) -> bool:
        return self.grad_piece > 0

    @property
    def state_region(self) -> int:
        return self.pieces * self.state_piece

    @property
    def payload_region(self) -> int:
        """The payload's region and, in fp32, the gradients' beside it."""
        return self.pieces * (self.payload_piece + self.grad_piece)


def _blocks(nbytes: int, block: int) -> int:
    return -(-nbytes // block) * block


def piece_elements(numel: int, piece: int | None = None) -> int:
    """Elements of each piece of a chunk of `numel` elements, with pieces of at most
    `piece` (default DISK_PIECE): as few as fit, of one size (the last may be shorter),
    cut at multiples of ELEMENT_ALIGN. A chunk a little over a piece was a whole piece and
    a small tail, which the update's walk overlaps badly: the Llama-shaped model's chunks
    of 4.86M elements at pieces of 4.19M waited 1.5-2.0 s a step for the disk, as two
    pieces of 2.43M 1.07-1.11 s (benchmarks/README.md)."""
    most = min(numel, piece or DISK_PIECE)
    if most >= numel:
        return numel
    even = -(-numel // -(-numel // most))
    size = -(-even // ELEMENT_ALIGN) * ELEMENT_ALIGN
    return min(size, max(ELEMENT_ALIGN, most // ELEMENT_ALIGN * ELEMENT_ALIGN))


def piece_spans(numel: int, piece: int | None = None) -> list[tuple[int, int]]:
    """(lo, hi) of each piece of a chunk of `numel` elements (piece_elements)."""
    step = piece_elements(numel, piece)
    return [(lo, min(lo + step, numel)) for lo in range(0, numel, step)]


def disk_cost(numel: int, itemsize: int, block: int, piece: int | None = None, *,
              frozen: bool = False) -> DiskCost:
    """DiskCost of a chunk of `numel` elements of `itemsize` bytes, for disk blocks of
    `block` bytes and pieces of `piece` elements (default DISK_PIECE). The host side
    matches chunk.host_bytes_per_parameter: 16 B/param in fp32 (payload = master,
    gradients, moments), 14 in bf16/fp16; a frozen chunk its payload alone (no state to
    move: at level 1 nothing of it goes)."""
    elements = piece_elements(numel, piece)
    pieces = -(-numel // elements)
    fp32 = _blocks(4 * elements, block)
    if frozen:
        return DiskCost(host_state=0, host_payload=itemsize * numel, pieces=pieces,
                        state_piece=0, payload_piece=_blocks(itemsize * elements, block),
                        grad_piece=0)
    if itemsize == 4:
        return DiskCost(host_state=8 * numel, host_payload=8 * numel, pieces=pieces,
                        state_piece=2 * fp32, payload_piece=fp32, grad_piece=fp32)
    return DiskCost(host_state=12 * numel, host_payload=itemsize * numel, pieces=pieces,
                    state_piece=3 * fp32, payload_piece=_blocks(itemsize * elements, block),
                    grad_piece=0)


@dataclass(frozen=True)
class DiskPlacement:
    """Which chunks have which parts on disk, and the bytes that leaves where."""

    state: frozenset[int] = frozenset()  # optimizer state on disk
    payload: frozenset[int] = frozenset()  # payload on disk too (always a subset of state)
    host_bytes: int = 0  # chunk bytes the host keeps (non-resident chunks)
    disk_bytes: int = 0  # bytes in the scratch folder
    state_buffer: int = 0  # bytes of one state I/O buffer (the largest state piece on disk)
    payload_buffer: int = 0  # bytes of one payload I/O buffer (0: no payload on disk)
    aliased: bool = False
    block: int = 0  # each buffer is allocated one block larger, to align it

    @property
    def buffers(self) -> dict[str, tuple[int, int]]:
        """I/O buffer pools: name -> (count, bytes each)."""
        pools = {}
        if self.state_buffer:
            pools["state"] = (STATE_BUFFERS, self.state_buffer)
        if self.payload_buffer:
            pools["payload"] = (payload_buffers(self.aliased), self.payload_buffer)
        return pools

    @property
    def buffer_bytes(self) -> int:
        """Host bytes of the I/O buffers, alignment slack included."""
        return sum(count * (nbytes + self.block) for count, nbytes in self.buffers.values())

    @property
    def host_total(self) -> int:
        """What the host budget must hold: chunk bytes and I/O buffers."""
        return self.host_bytes + self.buffer_bytes

    def level(self, chunk: int) -> int:
        """0: all on the host; 1: optimizer state on disk; 2: payload on disk too."""
        return 2 if chunk in self.payload else 1 if chunk in self.state else 0


def disk_placement(costs: Sequence[DiskCost], *, on_host: Iterable[int],
                   host_budget: int | None, block: int) -> DiskPlacement:
    """What of the non-resident chunks (`on_host`) goes to the scratch folder so that the
    host budget holds their remaining bytes plus the I/O buffers: nothing when it holds
    them all (or there is no budget); else, one chunk at a time, first the optimizer state
    of chunks (needed only for their update), and only once every chunk's state is on disk,
    payloads (needed before each use), as few as will do.

    Chunks go in reverse first-use order (chunks are numbered in the order the forward
    first uses them): the last used in the forward first. Its payload is read back latest,
    so the read-ahead has the most forward compute to hide behind; and since the update
    walks chunks in index order, the chunks kept on the host are updated first, while the
    state of the first chunks on disk is read, and the writes of the last ones drain while
    the next forward runs on chunks that never left the host.

    Raises HostBudgetTooSmall, with the numbers, when even every part on disk is not enough.
    """
    chosen = sorted(on_host, reverse=True)
    host = sum(costs[c].host_state + costs[c].host_payload for c in chosen)
    aliased = any(c.aliased for c in costs)  # a frozen chunk has no gradient region
    if host_budget is None or host <= host_budget:
        return DiskPlacement(host_bytes=host, aliased=aliased, block=block)
    state: list[int] = []
    payload: list[int] = []
    state_buffer = payload_buffer = disk = 0

    def placement() -> DiskPlacement:
        return DiskPlacement(frozenset(state), frozenset(payload), host, disk, state_buffer,
                             payload_buffer, aliased, block)

    for c in chosen:
        state.append(c)
        host -= costs[c].host_state
        disk += costs[c].state_region
        state_buffer = max(state_buffer, costs[c].state_piece)
        if placement().host_total <= host_budget:
            return placement()
    for c in chosen:
        payload.append(c)
        host -= costs[c].host_payload
        disk += costs[c].payload_region
        payload_buffer = max(payload_buffer, costs[c].payload_piece)
        if placement().host_total <= host_budget:
            return placement()
    least = placement()
    raise HostBudgetTooSmall(
        f"host budget {format_size(host_budget)} is below the {format_size(least.host_total)} "
        f"the host needs with every non-resident chunk on disk (I/O buffers "
        f"{format_size(least.buffer_bytes)})")


def disk_read_ahead(upcoming: Iterable[int], *, wanted: Callable[[int], bool],
                    pieces: Callable[[int], Iterable[int]], slots: int
                    ) -> list[tuple[int, int]]:
    """Payload pieces to start reading from disk now, as (chunk, piece): those of the
    `wanted` chunks (payload on disk, not on the device), in order of use and each once,
    that `pieces(chunk)` says are not read yet, at most `slots` of them."""
    chosen: list[tuple[int, int]] = []
    seen: set[int] = set()
    for chunk in upcoming:
        if chunk in seen or not wanted(chunk):
            continue
        seen.add(chunk)
        for piece in pieces(chunk):
            if len(chosen) >= slots:
                return chosen
            chosen.append((chunk, piece))
    return chosen
