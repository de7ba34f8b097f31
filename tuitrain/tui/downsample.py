"""Fewer points for a chart than it has samples: plotext's cost grows with the points drawn,
and a chart cannot show more points than it has dots across."""

from __future__ import annotations

from collections.abc import Callable, Sequence


def downsample(
    steps: Sequence[int],
    values: Sequence[float],
    limit: int,
    *,
    reduce: Callable[[Sequence[float]], float] = max,
) -> tuple[list[int], list[float]]:
    """At most `limit` points: consecutive samples grouped, each group drawn at its last step.

    `reduce` picks a group's value: max (the default) keeps memory peaks visible, a mean
    smooths a noisy loss. Fewer samples than `limit` come back unchanged.
    """
    if len(steps) != len(values):
        raise ValueError(f"{len(steps)} steps but {len(values)} values")
    if limit < 1:
        raise ValueError(f"limit must be at least 1, not {limit}")
    if len(steps) <= limit:
        return list(steps), list(values)
    xs: list[int] = []
    ys: list[float] = []
    n = len(steps)
    for bucket in range(limit):
        lo, hi = bucket * n // limit, (bucket + 1) * n // limit
        xs.append(steps[hi - 1])
        ys.append(reduce(values[lo:hi]))
    return xs, ys


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)
