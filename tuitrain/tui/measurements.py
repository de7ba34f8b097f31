"""RunMeter: the run's recent pace, for the header.

What each setting achieved (the preset's header, the trials table) is measured by
tuitrain.trials; this is only how fast the last steps went, whatever their settings.
"""

from __future__ import annotations

from collections import deque

from engine.telemetry import StepStats
from tuitrain.metrics import tokens_per_second

RATE_WINDOW = 20  # steps averaged for tokens/s


class RunMeter:
    """Tokens/s over the last RATE_WINDOW steps."""

    def __init__(self, *, window: int = RATE_WINDOW) -> None:
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds)

    def record(self, stats: StepStats) -> None:
        self._recent.append((stats.tokens, stats.seconds))

    def reset(self) -> None:
        self._recent.clear()

    @property
    def tokens_per_second(self) -> float | None:
        return tokens_per_second(self._recent)
