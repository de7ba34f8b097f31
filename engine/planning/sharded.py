"""One data-parallel rank's gathers and gradient reductions, replayed in bytes.

The counterpart of engine.chunks.sharding.ShardedChunks for engine.planning.replay's
StepReplay: a layer over it, which the replay is built with (StepReplay's `sharding`) and
knows only as its DataParallel side (engine.planning.data_parallel). Every rank runs the
same modules on a batch of the same shape, so every rank's step is this one: what a
boundary agreement decides (gather what any rank lacks; reduce-scatter the chunks whose
gradients are complete everywhere) is what this rank alone would decide.

- A module's chunk is gathered whole whenever it is not on the device or its copy is stale
  (its gradients went home): this rank copies its own shard in (unless the shard is
  resident) and receives the others'.
- The next module's chunks are gathered ahead of use, once the module's own chunks are in,
  when this rank offers them (rules.gathers_ahead, the offer StepReplay makes as the
  ChunkManager does) and lacks them: into room that needs no eviction, in ascending chunk
  order, counted as any gather.
- Every chunk's gradients go to a whole gradient buffer on the device, resident or not.
  Once all of them are in, the buffer is held until the next boundary reduce-scatters it
  (descending chunk order), and the boundary after that lands this rank's shard at home
  (copied to the host unless resident) and frees the buffer. The end of backward reduces
  and lands what is left.

Bytes communicated are counted as engine.distributed.collectives counts them: per gather,
the other ranks' shards this rank receives; per reduce-scatter, the bytes it sends into
the other ranks' shards. Both are the whole chunk less this rank's shard.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.planning.replay import StepReplay

__all__ = ["ShardedReplay"]


class ShardedReplay:
    """The data-parallel side of a StepReplay: gathers and gradient reduction, in bytes."""

    def __init__(self, replay: StepReplay) -> None:
        self.replay = replay
        self.cost = cost = replay.cost
        # This rank's shard of each chunk, in the compute dtype.
        self.shard_bytes = [n // cost.world for n in replay.nbytes]
        self._ready: set[int] = set()  # gradients complete on this rank this backward
        self._issued: set[int] = set()  # reduce-scatters issued this backward
        self._pending: list[int] = []  # chunks being reduced, landed at the next boundary
        self._held: dict[int, int] = {}  # chunk -> bytes of its buffer held for a reduction
        self.held_bytes = 0
        self.gathered = 0  # bytes received by all-gathers this step
        self.reduce_scattered = 0  # bytes sent into reduce-scatters this step

    # --- module boundaries ------------------------------------------------------------

    def boundary(self, needed: tuple[int, ...], offer: list[int]) -> tuple[set[int], list[int]]:
        """ShardedChunks.boundary: lands the reductions issued at the last boundary, issues
        those now complete, and returns the chunks of `needed` to gather and those of
        `offer` to gather ahead."""
        r = self.replay
        lacks = {c for c in (*needed, *offer) if c not in r.on_device or c in r.stale}
        self._land_all()
        for chunk in sorted(self._waiting() & self._ready, reverse=True):
            self._issue(chunk)
        return lacks.intersection(needed), sorted(lacks.intersection(offer))

    def reducing(self, chunk: int) -> bool:
        """ShardedChunks.reducing: its reduction was issued this backward."""
        return chunk in self._issued

    def materialise(self, chunk: int, protect: tuple[int, ...], *, gather: bool) -> None:
        """ChunkManager.materialise of a sharded chunk."""
        r = self.replay
        r.last_use[chunk] = r.pos
        if chunk in r.on_device and chunk not in r.stale and not gather:
            return
        if chunk not in r.on_device:
            r._make_room(r.nbytes[chunk], protect + (chunk,))
            r.on_device.add(chunk)
            r.take_buffer(chunk)
            r._sample()
        self._gather(chunk)

    def gather_ahead(self, chunk: int) -> None:
        """ChunkManager._gather_ahead: into room the offer found free."""
        r = self.replay
        if chunk not in r.on_device:
            r.on_device.add(chunk)
            r.take_buffer(chunk)
            r._sample()
        self._gather(chunk)

    def _gather(self, chunk: int) -> None:
        r = self.replay
        if chunk not in r.resident:
            # Its own shard comes from the host; after its gradients went home, in bf16 and
            # fp16 from the fp32 master (the payload holds gradients then).
            from_master = chunk in r.home and not self.cost.aliased
            r.copied += 4 * self.cost.home(r.lay.numel[chunk]) if from_master else \
                self.shard_bytes[chunk]
            r.fetches.append((chunk, chunk in r.home))  # from disk, where it is there
        r.stale.discard(chunk)
        self.gathered += r.nbytes[chunk] - self.shard_bytes[chunk]

    # --- gradients ----------------------------------------------------------------------

    def ready(self, chunk: int) -> None:
        """Every gradient of `chunk` this backward computes is in: its buffer is held."""
        self._ready.add(chunk)
        if chunk in self.replay.grads:
            self._hold(chunk)

    def _hold(self, chunk: int) -> None:
        if chunk not in self._held:
            self._held[chunk] = self.replay.nbytes[chunk]
            self.held_bytes += self.replay.nbytes[chunk]

    def _waiting(self) -> set[int]:
        return set(range(len(self.replay.nbytes))) - self._issued

    def _issue(self, chunk: int) -> None:
        """Start reducing `chunk`'s gradient buffer (a zeroed one when no gradient came)."""
        r = self.replay
        if chunk not in r.grads:
            r.open_grads(chunk, ())
        r.grads.discard(chunk)  # the buffer now belongs to the reduction
        self._hold(chunk)
        self._issued.add(chunk)
        self._pending.append(chunk)
        self.reduce_scattered += r.nbytes[chunk] - self.shard_bytes[chunk]

    def _land_all(self) -> None:
        pending, self._pending = self._pending, []
        for chunk in pending:
            self._land(chunk)

    def _land(self, chunk: int) -> None:
        """The reduced shard into its home (copied to the host unless resident); the
        buffer is freed and a device copy is stale."""
        r = self.replay
        if chunk not in r.resident:
            r.copied += self.shard_bytes[chunk]
            if chunk in r.home and chunk in r.disk.chunks:
                # Added to those the disk holds (a later micro-batch's): the sum comes back.
                r.copied += self.shard_bytes[chunk]
        r.home.add(chunk)
        if chunk in r.on_device:
            r.stale.add(chunk)
        self.held_bytes -= self._held.pop(chunk, 0)
        r.grad_bytes -= r.nbytes[chunk]
        r.give_buffer(chunk)
        r._sample()

    def finish(self) -> None:
        """ShardedChunks.finish: the end of backward reduces every chunk still waiting, in
        descending order, and lands them all."""
        self._land_all()
        for chunk in sorted(self._waiting(), reverse=True):
            self._issue(chunk)
        self._land_all()
        self._ready.clear()
