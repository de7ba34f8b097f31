"""Trials: what each setting a run has used achieved, to compare them and keep the best.

A setting is what a run changes live: policy, margin_ratio, device_budget, and how its steps
are built (micro-batches of its global batch, activation checkpointing). A run that changed
it went through several; each is one trial, whose steps may come in several
stretches when the user went back to a setting tried before. Pure bookkeeping over
StepStats, no UI: the app shows the rows as a table, the headless runner prints them and
appends them to the metrics file in the run's summary line.

Which steps are timed: the first step of each stretch is left out (the run's first step
records the chunk order; a step right after a change re-places chunks), so a trial's step
time is the median of the steps that ran settled under it. These words are the same
wherever a pace is shown (the app's header and table, the headless summary, a preset's
header): "median of N settled steps", with its spread, and the best trial starred only once
it has BEST_MIN_SETTLED of them.
"""

from __future__ import annotations

import os
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

from engine.telemetry import StepStats
from tuitrain.formatting import format_rate, format_seconds, format_size, plural
from tuitrain.metrics import MetricsWriter

# Settled steps a trial keeps for its medians: its latest, so that a long run stays small and
# a redraw stays cheap; the count of settled steps goes on.
SAMPLES_KEPT = 1000
# Settled steps a trial needs before it can be starred the fastest: with fewer, one step
# that ran slow or quick (a page fault storm, another process) decides the ranking.
BEST_MIN_SETTLED = 5


@dataclass(frozen=True, order=True)
class Setting:
    """The live setting a step ran under."""

    policy: str
    margin_ratio: float
    device_budget: int  # bytes
    micro_batches: int = 1  # per step, of the run's global batch (its grad_accum)
    activation_checkpointing: bool = False

    @classmethod
    def of(cls, stats: StepStats) -> Setting:
        return cls(stats.policy, round(stats.margin_ratio, 4), stats.device_budget,
                   stats.micro_batches, stats.activation_checkpointing)

    def describe(self) -> str:
        """The setting in words: auto, margin 0.30, budget 3.0 GiB (and ", 4 micro-batches,
        checkpointing" when a step is built so)."""
        return (
            f"{self.policy}, margin {self.margin_ratio:.2f}, "
            f"budget {format_size(self.device_budget)}{shape_words(self, ', ')}"
        )


def shape_words(setting: Setting, before: str) -> str:
    """How its steps were built, after `before`: "4 micro-batches, checkpointing"; nothing
    for one micro-batch without checkpointing."""
    parts = [f"{setting.micro_batches} micro-batches"] if setting.micro_batches > 1 else []
    parts += ["checkpointing"] if setting.activation_checkpointing else []
    return before + ", ".join(parts) if parts else ""


@dataclass(frozen=True)
class Trial:
    """One setting and what the run measured while it was in force.

    Step time and bytes copied are medians over the settled steps (the latest SAMPLES_KEPT
    of them; None while there is none), tokens/s the median step's tokens over its time;
    the device peak and host RSS are the
    highest of all its steps, since a step that re-placed chunks still had to fit.
    """

    policy: str
    margin_ratio: float
    device_budget: int  # bytes
    steps: int  # steps it ran, settled or not
    settled_steps: int  # the steps its medians are taken over
    first_step: int
    last_step: int
    step_seconds: float | None
    tokens_per_second: float | None
    # Half the interquartile range of the settled step times, as a share of their median
    # (0.04: ±4%); None below two settled steps.
    step_seconds_spread: float | None
    device_peak: int  # bytes, highest of its steps
    bytes_copied: int | None  # h2d + d2h per settled step, bytes
    process_rss: int  # host RSS, bytes, highest of its steps
    within_budget: bool  # device_peak <= device_budget on every step it ran
    micro_batches: int = 1
    activation_checkpointing: bool = False

    @property
    def setting(self) -> Setting:
        return Setting(self.policy, self.margin_ratio, self.device_budget, self.micro_batches,
                       self.activation_checkpointing)

    def measured(self) -> dict[str, object]:
        """What a preset saved for this trial records in its header (presets.save_preset)."""
        values: dict[str, object] = {
            "first_step": self.first_step,
            "settled_steps": self.settled_steps,
            "step": self.last_step,
            "device_peak": self.device_peak,
            "step_seconds": self.step_seconds,
            "tokens_per_second": self.tokens_per_second,
            "bytes_copied_per_step": self.bytes_copied,
            "process_rss": self.process_rss,
            "within_budget": self.within_budget,
        }
        return {k: v for k, v in values.items() if v is not None}

    def describe(self) -> str:
        """One line: the setting, then what it measured."""
        return f"{self.setting.describe()}: {describe_measurements(self)}"


def format_spread(spread: float | None) -> str:
    """A trial's spread as the screen writes it: ±4%; "" when there is none yet."""
    return "" if spread is None else f"±{spread:.0%}"


def describe_pace(trial: Trial) -> str:
    """The trial's pace in the words every place uses: "1.23 s/step, 208 tok/s (median of
    12 settled steps, ±4%)"; "no settled step yet" before there is one."""
    if trial.step_seconds is None or trial.tokens_per_second is None:
        return "no settled step yet"
    spread = format_spread(trial.step_seconds_spread)
    return (
        f"{format_seconds(trial.step_seconds)}/step, {format_rate(trial.tokens_per_second)} "
        f"tok/s (median of {plural(trial.settled_steps, 'settled step')}"
        f"{', ' + spread if spread else ''})"
    )


