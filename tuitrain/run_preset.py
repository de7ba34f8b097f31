"""`tuitrain run --headless --save-preset FILE`: where the preset goes, checked before the
run, and the preset written when the run ends, with what its trial measured. And
`tuitrain run --preset FILE` of a tuned preset: tuned on another machine, or, on this one,
steps much slower or faster than the tune measured, is said once."""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from engine.telemetry import StepStats
from tuitrain.errors import (
    EXIT_BAD_INPUT,
    EXIT_CLOSED_PIPE,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_TERMINATED,
    UsageError,
)
from tuitrain.formatting import format_seconds
from tuitrain.run_checks import check_writable
from tuitrain.settings import Settings
from tuitrain.trials import BEST_MIN_SETTLED, Setting, TrialBook

PROG = "tuitrain"


def save_target(args: argparse.Namespace, metrics: str | None = None) -> Path | None:
    """Where --save-preset will write, checked now so a long run is not wasted on it;
    `metrics`: the run's metrics file, which the preset may not be."""
    if args.save_preset is None:
        if args.force:
            raise UsageError("--force lets --save-preset replace a file; without --save-preset "
                             "it has nothing to do")
        return None
    if not args.headless:
        raise UsageError("--save-preset needs --headless; in the app, press s to save a preset")
    path = Path(args.save_preset).expanduser()
    if path.is_dir():
        raise UsageError(f"--save-preset: {path} is a folder")
    if path.exists() and not args.force:
        raise UsageError(f"--save-preset: {path} exists; add --force to replace it")
    if not path.parent.is_dir():
        raise UsageError(f"--save-preset: folder not found: {path.parent}")
    if metrics is not None and path.resolve() == Path(metrics).expanduser().resolve():
        # The metrics file would be there when the run ends, and the preset not saved.
        raise UsageError(f"--save-preset and --metrics name the same file: {path}")
    check_writable("--save-preset", path.parent, folder=True)  # written beside, then renamed
    return path


def save_after_run(
    settings: Settings | None, path: Path, *, status: int, overwrite: bool, nproc: int
) -> None:
    """Save the preset of a finished (or interrupted) run of `nproc` ranks; a failed run
    saves nothing.

    `settings` are those the run used (the worker's Started settings: a policy left unset is
    the one the plan chose), None when it stopped before it started: nothing to save.
    Bad input found by the worker (status 2) was already said in one line, and a run that
    never started has nothing to save, so that case adds no second line.
    """
    from tuitrain.measured import measure_metrics
    from tuitrain.presets import run_command, save_preset

    if status == EXIT_BAD_INPUT:
        return
    if status not in (EXIT_OK, EXIT_INTERRUPTED, EXIT_CLOSED_PIPE, EXIT_TERMINATED):
        print(f"{PROG}: the run failed; preset not saved to {path}", file=sys.stderr)
        return
    if settings is None:
        print(f"{PROG}: the run stopped before it started; preset not saved to {path}",
              file=sys.stderr)
        return
    measured = None
    if settings.logging.metrics is not None:
        measured = measure_metrics(Path(settings.logging.metrics).expanduser())
    command = run_command(str(path), headless=True, nproc=nproc)
    settings = settings.model_copy(
        update={"training": settings.training.model_copy(update={"nproc": nproc})})
    try:
        save_preset(settings, path, command=command, measured=measured, overwrite=overwrite)
    except FileExistsError:
        print(f"{PROG}: {path} appeared during the run; preset not saved", file=sys.stderr)
    except OSError as error:
        print(f"{PROG}: preset not saved to {path}: {error.strerror}", file=sys.stderr)
    else:
        print(f"preset saved to {path}", file=sys.stdout)


# A tuned preset's header (tuitrain.tune_main) names the machine it was tuned on and what
# its best setting measured there.
TUNED_ON = "tuned on machine: "
PACE_TOLERANCE = 0.15  # a settled pace further than this from the preset's is said
_PACE = re.compile(r"^measured[^:]*: (\d+(?:\.\d+)?) (µs|ms|s)/step|^measured[^:]*: "
                   r"(\d+)m(\d\d)s/step")
_UNITS = {"µs": 1e-6, "ms": 1e-3, "s": 1.0}


@dataclass(frozen=True)
class TunedOrigin:
    """Where a tuned preset was tuned, and the step time it measured there."""

    machine: str  # the fingerprint key (engine.planning.calibration.fingerprint)
    step_seconds: float | None


def tuned_origin(path: Path) -> TunedOrigin | None:
    """What a preset's header says of its tune; None for a preset that was not tuned."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    comments = []
    for line in lines:
        if not line.startswith("#"):
            break
        comments.append(line.lstrip("#").strip())
    machine = next((c.removeprefix(TUNED_ON) for c in comments if c.startswith(TUNED_ON)), None)
    if not machine:
        return None
    seconds = None
    for comment in comments:
        if match := _PACE.match(comment):
            number, unit, minutes, rest = match.groups()
            seconds = (float(number) * _UNITS[unit] if number is not None
                       else int(minutes) * 60 + int(rest))
            break
    return TunedOrigin(machine.split()[0], seconds)


class PresetPace:
    """Compares the run's settled pace, under the preset's own setting, with what the tune
    measured: one line once the run has BEST_MIN_SETTLED settled steps, if it is more than
    PACE_TOLERANCE off; then nothing more."""

    def __init__(self, path: str, step_seconds: float) -> None:
        self.path = path
        self.step_seconds = step_seconds
        self.book = TrialBook()
        self.first: Setting | None = None
        self.done = False

    def record(self, stats: StepStats) -> str | None:
        """The line to say after this step, or None."""
        if self.done:
            return None
        self.book.record(stats)
        self.first = self.first or self.book.current
        row = next(t for t in self.book.rows() if t.setting == self.first)
        if row.settled_steps < BEST_MIN_SETTLED or row.step_seconds is None:
            return None
        self.done = True
        off = row.step_seconds / self.step_seconds - 1
        if abs(off) <= PACE_TOLERANCE:
            return None
        return (f"steps take {format_seconds(row.step_seconds)} (median of "
                f"{row.settled_steps} settled steps), {abs(off):.0%} "
                f"{'slower' if off > 0 else 'faster'} than the {format_seconds(self.step_seconds)}"
                f" the preset {self.path} measured on this machine; `tuitrain tune --preset "
                f"{self.path}` tunes it again")


def preset_pace(preset: str | None, *, err: TextIO) -> PresetPace | None:
    """For `tuitrain run --preset`: a preset tuned on another machine is said to be, once,
    on `err`; one tuned here gives the pace to check the run against."""
    if preset is None:
        return None
    from engine.planning.calibration import fingerprint
    from tuitrain.preset_folders import find_preset
    from tuitrain.presets import PresetError

    try:
        path = find_preset(preset)
    except PresetError:
        return None
    origin = tuned_origin(path)
    if origin is None:
        return None
    if origin.machine != fingerprint()[0]:
        print(f"{PROG}: warning: {preset} was tuned on another machine ({origin.machine}); "
              f"`tuitrain tune --preset {preset}` tunes it here", file=err)
        return None
    return None if origin.step_seconds is None else PresetPace(preset, origin.step_seconds)
