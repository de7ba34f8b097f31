"""A test double for engine.distributed.Collectives: rank 0 of two, whose peer does exactly
what it does, in this process. No process group, no second rank to launch.

The peer's shard of a gathered chunk is a copy of this rank's (the values are not the
peer's: only the shapes are), a reduce-scatter adds the peer's identical gradient, and
every agreement is this rank's own view. So the engine places, gathers, reduces and
allocates as rank 0 of a real pair that trains on the same batch would, in milliseconds:
what a test of device bytes needs. Not for tests of the arithmetic (dp_harness runs ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Done:
    """A collective that completed when it was issued."""

    what: str
    chunk: int


class TwinCollectives:
    """The Collectives interface the engine uses, for rank 0 of a world of two twins."""

    rank, world = 0, 2
    device = torch.device("cpu")

    def __init__(self, *, timeout: float = 20.0) -> None:
        self.timeout = timeout
        self.issued = 0
        self.bytes_gathered = self.bytes_reduce_scattered = 0

    def reset_counters(self) -> None:
        self.bytes_gathered = self.bytes_reduce_scattered = 0

    def wait(self, pending: Done) -> None:
        pass

    def gather(self, full: torch.Tensor, chunk: int) -> None:
        self.wait(self.start_gather(full, chunk))

    def start_gather(self, full: torch.Tensor, chunk: int) -> Done:
        half = full.numel() // 2
        full[half:].copy_(full[:half])
        self.issued += 1
        self.bytes_gathered += full.nbytes - full[:half].nbytes
        return Done("all-gather", chunk)

    def reduce_scatter(self, full: torch.Tensor, chunk: int) -> Done:
        half = full.numel() // 2
        full[:half].mul_(2)  # the twin's gradient is this rank's
        self.issued += 1
        self.bytes_reduce_scattered += full.nbytes - full[:half].nbytes
        return Done("reduce-scatter", chunk)

    def max_ints(self, values: list[int]) -> list[int]:
        return list(values)

    def sum_floats(self, values: list[float]) -> list[float]:
        return [2 * v for v in values]

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        return torch.stack([row, row])

    def agree_step(self, loss: float, tokens: int, used: list[bool]
                   ) -> tuple[float, int, list[bool]]:
        self.issued = 0
        return loss, 2 * tokens, list(used)
