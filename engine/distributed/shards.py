"""Shard arithmetic: which elements of a chunk a rank owns.

A chunk of `numel` elements (padded to a multiple of the world size, see padded_numel) is
cut into `world` equal, contiguous shards; rank r owns elements [r * size, (r + 1) * size).
The padding sits at the end of the last shards and is always zero.
"""

from __future__ import annotations

from dataclasses import dataclass

ALIGN = 32  # elements; every shard starts 64-byte aligned, as every parameter view does


def padded_numel(numel: int, world: int) -> int:
    """`numel` rounded up so that it splits into `world` aligned shards."""
    unit = world * ALIGN
    return -(-numel // unit) * unit


@dataclass(frozen=True)
class Shard:
    """Rank `rank`'s part of a chunk of `numel` elements (already padded) over `world`."""

    rank: int
    world: int
    numel: int

    def __post_init__(self) -> None:
        if self.numel % self.world:
            raise ValueError(f"a chunk of {self.numel} elements does not split into "
                             f"{self.world} shards; pad it first (padded_numel)")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world}")

    @property
    def size(self) -> int:
        """Elements per shard."""
        return self.numel // self.world

    @property
    def lo(self) -> int:
        return self.rank * self.size

    @property
    def hi(self) -> int:
        return self.lo + self.size


def overlap(offset: int, numel: int, lo: int, hi: int) -> tuple[int, int] | None:
    """The part [a, b) of elements [offset, offset + numel) that lies in [lo, hi), in chunk
    coordinates; None when they do not meet."""
    a, b = max(offset, lo), min(offset + numel, hi)
    return (a, b) if a < b else None
