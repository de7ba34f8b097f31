"""`tuitrain run --headless --save-preset FILE`: where the preset goes, checked before the
run, and the preset written when the run ends, with what its trial measured."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tuitrain.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, UsageError
from tuitrain.settings import Settings

PROG = "tuitrain"


def save_target(args: argparse.Namespace) -> Path | None:
    """Where --save-preset will write, checked now so a long run is not wasted on it."""
    if args.save_preset is None:
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
    return path


def save_after_run(
    settings: Settings, path: Path, *, status: int, overwrite: bool, nproc: int
) -> None:
    """Save the preset of a finished (or interrupted) run of `nproc` ranks; a failed run
    saves nothing.

    Bad input found by the worker (status 2) was already said in one line, and a run that
    never started has nothing to save, so that case adds no second line.
    """
    from tuitrain.measured import measure_metrics
    from tuitrain.presets import run_command, save_preset

    if status == EXIT_BAD_INPUT:
        return
    if status not in (EXIT_OK, EXIT_INTERRUPTED):
        print(f"{PROG}: the run failed; preset not saved to {path}", file=sys.stderr)
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
