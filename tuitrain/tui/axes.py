"""Chart axes: the unit a byte scale reads best in, and the labels of a step axis."""

from __future__ import annotations

STEP_TICKS = 5  # labels on a step axis


def size_unit(largest: float) -> tuple[str, int]:
    """The unit a chart of byte values up to `largest` reads best in: GiB or MiB."""
    if largest >= 1024**3:
        return "GiB", 1024**3
    return "MiB", 1024**2


def step_ticks(steps: list[int]) -> list[int]:
    """At most STEP_TICKS whole step numbers over the window, both ends included.

    The labels between the ends are evenly spaced from the first (1 3 5 7, never the
    1 3 4 5 7 that rounding fractions of the span gives); one that would crowd the last
    label is left out.
    """
    first, last = steps[0], steps[-1]
    span = last - first
    if span < STEP_TICKS:
        return list(range(first, last + 1))
    spacing = -(-span // (STEP_TICKS - 1))  # ceiling: at most STEP_TICKS - 2 inner labels
    inner = [t for t in range(first + spacing, last, spacing) if last - t > spacing / 2]
    return [first, *inner, last]