def describe_measurements(trial: Trial) -> str:
    """What a trial measured in words: 12 steps, 1.23 s/step, 208 tok/s (median of 11
    settled steps, ±4%), device peak ..."""
    parts = [plural(trial.steps, "step"), describe_pace(trial)]
    over = "" if trial.within_budget else " (over budget)"
    parts.append(f"device peak {format_size(trial.device_peak)}{over}")
    if trial.bytes_copied is not None:
        parts.append(f"copied {format_size(trial.bytes_copied)}/step")
    parts.append(f"host RSS {format_size(trial.process_rss)}")
    return ", ".join(parts)


def _recent() -> deque:
    return deque(maxlen=SAMPLES_KEPT)


@dataclass
class _Tally:
    """One setting's steps so far: counts and peaks, and the latest settled steps' numbers."""

    first_step: int
    last_step: int
    steps: int = 0
    settled: int = 0
    seconds: deque[float] = field(default_factory=_recent)  # settled steps only
    tokens: deque[int] = field(default_factory=_recent)  # settled steps only
    copied: deque[int] = field(default_factory=_recent)
    device_peak: int = 0
    process_rss: int = 0
    within_budget: bool = True


class TrialBook:
    """Folds steps, in the order they ran, into one trial per setting."""

    def __init__(self) -> None:
        self._tallies: dict[Setting, _Tally] = {}
        self._previous: Setting | None = None

    def record(self, stats: StepStats) -> None:
        setting = Setting.of(stats)
        tally = self._tallies.get(setting)
        if tally is None:
            tally = self._tallies[setting] = _Tally(first_step=stats.step, last_step=stats.step)
        # The first step of a stretch, or one at which the worker applied a change (even
        # back to the same value), re-placed chunks or traced: it is not what the setting
        # costs once settled.
        settling = setting != self._previous or bool(stats.applied)
        self._previous = setting
        tally.steps += 1
        tally.last_step = stats.step
        memory = stats.memory
        tally.device_peak = max(tally.device_peak, memory.device_peak)
        tally.process_rss = max(tally.process_rss, memory.process_rss)
        tally.within_budget &= memory.device_peak <= stats.device_budget
        if not settling and stats.seconds > 0:
            tally.settled += 1
            tally.seconds.append(stats.seconds)
            tally.tokens.append(stats.tokens)
            tally.copied.append(stats.bytes_h2d + stats.bytes_d2h)

    def reset(self) -> None:
        self._tallies.clear()
        self._previous = None

    @property
    def current(self) -> Setting | None:
        """The setting of the latest step."""
        return self._previous

    def rows(self) -> list[Trial]:
        """One trial per setting, in the order they were first used."""
        return [_trial(setting, tally) for setting, tally in self._tallies.items()]


def _median(values: deque) -> float | None:
    return statistics.median(values) if values else None


def _rate(tally: _Tally) -> float | None:
    """Tokens a second at the median step: its tokens over its time, so that the two
    figures are one (a median of rates would be another step's for an even count)."""
    seconds, tokens = _median(tally.seconds), _median(tally.tokens)
    return None if seconds is None or tokens is None else tokens / seconds


def _spread(values: deque) -> float | None:
    if len(values) < 2:
        return None
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / 2 / median if median > 0 else None


def _trial(setting: Setting, tally: _Tally) -> Trial:
    copied = _median(tally.copied)
    return Trial(
        policy=setting.policy,
        margin_ratio=setting.margin_ratio,
        device_budget=setting.device_budget,
        steps=tally.steps,
        settled_steps=tally.settled,
        first_step=tally.first_step,
        last_step=tally.last_step,
        step_seconds=_median(tally.seconds),
        tokens_per_second=_rate(tally),
        step_seconds_spread=_spread(tally.seconds),
        device_peak=tally.device_peak,
        bytes_copied=None if copied is None else int(copied),
        process_rss=tally.process_rss,
        within_budget=tally.within_budget,
        micro_batches=setting.micro_batches,
        activation_checkpointing=setting.activation_checkpointing,
    )


def trials(steps: Iterable[StepStats]) -> list[Trial]:
    """One trial per setting the steps ran under, in the order the settings were first used."""
    book = TrialBook()
    for stats in steps:
        book.record(stats)
    return book.rows()


def best_trial(rows: Iterable[Trial]) -> Trial | None:
    """The fastest trial that stayed within its budget on every step and has at least
    BEST_MIN_SETTLED settled steps; None when none has. Fastest: most tokens/s (median),
    then the shortest step."""
    candidates = [
        t for t in rows
        if t.within_budget and t.step_seconds is not None and t.settled_steps >= BEST_MIN_SETTLED
    ]
    if not candidates:
        return None
    return min(candidates, key=lambda t: (-(t.tokens_per_second or 0.0), t.step_seconds))


def trials_record(rows: list[Trial]) -> list[dict]:
    """The trials as plain data (for a metrics file), the best one flagged `"best": true`."""
    best = best_trial(rows)
    return [{**asdict(t), "best": best is not None and t.setting == best.setting} for t in rows]


def summary_lines(rows: list[Trial]) -> list[str]:
    """The trials as a run summary prints them: a heading, then one line per setting."""
    if not rows:
        return []
    best = best_trial(rows)
    lines = [
        "  trials   one per setting, medians of settled steps; "
        f"★ fastest within budget over {BEST_MIN_SETTLED}+ settled steps"
    ]
    for trial in rows:
        mark = "★" if best is not None and trial.setting == best.setting else " "
        lines.append(f"    {mark} {trial.describe()}")
    return lines


def append_summary(path: str | os.PathLike, summary: dict, rows: list[Trial]) -> None:
    """Append the run's summary to its metrics file: one line `{"summary": {...}}` with
    the trials under "trials" (trials_record). Readers of the steps skip it.

    Raises:
        ValueError: the file cannot be written (MetricsWriter's message).
    """
    writer = MetricsWriter(path)
    try:
        writer.write({"summary": {**summary, "trials": trials_record(rows)}})
    finally:
        writer.close()
