"""Chart axes: the unit a byte scale reads best in, its labels, and the labels of a step
axis."""

from __future__ import annotations

import math

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


def value_ticks(top: float, rows: int) -> list[float]:
    """Labels for a value axis from 0 to `top` drawn in `rows` rows: evenly spaced round
    values (1, 2, 2.5 or 5 times a power of ten), at least two rows apart, none skipped.

    plotext picks its own and drops one that would collide with its neighbour on a short
    chart (398.9 / 319.1 / 159.6 / 79.8): these are spaced for the rows there are.
    """
    if top <= 0 or rows < 2:
        return [0.0]
    most = max(1, rows // 2)  # labels above 0, a row of gap between each
    power = math.floor(math.log10(top))
    steps = [m * 10.0**k for k in range(power - 2, power + 1) for m in (1, 2, 2.5, 5)]
    fitting = [s for s in steps if s <= top and top // s <= most]
    step = min(fitting) if fitting else top
    return [round(i * step, 10) for i in range(int(top // step) + 1)]
