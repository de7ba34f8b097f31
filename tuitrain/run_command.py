"""`tuitrain run`: the settings from the preset and the flags, checked before anything
heavy starts, then the app, the headless runner or the ranks that train them."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from tuitrain.errors import UsageError
from tuitrain.flags import PROG, RUN, as_number, merge_flags
from tuitrain.formatting import plural
from tuitrain.given import Given

if TYPE_CHECKING:
    from tuitrain.events import Started
    from tuitrain.settings import Settings


def resolve_settings(args: argparse.Namespace) -> Settings:
    """The settings of `tuitrain run`: built-in defaults < the preset < the flags."""
    from tuitrain.preset_folders import find_preset
    from tuitrain.presets import PresetError, load_preset
    from tuitrain.settings import Settings

    base = Settings()
    preset_names_model = False
    if args.preset is not None:
        try:
            base = load_preset(find_preset(args.preset))
        except PresetError as error:
            raise UsageError(str(error)) from None
        preset_names_model = "model" in base.model_fields_set
    if args.model is None and not preset_names_model:
        raise UsageError(
            "no model given: name one (e.g. `tuitrain run opt-125m`, see `tuitrain models`) "
            "or use a preset that sets `model:`"
        )
    more: dict[str, object] = {"model": args.model} if args.model is not None else {}
    # Held-out text comes from one place: a flag that names one replaces the preset's.
    given = {f.key for f in RUN if f.value(args) is not None}
    for key, other in (("data.eval_path", "data.eval_fraction"),
                       ("data.eval_fraction", "data.eval_path")):
        if key in given and other not in given:
            more[other] = None
    return merge_flags(base, args, RUN, **more)


def cmd_run(args: argparse.Namespace) -> int:
    from tuitrain.ranks import from_environment
    from tuitrain.run_preset import preset_pace, save_after_run, save_target

    settings = resolve_settings(args)
    save_to = save_target(args, settings.logging.metrics)
    try:
        ranks = from_environment()
    except ValueError as error:
        raise UsageError(str(error)) from None
    if args.nproc is not None and ranks.parallel:
        raise UsageError("--nproc starts the ranks itself; under torchrun leave it out")
    if args.nproc is None and settings.training.nproc > 1 and not ranks.parallel:
        args.nproc = str(settings.training.nproc)  # a preset saved from N ranks runs on N
    app_ranks = 1 if args.headless else _app_ranks(args, settings)
    if not args.headless and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("the app needs a terminal (this is not one); add --headless")
    from tuitrain.launch import checked_by_launcher
    from tuitrain.run_checks import check_runnable

    if not checked_by_launcher():
        check_runnable(settings, Given.of(args, RUN))
    pace = None
    if ranks.leader:
        _warn_of_a_short_run(settings)
        pace = preset_pace(args.preset, err=sys.stderr)
    if not args.headless:
        from tuitrain.tui.run_app import run_app

        settings = settings.model_copy(  # what the app saves as a preset runs on as many
            update={"training": settings.training.model_copy(update={"nproc": app_ranks})})
        return run_app(settings, nproc=app_ranks, pace=pace)
    if args.nproc is not None:
        status, used = _launch_ranks(args, settings, saving=save_to is not None)
    else:
        from tuitrain.headless import run_headless
        from tuitrain.launch import USED_SETTINGS_ENV
        from tuitrain.settings import validate_settings

        # What the worker started with: the policy the plan chose where none was given,
        # the precision and the device budget resolved. None until it has started.
        used = None
        used_file = os.environ.get(USED_SETTINGS_ENV) if ranks.leader else None

        def started(event: Started) -> None:
            nonlocal used
            used = validate_settings(event.settings)
            if used_file:  # rank 0 of `--nproc`: the launching process saves the preset
                Path(used_file).write_text(json.dumps(event.settings), encoding="utf-8")

        status = run_headless(settings, out=sys.stdout, err=sys.stderr, pace=pace,
                              on_started=started)
    if save_to is not None and ranks.leader:  # under torchrun, rank 0 saves it once
        nproc = ranks.world if ranks.parallel else as_number(args.nproc or "1")
        save_after_run(used, save_to, status=status, overwrite=args.force, nproc=nproc)
    return status


def _warn_of_a_short_run(settings: Settings) -> None:
    """A warm-up longer than the run (a preset's 10 steps under `--steps 3`) is allowed, but
    the rate then never reaches --lr: say so, once, before the run starts."""
    t = settings.training
    if t.warmup_steps > t.steps:
        print(f"{PROG}: warning: the warm-up ({plural(t.warmup_steps, 'step')}) is longer "
              f"than the run ({plural(t.steps, 'step')}): the learning rate never reaches "
              f"--lr {t.lr:g}", file=sys.stderr)


def _launch_ranks(
    args: argparse.Namespace, settings: Settings, *, saving: bool
) -> tuple[int, Settings | None]:
    """`tuitrain run` on --nproc ranks of this machine (tuitrain.launch): their status,
    and, when `saving` a preset, the settings rank 0 started with (None if it did not)."""
    from tuitrain import launch
    from tuitrain.settings import validate_settings

    after_run = args.argv[args.argv.index("run") + 1:]
    with tempfile.TemporaryDirectory(prefix="tuitrain-") as folder:
        used_file = Path(folder) / "used.json"
        if saving:
            os.environ[launch.USED_SETTINGS_ENV] = str(used_file)
        try:
            nproc = launch.check_nproc(as_number(args.nproc))
            status = launch.launch(nproc, launch.rank_arguments(after_run),
                                   batch_size=settings.training.batch_size)
        except ValueError as error:
            raise UsageError(str(error)) from None
        finally:
            os.environ.pop(launch.USED_SETTINGS_ENV, None)
        try:
            used = validate_settings(json.loads(used_file.read_text(encoding="utf-8")))
        except (OSError, ValueError):  # a bad file is an InvalidSettings, a ValueError
            used = None
    return status, used


def _app_ranks(args: argparse.Namespace, settings: Settings) -> int:
    """How many ranks the app's worker trains on: --nproc, checked before any starts."""
    if args.nproc is None:
        return 1
    from tuitrain.launch import check_nproc
    from tuitrain.ranks import Ranks

    try:
        nproc = check_nproc(as_number(args.nproc))
        Ranks(0, nproc).check_batch(settings.training.batch_size)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return nproc
