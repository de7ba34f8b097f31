"""What a replayed step asks of data parallel, when its chunks are sharded.

The replay (engine.planning.replay.StepReplay) knows no shards of its own: it asks this side
at each module boundary and as gradients come in, and the sharded replay above it
(engine.planning.sharded) supplies it, as engine.chunks.data_parallel is the engine's.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["DataParallel"]


class DataParallel(Protocol):
    """The data-parallel side of a sharded StepReplay."""

    held_bytes: int  # gradient buffers held for a reduction
    gathered: int
    reduce_scattered: int

    def boundary(self, needed: tuple[int, ...], offer: list[int]) -> tuple[set[int], list[int]]:
        ...

    def reducing(self, chunk: int) -> bool: ...

    def materialise(self, chunk: int, protect: tuple[int, ...], *, gather: bool) -> None: ...

    def gather_ahead(self, chunk: int) -> None: ...

    def ready(self, chunk: int) -> None: ...

    def finish(self) -> None: ...
