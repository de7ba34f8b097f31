"""DiskSide: the host budget, and the chunk parts that go to disk under it.

What goes to disk (engine.placement.rules.disk_placement) and the scratch folder it goes
to (engine.chunks.scratch_space); reading ahead of use, the optimizer's walk over parts on
disk (engine.chunks.update_walk), and the disk tier's counters and errors. The bytes
themselves are moved by engine.chunks.spill.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
from collections.abc import Callable, Iterator
from pathlib import Path

from engine.chunks import scratch_space, spill_regions
from engine.chunks.chunk import Chunk
from engine.chunks.tiers import ChunkTiers
from engine.chunks.update_walk import NoDisk, UpdatePipeline
from engine.devices.disk import ALIGN, DiskTierError, remove_stale_beside, space_needed
from engine.placement import rules
from engine.placement.policy import Policy


class DiskSide(ChunkTiers):
    """The manager's host budget and disk tier."""

    # Where the disk tier's (read, written) counters will stand once the update the latest
    # step started is over (update_pipeline), until that step reports (disk_counters).
    _update_end: tuple[int, int] | None = None
    _disk_dir: Path | None = None  # where the scratch folder goes (use_host_budget)

    def use_host_budget(self, host_budget: int, disk_dir: Path,
                        fill: Callable[[Chunk], None] | None = None) -> None:
        """Keep the chunk bytes on the host, with the disk tier's I/O buffers, within
        `host_budget`; what does not fit goes to a scratch folder of its own under
        `disk_dir`, made now if the policy puts anything there (every policy but cuda,
        whose chunks all live on the device), else when a change of policy first does.

        `fill`: the chunks are still empty (packing.build_chunks(filled=False)); fill each
        with it, last used first, and send its parts where the budget says (under cuda, to
        the device) before the next is filled, so that the host never holds the whole
        model's state at once.

        Raises ValueError (rules.HostBudgetTooSmall, ScratchTooSmall, or naming a folder
        that cannot be written) before anything moves. Sharded, the budget is this rank's,
        for its shards."""
        self.host_budget, self._disk_dir = host_budget, disk_dir
        self.disk_piece = rules.disk_piece([c.home_numel for c in self.chunks],
                                           self.chunks[0].itemsize if self.chunks else 4,
                                           host_budget=host_budget, block=ALIGN,
                                           frozen=[c.frozen for c in self.chunks])
        # Every policy may come to place every chunk on the host: a budget too small for
        # that is refused whatever the policy (rules.HostBudgetTooSmall).
        self.disk_placement(set())
        resident = self._placed_first(self.policy)
        built = self.disk_placement(resident)
        if built.state:
            self._open_spill()
        elif disk_dir.is_dir():
            # No folder of its own yet (it comes with a policy that needs one): what killed
            # runs left there goes now all the same, as when one is made.
            remove_stale_beside(disk_dir)
        if fill is None:
            return
        if self.spill is not None:
            self.spill.settle(built)  # the buffers that carry the parts there
        # Last used first: those are the chunks the placement sends to disk, so the model's
        # own parameters shrink while the parts the host keeps have not yet grown.
        for chunk in reversed(self.chunks):
            fill(chunk)
            self.count_host([chunk])
            if chunk.index in resident:
                self.set_resident(chunk, True)
            elif self.spill is not None and built.level(chunk.index):
                try:
                    self.spill.move(chunk, built.level(chunk.index))
                except DiskTierError as e:
                    # Filled by someone else since the check: still a folder too small.
                    parent = self.spill.tier.folder.parent
                    self.spill.close()
                    self.spill = None
                    if e.errno != errno.ENOSPC:
                        raise
                    need = self.disk_placement(set()).disk_bytes
                    raise scratch_space.too_small(parent, space_needed(need),
                                                  scratch_space.free_space(parent)) from None

    def _placed_first(self, policy: Policy) -> set[int]:
        """rules.built_on_device: the rest may all be on the host, and the disk tier must
        take what the host budget does not."""
        return rules.built_on_device(policy, [self.resident_cost(c) for c in self.chunks],
                                     capacity=self.device.capacity(),
                                     sharded=any(c.sharded for c in self.chunks))

    def _open_spill(self) -> None:
        """The disk tier in a new scratch folder under the disk folder, with room for what
        any placement may send there: every chunk's parts but what the host budget keeps."""
        self.spill = scratch_space.open_spill(
            self.chunks, disk_dir=self._disk_dir, need=self.disk_placement(set()).disk_bytes,
            piece=self.disk_piece, flight=self.flight, empty=self.device.host_empty,
            alloc=lambda numel, dtype: self._alloc("host", numel, dtype),
            free=lambda t: self._free("host", t))

    def open_disk_tier(self, policy: Policy) -> None:
        """Open the disk tier now if `policy` puts chunk parts on disk and none is open (a
        run that started under cuda): asked when the policy is staged, so that a folder
        without the room is refused then (ScratchTooSmall), before anything moves."""
        if self.host_budget is not None and self.spill is None and self.disk_placement(
                self._placed_first(policy)).state:
            self._open_spill()

    def budget_placement(self, resident: set[int]) -> rules.DiskPlacement | None:
        """The disk placement when `resident` live on the device, under the host budget
        (None without one, or while nothing needs the disk tier and none is open); the
        tier opens the first time a placement needs it."""
        if self.host_budget is None:
            return None
        placement = self.disk_placement(resident)
        if self.spill is None and placement.state:
            self._open_spill()
        return placement if self.spill is not None else None

    def disk_placement(self, resident: set[int]) -> rules.DiskPlacement:
        """rules.disk_placement for the chunks not in `resident`."""
        return rules.disk_placement(
            [rules.disk_cost(c.home_numel, c.itemsize, ALIGN, self.disk_piece,
                             frozen=c.frozen) for c in self.chunks],
            on_host=[c.index for c in self.chunks if c.index not in resident],
            host_budget=self.host_budget, block=ALIGN)

    def restore_disk_placement(self, placement: rules.DiskPlacement | None = None) -> None:
        """Put every non-resident chunk's parts where `placement` (default: the one in
        force) says, e.g. after gradients brought a payload home for a step."""
        if self.spill is None:
            return
        placement = placement or self.spill.placement
        moving = [c for c in self.chunks
                  if not c.resident and placement.level(c.index) != c.disk_level]
        if not moving and placement == self.spill.placement:
            return  # nothing to do: the disk tier is left alone (an update may be using it)
        self.flight.wait()
        for chunk in moving:
            self.spill.move(chunk, placement.level(chunk.index))
        self.spill.settle(placement)

    def read_ahead(self, pos: int) -> None:
        """Start reading from disk, into idle buffers: the payloads of the next chunks to
        be fetched (trace order; not while tracing, when there is no order to trust), and
        the state the update will need first."""
        if self.spill is None or self.flight.active:
            return  # a running update has the disk tier to itself
        if self.trace is not None and self.strict:
            upcoming = itertools.chain.from_iterable(
                p.chunks for p in itertools.islice(self.trace.points, pos + 1, None))
            self.spill.read_ahead(upcoming, skip=lambda i: self.chunks[i].on_device)
        self.spill.read_ahead_state()

    def overlap_update(self) -> bool:
        """Whether the update of host chunks may overlap the next step's forward
        (engine.chunks.flight): when it is bound by the disk, with optimizer state there,
        and the forward needs nothing of the disk tier (no payload there)."""
        return (self.spill is not None and bool(self.spill.placement.state)
                and not self.spill.placement.payload)

    def update_pipeline(self, chunks: list[Chunk]) -> UpdatePipeline | NoDisk:
        """The optimizer's walk over `chunks` (update_walk.Span by span), reading and
        writing their parts on disk."""
        if self.spill is None:
            return NoDisk()
        tier = self.spill.tier
        # Counted as the step's, also when the walk outlives the step (disk_counters).
        read, written = self.spill.update_io(chunks)
        self._update_end = (tier.bytes_read + read, tier.bytes_written + written)
        return UpdatePipeline(self.spill, chunks)

    @contextlib.contextmanager
    def opened(self, chunk: Chunk, *, write: bool = False,
               master_only: bool = False) -> Iterator[None]:
        """The chunk's tensors all readable (parts on disk read into buffers) in the block;
        `write`: what the block changed in them goes back to disk; `master_only`: only the
        fp32 master need be readable (fp32 reads no moments, bf16/fp16 no payload)."""
        if self.spill is None or not chunk.disk_level:
            yield
            return
        regions = (spill_regions.STATE, spill_regions.PAYLOAD) if write else ()
        read = (spill_regions.master_region(chunk),) if master_only else None
        with self.spill.opened(chunk, write=regions, read=read):
            yield

    def flush_disk(self) -> None:
        """Wait for every write the disk tier has issued."""
        if self.spill is not None:
            self.spill.tier.flush()

    def retry_disk(self) -> None:
        """Write again what a failed write left held in memory (DiskTierError if it fails)."""
        if self.spill is not None:
            self.spill.tier.retry_failed()

    def disk_errors(self) -> list[OSError]:
        """Writes that failed since the last call."""
        return self.spill.tier.take_errors() if self.spill is not None else []

    @property
    def disk_bytes(self) -> int:
        return self.spill.disk_bytes if self.spill is not None else 0

    @property
    def io_buffer_bytes(self) -> int:
        return self.spill.tier.buffer_bytes if self.spill is not None else 0

    def disk_counters(self) -> tuple[int, int, float]:
        """(bytes read, bytes written, seconds waited) by the disk tier since the last
        call, which a step makes once, as it reports. Every byte counts once, in the step
        that moved it: an update still running when its step reports (it overlaps the next
        step's forward: state on disk) counts all it will read and write in that step, and
        the next step counts only its own. The seconds waited count where they were spent.
        """
        if self.spill is None:
            return 0, 0, 0.0
        tier, (r, w, s) = self.spill.tier, self._disk_base
        waited = tier.wait_seconds + self.flight.waited
        end, self._update_end = self._update_end, None
        # While the update runs it has the tier to itself (engine.chunks.flight): the
        # counters will stand where it said they would once it is over. One that stopped
        # short (a failed read) moved less than it said: later counts make up for it,
        # none going below zero.
        read, written = end if end is not None and self.flight.active else (
            tier.bytes_read, tier.bytes_written)
        read, written = max(read, r), max(written, w)
        self._disk_base = (read, written, waited)
        return read - r, written - w, waited - s
