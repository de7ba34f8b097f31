"""The update's walk over chunks, span by span, with the parts on disk read ahead and
written behind (engine.chunks.spill holds them; engine.step.optimizer updates the spans)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from engine.chunks.chunk import Chunk
from engine.chunks.spill import GRAD, PAYLOAD, Loaded, Spill
from engine.chunks.spill_regions import update_regions


@dataclass
class Span:
    """Elements lo..hi of a chunk as the update sees them: each tensor covers just those
    (views into the chunk's host tensors or into I/O buffers)."""

    lo: int
    hi: int
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grads: torch.Tensor  # in the compute dtype (bf16/fp16: where they landed, the payload)
    payload: torch.Tensor | None  # bf16/fp16: where the new parameters go; fp32: None

    @classmethod
    def whole(cls, chunk: Chunk) -> Span:
        """The whole chunk, from its own tensors (nothing of it on disk); sharded, this
        rank's shard of it, whose elements are lo..hi of the chunk."""
        lo, hi = (chunk.shard.lo, chunk.shard.hi) if chunk.shard else (0, chunk.numel)
        return cls(lo, hi, chunk.master, chunk.exp_avg, chunk.exp_avg_sq,
                   chunk.host_grad if chunk.aliased else chunk.payload,
                   None if chunk.aliased else chunk.payload)


class UpdatePipeline:
    """The optimizer's walk over chunks and their pieces, in order, with the parts on disk
    read ahead and written behind: while piece k is updated, piece k+1 is read and piece
    k-1 written, as far as the buffers go (three state buffers: one each).

        pipe = UpdatePipeline(spill, chunks); pipe.start()
        for chunk in chunks:
            update(chunk, pipe.spans(chunk))   # each span is written once the next is asked

    A write that fails does not stop the walk: the buffer keeps that piece (the tier holds
    it and reports it, see DiskTier) and every other piece is updated, so the step is whole
    either way.
    """

    def __init__(self, spill: Spill, chunks: list[Chunk]) -> None:
        self.spill = spill
        # Pieces of chunks with state on disk, in update order.
        self.queue = deque((c, i) for c in chunks if c.state_on_disk
                           for i in range(len(spill.spans(c))))
        self._loading: dict[tuple[int, int], dict[str, Loaded]] = {}

    def start(self) -> None:
        """Start the first reads (before the global norm, so that they overlap it)."""
        self._ahead()

    def _ahead(self) -> None:
        for chunk, i in self.queue:
            got = self._loading.setdefault((chunk.index, i), {})
            for region in update_regions(chunk):
                if region not in got:
                    loaded = self.spill.load_piece(chunk, region, i, wait=False)
                    if loaded is None:
                        return  # out of buffers: later pieces wait their turn, in order
                    got[region] = loaded

    def spans(self, chunk: Chunk) -> Iterator[Span]:
        """The chunk's spans for the update, each with its parts in buffers; once the
        caller asks for the next one (or ends), the updated parts are written behind."""
        if not chunk.state_on_disk:
            yield Span.whole(chunk)
            return
        spill, tier = self.spill, self.spill.tier
        for i, (lo, hi) in enumerate(spill.spans(chunk)):
            if self.queue and self.queue[0] == (chunk, i):
                self.queue.popleft()
            got = self._loading.pop((chunk.index, i), {})
            try:
                for region in update_regions(chunk):
                    if region not in got:
                        got[region] = spill.load_piece(chunk, region, i)
                views: dict[str, torch.Tensor] = {}
                for region, (buffer, future) in got.items():
                    tier.finish(future)
                    views.update(spill.views(chunk, region, buffer, hi - lo))
            except BaseException:
                for region, loaded in got.items():
                    spill.give_back(region, loaded)
                raise
            self._ahead()
            try:
                yield self._span(chunk, lo, hi, views)
            except BaseException:  # the update failed or stopped: nothing to write
                for region, loaded in got.items():
                    spill.give_back(region, loaded)
                raise
            for region, (buffer, _) in got.items():
                if region == GRAD:  # used up; so is a copy held after a failed write
                    tier.forget((chunk.index, GRAD, i))
                    tier.release(PAYLOAD, buffer)
                else:
                    spill.store_piece(chunk, region, i, buffer)
        chunk.grad_sq = None

    @staticmethod
    def _span(chunk: Chunk, lo: int, hi: int, views: dict[str, torch.Tensor]) -> Span:
        """Each part from its buffer if it was read, else from the chunk's host tensor.
        `lo`..`hi` count in the home tensors (Spill.spans); the span's, in the chunk."""
        def part(name: str) -> torch.Tensor:
            return views[name] if name in views else getattr(chunk, name)[lo:hi]

        payload = part("payload")
        master = payload if chunk.aliased else part("master")
        grads = part("host_grad") if chunk.aliased else payload
        start = chunk.shard.lo if chunk.shard else 0
        return Span(start + lo, start + hi, master, part("exp_avg"), part("exp_avg_sq"), grads,
                    None if chunk.aliased else payload)

    def cancel(self) -> None:
        """Give back every buffer read ahead and not used (a skipped or failed update)."""
        for got in self._loading.values():
            for region, loaded in got.items():
                self.spill.give_back(region, loaded)
        self._loading.clear()
        self.queue.clear()


class NoDisk:
    """The update walk when nothing is on disk: one span per chunk, its own tensors."""

    def start(self) -> None:
        pass

    def spans(self, chunk: Chunk) -> Iterator[Span]:
        yield Span.whole(chunk)

    def cancel(self) -> None:
        pass
