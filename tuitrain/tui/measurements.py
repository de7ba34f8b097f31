"""RunMeter: the run's recent pace and peak, as a saved preset records them."""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass

from engine.telemetry import StepStats
from tuitrain.formatting import format_rate, format_seconds, format_size
from tuitrain.metrics import pace, tokens_per_second

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
    """Tokens/s over the last steps (for the header), and what the current settings cost:
    the device peak and the pace since they last changed (what a preset saved now records).

    The run's first step is left out of the pace while later ones exist: it also traces
    the chunk order, so it is slower than the settings deserve.
    """

    def __init__(self, *, window: int = RATE_WINDOW) -> None:
        self._recent: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens, seconds)
        self._since: deque[tuple[int, int, float]] = deque(maxlen=window)  # + the step
        self._from_step = 0  # the first step run with the current settings
        self._first_step: int | None = None
        self._peak = 0
        self._last: StepStats | None = None

    def record(self, stats: StepStats) -> None:
        self._recent.append((stats.tokens, stats.seconds))
        if self._first_step is None:
            self._first_step = stats.step
        if stats.step >= self._from_step:
            self._since.append((stats.step, stats.tokens, stats.seconds))
            self._peak = max(self._peak, stats.memory.device_peak)
        self._last = stats

    def settings_changed(self, from_step: int = 0) -> None:
        """Measure afresh from `from_step` (the first step with the new settings): the old
        settings' peak and pace say nothing of the new ones."""
        self._from_step = from_step
        self._since.clear()
        self._peak = 0

    def reset(self) -> None:
        self._recent.clear()
        self.settings_changed()
        self._first_step = None
        self._last = None

    @property
    def tokens_per_second(self) -> float | None:
        return tokens_per_second(self._recent)

    def measured(self) -> Measured | None:
        """None before the first step. Right after a change, before a step ran with the new
        settings, the latest steps stand in for them."""
        if self._last is None:
            return None
        since = [(t, s) for _, t, s in self._since]
        warm_up = bool(self._since) and self._since[0][0] == self._first_step
        steady = pace(since, warm_up=warm_up) or pace(list(self._recent), warm_up=False)
        assert steady is not None  # a step was recorded
        return Measured(
            step=self._last.step,
            device_peak=self._peak or self._last.memory.device_peak,
            step_seconds=steady.step_seconds,
            tokens_per_second=steady.tokens_per_second,
        )
