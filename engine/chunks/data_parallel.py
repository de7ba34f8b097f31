"""What the chunk manager asks of data parallel, when the chunks are sharded.

The manager knows no shards of its own: it calls this hook at the points where the ranks
must agree (module boundaries, the end of backward, a failed step), and the sharding layer
above it (engine.chunks.sharding.ShardedChunks, which takes the manager) supplies it. So
data parallel is a layer over the single-process parts, not their partner.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from engine.chunks.chunk import Chunk
from engine.distributed.collectives import Collectives
from engine.placement.trace import Trace


class DataParallel(Protocol):
    """Gathers and gradient reductions across the ranks, for the manager's chunks."""

    collectives: Collectives
    held_bytes: int  # gradient buffers complete here that wait for, or are in, a reduction
    on_interrupt: Callable[[], None]  # what every rank does once they agree to stop

    def request_interrupt(self) -> None: ...

    def begin(self) -> None: ...

    def finish(self) -> None: ...

    def drop(self) -> None: ...

    def agree_trace(self, trace: Trace, overrun: int) -> int: ...

    def boundary(self, needed: tuple[Chunk, ...], offer: list[int], phase: str = ""
                 ) -> tuple[set[int], list[int]]: ...

    def reducing(self, index: int) -> bool: ...

    def gather(self, chunk: Chunk) -> None: ...

    def start_gather(self, chunk: Chunk) -> None: ...

    def settle(self, chunk: Chunk) -> None: ...

    def arrived(self, chunk: Chunk, offset: int) -> None: ...

    def ready(self, chunk: Chunk) -> None: ...

    def whole(self, chunk: Chunk, shard: torch.Tensor) -> torch.Tensor: ...
