"""The `tuitrain` command: run, plan, presets, models.

Everything a user typed is checked before anything heavy starts (no model is built, no
process spawned), and a mistake is one line on stderr with exit status 2, never a traceback.
Heavy modules (torch, transformers, the app) are imported inside the commands that need
them, so `tuitrain --help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tuitrain import __version__

if TYPE_CHECKING:
    from tuitrain.settings import Settings

PROG = "tuitrain"
USAGE_ERROR = 2  # the status argparse uses for a bad command line; ours match it
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C

# `run` flags and the settings key each one sets. Values travel as text and are validated
# by Settings, so a bad one is reported the same way whether it came from a flag or a preset.
RUN_FLAGS: dict[str, str] = {
    "--policy": "engine.policy",
    "--margin": "engine.margin_ratio",
    "--device-mem": "engine.device_budget",
    "--precision": "engine.precision",
    "--steps": "training.steps",
    "--batch-size": "training.batch_size",
    "--seq-len": "training.seq_len",
    "--lr": "training.lr",
    "--seed": "training.seed",
    "--checkpointing": "training.activation_checkpointing",
    "--data": "data.path",
    "--metrics": "logging.metrics",
    "--checkpoint-dir": "checkpoint.dir",
    "--checkpoint-every": "checkpoint.every",
    "--resume": "checkpoint.resume",
}
PLAN_FLAGS: dict[str, str] = {
    "--device-mem": "engine.device_budget",
    "--precision": "engine.precision",
    "--batch-size": "training.batch_size",
    "--seq-len": "training.seq_len",
    "--checkpointing": "training.activation_checkpointing",
}


class UsageError(Exception):
    """A mistake in what the user asked for: reported as one line, exit status 2."""


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


# --- the command line --------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train language models bigger than your GPU, and tune the offload live.",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run",
        help="train a model (the app, or --headless)",
        description="Train a model. Flags override the preset, which overrides the built-in "
        "defaults.",
    )
    run.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="a zoo name (see `tuitrain models`) or a local Hugging Face model folder; "
        "optional when the preset names one",
    )
    run.add_argument("--preset", metavar="FILE", help="a preset file or a shipped preset name")
    run.add_argument("--headless", action="store_true", help="train without the app")
    run.add_argument("--steps", metavar="N", help="optimizer steps (default 200)")
    run.add_argument("--policy", metavar="P", help="cuda, cpu or auto (default auto)")
    run.add_argument(
        "--margin",
        metavar="R",
        help="share of the spare device memory that holds optimizer state, 0..1 (default 0)",
    )
    run.add_argument(
        "--device-mem",
        metavar="SIZE",
        help="device budget, e.g. 6GiB (default: the whole GPU; 6GiB when simulated)",
    )
    run.add_argument(
        "--precision", metavar="P", help="fp32, bf16 or fp16 (default: bf16 on GPU, fp32 simulated)"
    )
    run.add_argument("--batch-size", metavar="N", help="sequences per step (default 2)")
    run.add_argument("--seq-len", metavar="N", help="tokens per sequence (default 128)")
    run.add_argument("--lr", metavar="F", help="learning rate (default 0.0003)")
    run.add_argument("--seed", metavar="N", help="seed of the model init and data (default 0)")
    run.add_argument(
        "--checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute activations in the backward pass to save memory (default off)",
    )
    run.add_argument(
        "--data",
        metavar="PATH",
        help="text file, folder, JSONL or `datasets` folder (default: a built-in corpus)",
    )
    run.add_argument("--metrics", metavar="FILE", help="write one JSON line per step here")
    run.add_argument(
        "--save-preset",
        metavar="FILE",
        help="with --headless: save the settings used, and what was measured, when the run ends",
    )
    run.add_argument(
        "--force", action="store_true", help="let --save-preset replace an existing file"
    )
    run.add_argument("--checkpoint-dir", metavar="DIR", help="save checkpoints in this folder")
    run.add_argument("--checkpoint-every", metavar="N", help="save a checkpoint every N steps")
    run.add_argument("--resume", metavar="DIR", help="continue from this checkpoint folder")
    run.set_defaults(handler=cmd_run)

    plan = commands.add_parser(
        "plan",
        help="will it fit? memory per policy",
        description="Forecast device and host memory for each policy, without training.",
    )
    plan.add_argument("model", metavar="MODEL", help="a zoo name or a local model folder")
    plan.add_argument(
        "--device-mem",
        metavar="SIZE",
        help="device memory, e.g. 6GiB (default: the whole GPU; 6GiB when simulated)",
    )
    plan.add_argument("--host-mem", metavar="SIZE", help="host memory (default: this machine's)")
    plan.add_argument(
        "--precision", metavar="P", help="fp32, bf16 or fp16 (default: bf16 on GPU, fp32 simulated)"
    )
    plan.add_argument("--batch-size", metavar="N", help="sequences per step (default 2)")
    plan.add_argument("--seq-len", metavar="N", help="tokens per sequence (default 128)")
    plan.add_argument(
        "--checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="plan with activation checkpointing (default off)",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(handler=cmd_plan)

    presets = commands.add_parser(
        "presets",
        help="list the shipped presets, or show one",
        description="List the shipped presets, or print one with `presets show NAME`.",
    )
    presets_actions = presets.add_subparsers(dest="action", metavar="ACTION")
    show = presets_actions.add_parser("show", help="print a preset file")
    show.add_argument("name", metavar="NAME", help="a shipped preset name or a file")
    presets.set_defaults(handler=cmd_presets)

    models = commands.add_parser("models", help="list the model zoo")
    models.set_defaults(handler=cmd_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except UsageError as error:
        print(f"{PROG}: error: {_one_line(str(error))}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return INTERRUPTED


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())


# --- settings from flags -----------------------------------------------------------------


# Flags whose value is a number: read as one here, so that a mistake reads `(got 1.5)` as
# typed rather than `(got '1.5')`; Settings still decides what is valid.
NUMBER_FLAGS = frozenset(
    {"--margin", "--steps", "--batch-size", "--seq-len", "--lr", "--seed", "--checkpoint-every"}
)


def _as_number(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _overrides(args: argparse.Namespace, flags: dict[str, str]) -> dict[str, object]:
    overrides: dict[str, object] = {}
    for flag, key in flags.items():
        value = getattr(args, _dest(flag))
        if value is not None:
            overrides[key] = _as_number(value) if flag in NUMBER_FLAGS else value
    return overrides


def _merge(base: Settings, overrides: dict[str, object], flags: dict[str, str]) -> Settings:
    """merge() with its error named after the flag that set the bad value."""
    from tuitrain.presets import merge
    from tuitrain.settings import InvalidSettings

    try:
        return merge(base, overrides)
    except InvalidSettings as error:
        names = {key: flag for flag, key in flags.items()} | {"model": "MODEL"}
        raise UsageError(f"{names.get(error.key, error.key)}: {error.problem}") from None


def resolve_settings(args: argparse.Namespace) -> Settings:
    """The settings of `tuitrain run`: built-in defaults < the preset < the flags."""
    from tuitrain.presets import PresetError, find_preset, load_preset
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
    overrides = _overrides(args, RUN_FLAGS)
    if args.model is not None:
        overrides["model"] = args.model
    return _merge(base, overrides, RUN_FLAGS)


def _check_model(name: str, seq_len: int) -> None:
    """The model exists (zoo name or model folder) and takes sequences of `seq_len` tokens."""
    from engine.models.zoo import (
        KNOWN_MODELS,
        BadCheckpoint,
        UnknownModel,
        is_model_folder,
        model_config,
    )

    try:
        config = model_config(name)
    except (UnknownModel, BadCheckpoint) as error:
        raise UsageError(str(error)) from None
    if name not in KNOWN_MODELS and not is_model_folder(name):
        raise UsageError(f"model folder {name} has no weights (*.safetensors)")
    positions = getattr(config, "max_position_embeddings", None)
    if positions and seq_len > positions:
        raise UsageError(f"seq_len {seq_len} is longer than the {positions} positions of {name}")


def check_runnable(settings: Settings) -> None:
    """Every check that needs no training: the model, the files and folders named."""
    _check_model(settings.model, settings.training.seq_len)
    data = settings.data.path
    if data is not None and not Path(data).expanduser().exists():
        raise UsageError(f"data path not found: {data}")
    metrics = settings.logging.metrics
    if metrics is not None:
        metrics_path = Path(metrics).expanduser()
        if metrics_path.is_dir():
            raise UsageError(f"metrics file is a folder: {metrics}")
        if not metrics_path.parent.is_dir():
            raise UsageError(f"folder for the metrics file not found: {metrics_path.parent}")
    checkpoint = settings.checkpoint
    if checkpoint.every is not None and checkpoint.dir is None:
        raise UsageError("--checkpoint-every needs --checkpoint-dir")
    if checkpoint.dir is not None and Path(checkpoint.dir).expanduser().is_file():
        raise UsageError(f"checkpoint folder is a file: {checkpoint.dir}")
    if checkpoint.resume is not None and not Path(checkpoint.resume).expanduser().is_dir():
        raise UsageError(f"checkpoint to resume from not found: {checkpoint.resume}")


def _save_target(args: argparse.Namespace) -> Path | None:
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


# --- commands ----------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    settings = resolve_settings(args)
    save_to = _save_target(args)
    if not args.headless and not (sys.stdin.isatty() and sys.stdout.isatty()):
        raise UsageError("the app needs a terminal (this is not one); add --headless")
    check_runnable(settings)
    if not args.headless:
        from tuitrain.tui.app import run_app

        return run_app(settings)

    from tuitrain.headless import run_headless

    status = run_headless(settings, out=sys.stdout, err=sys.stderr)
    if save_to is not None:
        _save_after_run(settings, save_to, status=status, overwrite=args.force)
    return status


def _save_after_run(settings: Settings, path: Path, *, status: int, overwrite: bool) -> None:
    """Save the preset of a finished (or interrupted) run; a failed run saves nothing.

    Bad input found by the worker (status 2) was already said in one line, and a run that
    never started has nothing to save, so that case adds no second line.
    """
    from tuitrain.presets import save_preset

    if status == USAGE_ERROR:
        return
    if status not in (0, INTERRUPTED):
        print(f"{PROG}: the run failed; preset not saved to {path}", file=sys.stderr)
        return
    measured = None
    if settings.logging.metrics is not None:
        measured = measure_metrics(Path(settings.logging.metrics).expanduser())
    command = f"{PROG} run --preset {shlex.quote(str(path))} --headless"
    try:
        save_preset(settings, path, command=command, measured=measured, overwrite=overwrite)
    except FileExistsError:
        print(f"{PROG}: {path} appeared during the run; preset not saved", file=sys.stderr)
    except OSError as error:
        print(f"{PROG}: preset not saved to {path}: {error.strerror}", file=sys.stderr)
    else:
        print(f"preset saved to {path}", file=sys.stdout)


def measure_metrics(path: Path) -> dict[str, float] | None:
    """What a metrics file says about the latest run in it, for a preset's header.

    The first step is left out of the timings when there are others: it holds the warm-up
    trace and is not what the preset will run at. Returns None when there is no step.
    """
    steps: list[dict] = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "settings" in record:  # a new run starts here; appended files hold several
            steps = []
        elif "step" in record:
            steps.append(record)
    if not steps:
        return None
    timed = steps[1:] or steps
    seconds = sum(s["seconds"] for s in timed)
    return {
        "device_peak": max(s["memory"]["device_peak"] for s in steps),
        "step_seconds": seconds / len(timed),
        "tokens_per_second": sum(s["tokens"] for s in timed) / seconds if seconds else 0.0,
        "step": steps[-1]["step"],
    }


def cmd_plan(args: argparse.Namespace) -> int:
    """Validate, then hand a checked Namespace to tuitrain.plan.plan_main.

    plan_main receives: model (str), device_mem and host_mem (bytes, or None for the real
    device / this machine), precision (str), batch_size and seq_len (int), checkpointing
    (bool), json (bool).
    """
    from engine.config import parse_size
    from tuitrain.settings import Settings

    settings = _merge(Settings(), {"model": args.model, **_overrides(args, PLAN_FLAGS)}, PLAN_FLAGS)
    try:
        host_mem = parse_size(args.host_mem) if args.host_mem is not None else None
    except ValueError as error:
        raise UsageError(f"--host-mem: {error}") from None
    _check_model(settings.model, settings.training.seq_len)
    checked = argparse.Namespace(
        model=settings.model,
        device_mem=parse_size(settings.engine.device_budget)
        if settings.engine.device_budget is not None
        else None,
        host_mem=host_mem,
        precision=settings.precision_for(simulated=not _has_cuda()),
        batch_size=settings.training.batch_size,
        seq_len=settings.training.seq_len,
        checkpointing=settings.training.activation_checkpointing,
        json=args.json,
    )
    from tuitrain.plan import plan_main

    return plan_main(checked)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def cmd_presets(args: argparse.Namespace) -> int:
    from tuitrain.presets import PresetError, find_preset, list_presets

    if args.action == "show":
        try:
            path = find_preset(args.name)
            sys.stdout.write(path.read_text(encoding="utf-8"))
        except PresetError as error:
            raise UsageError(str(error)) from None
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"{args.name}: cannot read: {error}") from None
        return 0
    entries = list_presets()
    width = max((len(name) for name, _ in entries), default=0)
    for name, description in entries:
        print(f"{name:<{width}}  {description}")
    return 0


def short_count(n: int) -> str:
    """A parameter count as people say it: 674K, 125M, 1.3B."""
    if n >= 10**9:
        return f"{n / 10**9:.1f}B"
    if n >= 10**6:
        return f"{n / 10**6:.0f}M"
    return f"{n / 10**3:.0f}K"


def cmd_models(args: argparse.Namespace) -> int:
    from engine.models.zoo import list_models

    rows = [
        (m.name, short_count(m.parameters), f"{m.parameters:,}", str(m.layers), str(m.hidden))
        for m in list_models()
    ]
    header = ("MODEL", "SIZE", "PARAMETERS", "LAYERS", "HIDDEN")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        print("  ".join(cells))
    print("or a local Hugging Face model folder (config.json + *.safetensors)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
