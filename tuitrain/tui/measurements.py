"""RunMeter: the run's recent pace and peak, as a saved preset records them."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

from engine.telemetry import StepStats
from tuitrain.tui.formatting import format_rate, format_seconds, format_size

RATE_WINDOW = 20  # steps averaged for tokens/s and the step time


@dataclass(frozen=True)
class Measured:
    """What the current settings achieved, as the preset's header records it."""

    step: int  # the last step seen
    device_peak: int  # bytes, highest since the settings last changed
    step_seconds: float  # mean over recent steps
    tokens_per_second: float | None

    def as_dict(self) -> dict[str, object]:
        """The keys tuitrain.presets.save_preset understands; unknown values left out."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    def describe(self) -> str:
        text = (
            f"measured at step {self.step}: peak {format_size(self.device_peak)}, "
            f"{format_seconds(self.step_seconds)}/step"
        )
        if self.tokens_per_second:
            text += f", {format_rate(self.tokens_per_second)} tok/s"
        return text


class RunMeter:
    """Tokens/s and step time over the last steps, and the device peak since the settings
    last changed (what a preset saved now should say these settings cost)."""

    def __init__(self, *, window: int = RATE_WINDOW) -> None:
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds)
        self._peak = 0
        self._last: StepStats | None = None

    def record(self, stats: StepStats) -> None:
        self._recent.append((stats.tokens, stats.seconds))
        self._peak = max(self._peak, stats.memory.device_peak)
        self._last = stats

    def settings_changed(self) -> None:
        """Measure the peak afresh: the old settings' peak says nothing of the new ones."""
        self._peak = 0

    def reset(self) -> None:
        self._recent.clear()
        self._peak = 0
        self._last = None

    @property
    def tokens_per_second(self) -> float | None:
        seconds = sum(s for _, s in self._recent)
        return sum(t for t, _ in self._recent) / seconds if seconds > 0 else None

    def measured(self) -> Measured | None:
        """None before the first step."""
        if self._last is None:
            return None
        seconds = [s for _, s in self._recent]
        return Measured(
            step=self._last.step,
            device_peak=self._peak or self._last.memory.device_peak,
            step_seconds=sum(seconds) / len(seconds),
            tokens_per_second=self.tokens_per_second,
        )
