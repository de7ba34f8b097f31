"""How numbers read on the screen: sizes, parameter counts, durations, rates."""

from __future__ import annotations

from engine.config import format_size

__all__ = [
    "format_count",
    "format_rate",
    "format_seconds",
    "format_size",
    "size_unit",
    "step_ticks",
]

STEP_TICKS = 5  # labels on a step axis


def format_count(n: int) -> str:
    """Parameter counts: 812, 12.3k, 125.2M, 1.3B."""
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{suffix}"
    return str(n)


def format_seconds(seconds: float) -> str:
    """Durations from microseconds to minutes: 0 s, 850 µs, 12.5 ms, 1.23 s, 2m05s."""
    if seconds <= 0:
        return "0 s"  # nothing happened (no transfer under cuda): no unit to pick
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 1.0:
        return f"{seconds * 1e3:.1f} ms"
    if seconds < 120.0:
        return f"{seconds:.2f} s"
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}m{rest:02d}s"


def format_rate(per_second: float) -> str:
    """Throughputs: 950, 12.4k, 1.3M."""
    if per_second >= 1e4:
        return format_count(int(per_second))
    return f"{per_second:,.0f}"


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
