"""How numbers read to a person, on the screen and in the terminal: counts, rates, durations
and sizes (the engine's format_size)."""

from __future__ import annotations

from engine.config import format_size

__all__ = ["format_count", "format_rate", "format_seconds", "format_size", "plural"]


def format_count(n: float, *, nominal: bool = False) -> str:
    """A count with its scale: 812, 12.3k, 125.2M, 1.3B.

    nominal: the size a model is known by, whole from ten of a unit up: 657k, 125M, 1.3B, 13B.
    """
    for suffix, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            value = n / scale
            decimals = 0 if nominal and abs(value) >= 10 else 1
            return f"{value:.{decimals}f}{suffix}"
    return f"{n:.0f}"


def format_rate(per_second: float) -> str:
    """Throughputs: 950, 1,234, 12.4k, 1.3M."""
    if per_second >= 1e4:
        return format_count(per_second)
    return f"{per_second:,.0f}"


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


def format_trained(parameters: int, trainable: int | None) -> str:
    """What of the parameters trains, when not all do (LoRA): " (12.3k trainable, 1.2M
    frozen)"; "" when every one trains or it is not known."""
    if trainable is None or trainable >= parameters:
        return ""
    return f" ({format_count(trainable)} trainable, {format_count(parameters - trainable)} frozen)"


def plural(n: int, word: str) -> str:
    """`n` and `word`, in the plural unless n is 1: "1 step", "3 steps"."""
    return f"{n} {word}{'' if n == 1 else 's'}"
