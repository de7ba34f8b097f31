"""The `tuitrain` command: run, plan, presets, models.

Everything a user typed is checked before anything heavy starts (no model is built, no
process spawned), and a mistake is one line on stderr with exit status 2, never a traceback.
Heavy modules (torch, transformers, the app) are imported inside the commands that need
them, so `tuitrain --help` answers at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tuitrain import __version__
from tuitrain.closed_pipe import quiet_on_closed_pipe
from tuitrain.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, UsageError

if TYPE_CHECKING:
    from tuitrain.settings import Settings

PROG = "tuitrain"


@dataclass(frozen=True)
class Flag:
    """A flag that sets one settings key. Its value is checked by Settings alone, so a bad
    one is reported the same way whether it came from a flag or a preset."""

    name: str
    key: str  # the dotted settings key it sets
    metavar: str | None  # None: a switch, --name / --no-name
    help: str  # a "(default X)" in it must be the built-in default (a test checks)
    number: bool = False  # read as a number, so a mistake reads `(got 1.5)` as typed

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        if self.metavar is None:
            parser.add_argument(
                self.name, action=argparse.BooleanOptionalAction, default=None, help=self.help
            )
        else:
            parser.add_argument(self.name, metavar=self.metavar, help=self.help)

    def value(self, args: argparse.Namespace) -> object:
        """What the user gave, or None."""
        text = getattr(args, self.name.lstrip("-").replace("-", "_"))
        return _as_number(text) if self.number and text is not None else text


# The flags of `tuitrain run` that set settings. A table: one flag per row reads better than
# the formatter's one field per line.
# fmt: off
RUN: tuple[Flag, ...] = (
    Flag("--steps", "training.steps", "N", "optimizer steps (default 200)", number=True),
    Flag("--policy", "engine.policy", "P",
         "cuda, cpu or auto (default: what the plan recommends for this machine)"),
    Flag("--margin", "engine.margin_ratio", "R",
         "share of the spare device memory that holds optimizer state, 0..1 (default 0)",
         number=True),
    Flag("--device-mem", "engine.device_budget", "SIZE",
         "device budget, e.g. 6GiB (default: the whole GPU; 6GiB when simulated)"),
    Flag("--host-mem", "engine.host_budget", "SIZE",
         "host budget for chunks and optimizer state, e.g. 8GiB; what does not fit goes to "
         "disk (default: what this machine's memory holds beside the rest)"),
    Flag("--disk", "engine.disk_dir", "DIR",
         "folder for training state that does not fit the host budget (default: under the "
         "user cache folder)"),
    Flag("--precision", "engine.precision", "P",
         "fp32, bf16 or fp16 (default: bf16 on GPU, fp32 simulated)"),
    Flag("--collective-timeout", "engine.collective_timeout", "SECONDS",
         "with --nproc or torchrun: how long a rank waits for the others in one collective "
         "before the run fails, naming the rank (default 600)", number=True),
    Flag("--batch-size", "training.batch_size", "N",
         "sequences per micro-batch; a step is --grad-accum of them (default 2)", number=True),
    Flag("--grad-accum", "training.grad_accum", "N",
         "micro-batches per optimizer step, gradients summed: the step trains on N x "
         "--batch-size sequences with one micro-batch's memory (default 1)", number=True),
    Flag("--seq-len", "training.seq_len", "N", "tokens per sequence (default 128)", number=True),
    Flag("--lr", "training.lr", "F", "learning rate (default 0.0003)", number=True),
    Flag("--lr-schedule", "training.lr_schedule", "S",
         "constant, linear or cosine: after the warm-up, keep --lr or decay it to 0 at the "
         "last step (default constant)"),
    Flag("--warmup-steps", "training.warmup_steps", "N",
         "steps of linear warm-up from 0 to --lr (default 0)", number=True),
    Flag("--seed", "training.seed", "N", "seed of the model init and data (default 0)",
         number=True),
    Flag("--checkpointing", "training.activation_checkpointing", None,
         "recompute activations in the backward pass to save memory (default off)"),
    Flag("--data", "data.path", "PATH",
         "text file, folder, JSONL or `datasets` folder (default: a built-in corpus)"),
    Flag("--text-field", "data.text_field", "NAME",
         "the JSONL field or `datasets` column that holds the text (default text)"),
    Flag("--eval-data", "data.eval_path", "PATH",
         "held-out text to evaluate on, in any form --data takes"),
    Flag("--eval-fraction", "data.eval_fraction", "F",
         "hold out this share of the data's documents (over 0, at most 0.5) to evaluate on",
         number=True),
    Flag("--eval-every", "training.eval_every", "N",
         "held-out loss every N steps and after the last (default: after the last only)",
         number=True),
    Flag("--eval-batches", "training.eval_batches", "N",
         "an evaluation scores the same N steps' worth of held-out sequences each time "
         "(default 8)", number=True),
    Flag("--metrics", "logging.metrics", "FILE", "write one JSON line per step here"),
    Flag("--checkpoint-dir", "checkpoint.dir", "DIR", "save checkpoints in this folder"),
    Flag("--checkpoint-every", "checkpoint.every", "N", "save a checkpoint every N steps",
         number=True),
    Flag("--resume", "checkpoint.resume", "DIR", "continue from this checkpoint folder"),
)
# fmt: on
# Those `tuitrain plan` takes too.
PLAN = tuple(
    f
    for f in RUN
    if f.name in ("--margin", "--device-mem", "--precision", "--batch-size", "--grad-accum",
                  "--seq-len", "--checkpointing")
)
RUN_FLAGS: dict[str, str] = {f.name: f.key for f in RUN}  # flag -> the settings key it sets


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
    run.add_argument(
        "--preset", metavar="FILE", help="a preset file, or the name of a saved or shipped preset"
    )
    run.add_argument("--headless", action="store_true", help="train without the app")
    for flag in RUN:
        flag.add_to(run)
    run.add_argument(
        "--save-preset",
        metavar="FILE",
        help="with --headless: save the settings used, and what was measured, when the run ends",
    )
    run.add_argument(
        "--force", action="store_true", help="let --save-preset replace an existing file"
    )
    run.add_argument(
        "--nproc",
        metavar="N",
        help="train data parallel on N ranks of this machine, started here, in the app or "
        "with --headless (under torchrun leave it out: torchrun starts the ranks)",
    )
    run.set_defaults(handler=cmd_run, command_parser=run)

    plan = commands.add_parser(
        "plan",
        help="will it fit? memory per policy",
        description="Forecast device and host memory for each policy, without training.",
    )
    plan.add_argument("model", metavar="MODEL", help="a zoo name or a local model folder")
    for flag in PLAN:
        flag.add_to(plan)
    plan.add_argument(
        "--host-mem",
        metavar="SIZE",
        help="host budget for chunks and optimizer state; what does not fit goes to disk "
        "(default: no budget, checked against this machine's memory)",
    )
    plan.add_argument(
        "--disk", metavar="DIR", help="scratch folder for the disk tier (default: the user cache)"
    )
    plan.add_argument(
        "--nproc",
        metavar="N",
        help="plan one of N data-parallel ranks on this machine (--batch-size is the global "
        "batch; the host's memory is shared by all N)",
    )
    plan.add_argument(
        "--preset", metavar="FILE",
        help="plan the preset's settings (and the hardware it names); flags override it")
    plan.add_argument(
        "--hardware",
        metavar="NAME",
        help="plan for a GPU from published specs instead of this machine's device: "
        "laptop-6gb, laptop-8gb, desktop-12gb, desktop-24gb, a100-40gb, a100-80gb, h100-80gb",
    )
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(handler=cmd_plan, command_parser=plan)

    from tuitrain.tune_main import add_tune_parser

    add_tune_parser(commands, RUN).set_defaults(handler=cmd_tune)

    calibrate = commands.add_parser(
        "calibrate",
        help="this machine's measured speeds, which the plan's time forecast uses",
        description="Show this machine's calibration (measured once, at most 30 s, and cached "
        "per machine), or measure it again.",
    )
    calibrate.add_argument("--refresh", action="store_true", help="measure again now")
    calibrate.add_argument("--json", action="store_true", help="print it as JSON")
    calibrate.set_defaults(handler=cmd_calibrate)

    presets = commands.add_parser(
        "presets",
        help="list the shipped and saved presets, or show one",
        description="List the shipped presets and those saved from the app, or print one with "
        "`presets show NAME`.",
    )
    presets_actions = presets.add_subparsers(dest="action", metavar="ACTION")
    show = presets_actions.add_parser("show", help="print a preset file")
    show.add_argument("name", metavar="NAME", help="a saved or shipped preset name, or a file")
    presets.set_defaults(handler=cmd_presets, command_parser=presets)

    models = commands.add_parser("models", help="list the model zoo")
    models.set_defaults(handler=cmd_models, command_parser=models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line `argv` (default: sys.argv[1:]); returns the exit status.

    Bare `tuitrain` prints the help and exits 0: asking for nothing is asking what there is,
    as `tuitrain --help` does, and `tuitrain | less` reads it.
    """
    from tuitrain.suggestions import closest, unknown_argument

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if not argv:
        return quiet_on_closed_pipe(lambda: parser.print_help() or EXIT_OK)
    commands = parser._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    if not argv[0].startswith("-") and argv[0] not in commands:
        guess = closest(argv[0], commands)
        parser.error(f"unknown command {argv[0]}"
                     + (f" (did you mean {guess}?)" if guess else f" ({', '.join(commands)})"))
    args, extras = parser.parse_known_args(argv)
    if extras:
        args.command_parser.error(unknown_argument(args.command_parser, extras))
    args.argv = argv
    try:
        return quiet_on_closed_pipe(lambda: args.handler(args))
    except UsageError as error:
        print(f"{PROG}: error: {_one_line(str(error))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _one_line(text: str) -> str:
    return " ".join(text.splitlines())


# --- settings from flags -----------------------------------------------------------------


def _as_number(text: str) -> object:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _merge(
    base: Settings, args: argparse.Namespace, flags: tuple[Flag, ...], **more: object
) -> Settings:
    """`base` with what the user gave for `flags` (and `more`, settings keys), or a
    UsageError that names the flag that set a bad value."""
    from tuitrain.presets import merge
    from tuitrain.settings import InvalidSettings

    given = {f.key: value for f in flags if (value := f.value(args)) is not None}
    try:
        return merge(base, given | more)
    except InvalidSettings as error:
        names = {f.key: f.name for f in flags} | {"model": "MODEL"}
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
    more: dict[str, object] = {"model": args.model} if args.model is not None else {}
    # Held-out text comes from one place: a flag that names one replaces the preset's.
    given = {f.key for f in RUN if f.value(args) is not None}
    for key, other in (("data.eval_path", "data.eval_fraction"),
                       ("data.eval_fraction", "data.eval_path")):
        if key in given and other not in given:
            more[other] = None
    return _merge(base, args, RUN, **more)


# --- commands ----------------------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from tuitrain.ranks import from_environment
    from tuitrain.run_preset import save_after_run, save_target

    settings = resolve_settings(args)
    save_to = save_target(args)
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
    from tuitrain.run_checks import check_runnable

    check_runnable(settings)
    if ranks.leader:
        _warn_of_a_short_run(settings)
    if not args.headless:
        from tuitrain.tui.app import run_app

        settings = settings.model_copy(  # what the app saves as a preset runs on as many
            update={"training": settings.training.model_copy(update={"nproc": app_ranks})})
        return run_app(settings, nproc=app_ranks)
    if args.nproc is not None:
        status = _launch_ranks(args, settings)
    else:
        from tuitrain.headless import run_headless

        status = run_headless(settings, out=sys.stdout, err=sys.stderr)
    if save_to is not None and ranks.leader:  # under torchrun, rank 0 saves it once
        nproc = ranks.world if ranks.parallel else _as_number(args.nproc or "1")
        save_after_run(settings, save_to, status=status, overwrite=args.force, nproc=nproc)
    return status


def _warn_of_a_short_run(settings: Settings) -> None:
    """A warm-up longer than the run (a preset's 10 steps under `--steps 3`) is allowed, but
    the rate then never reaches --lr: say so, once, before the run starts."""
    t = settings.training
    if t.warmup_steps > t.steps:
        print(f"{PROG}: warning: the warm-up ({t.warmup_steps} steps) is longer than the run "
              f"({t.steps} steps): the learning rate never reaches --lr {t.lr:g}",
              file=sys.stderr)


def _launch_ranks(args: argparse.Namespace, settings: Settings) -> int:
    """`tuitrain run` on --nproc ranks of this machine (tuitrain.launch); their status."""
    from tuitrain import launch

    after_run = args.argv[args.argv.index("run") + 1:]
    try:
        nproc = launch.check_nproc(_as_number(args.nproc))
        return launch.launch(nproc, launch.rank_arguments(after_run),
                             batch_size=settings.training.batch_size)
    except ValueError as error:
        raise UsageError(str(error)) from None


def _app_ranks(args: argparse.Namespace, settings: Settings) -> int:
    """How many ranks the app's worker trains on: --nproc, checked before any starts."""
    if args.nproc is None:
        return 1
    from tuitrain.launch import check_nproc
    from tuitrain.ranks import Ranks

    try:
        nproc = check_nproc(_as_number(args.nproc))
        Ranks(0, nproc).check_batch(settings.training.batch_size)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return nproc


def cmd_plan(args: argparse.Namespace) -> int:
    """Check what the user gave, then hand it typed to tuitrain.plan.plan_main."""
    from tuitrain.plan import plan_main
    from tuitrain.settings import Size

    settings = _merge(_plan_base(args.preset), args, PLAN, model=args.model)
    try:
        host_budget = Size(args.host_mem).nbytes if args.host_mem is not None else None
    except ValueError as error:
        raise UsageError(f"--host-mem: {error}") from None
    from tuitrain.run_checks import check_model

    if host_budget is None and settings.engine.host_budget is not None:
        host_budget = settings.engine.host_budget.nbytes  # the preset's
    check_model(settings.model, settings.training.seq_len)
    nproc = _plan_ranks(args.nproc, settings.training.batch_size)
    hardware = _hardware(args.hardware or settings.hardware)
    simulated = not _has_cuda() and hardware is None
    if hardware is not None and settings.engine.precision is None:
        settings = _merge(settings, args, (), **{"engine.precision": "bf16"})
    checked = argparse.Namespace(
        model=settings.model,
        device_budget=settings.device_budget_for(simulated),
        host_budget=host_budget,
        precision=settings.precision_for(simulated),
        batch_size=settings.training.batch_size,
        seq_len=settings.training.seq_len,
        checkpointing=settings.training.activation_checkpointing,
        grad_accum=settings.training.grad_accum,
        margin_ratio=settings.engine.margin_ratio,
        disk_dir=args.disk,
        nproc=nproc,
        json=args.json,
        hardware=hardware,
    )
    return plan_main(checked)


def _plan_base(preset: str | None) -> Settings:
    """The settings `tuitrain plan` starts from: the preset's, or the built-in defaults."""
    from tuitrain.presets import PresetError, find_preset, load_preset
    from tuitrain.settings import Settings

    if preset is None:
        return Settings()
    try:
        return load_preset(find_preset(preset))
    except PresetError as error:
        raise UsageError(str(error)) from None


def _hardware(name: str | None) -> object:
    """`--hardware NAME`: the shipped profile, or None without the flag."""
    if name is None:
        return None
    from engine.planning.hardware import hardware_profile

    try:
        return hardware_profile(name)
    except ValueError as error:
        raise UsageError(f"--hardware: {error}") from None


def cmd_tune(args: argparse.Namespace) -> int:
    from tuitrain.tune_main import tune_command

    return tune_command(args, resolve_settings(args), simulated=not _has_cuda())


def cmd_calibrate(args: argparse.Namespace) -> int:
    from tuitrain.calibrate import calibrate_main

    return calibrate_main(refresh=args.refresh, as_json=args.json)


def _plan_ranks(nproc: str | None, batch_size: int) -> int:
    """`tuitrain plan --nproc`: ranks the plan is for (1 without it), checked as `run`
    checks it, the global batch splitting evenly over them."""
    if nproc is None:
        return 1
    from tuitrain.launch import check_nproc
    from tuitrain.ranks import Ranks

    try:
        ranks = check_nproc(_as_number(nproc))
        Ranks(0, ranks).check_batch(batch_size)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return ranks


def _has_cuda() -> bool:
    from engine.devices.device import uses_cuda

    return uses_cuda()


def cmd_presets(args: argparse.Namespace) -> int:
    from tuitrain.presets import PresetError, find_preset, preset_listing

    if args.action == "show":
        try:
            path = find_preset(args.name)
            sys.stdout.write(path.read_text(encoding="utf-8"))
        except PresetError as error:
            raise UsageError(str(error)) from None
        except (OSError, UnicodeDecodeError) as error:
            raise UsageError(f"{args.name}: cannot read: {error}") from None
        return 0
    for line in preset_listing():
        print(line)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from tuitrain.model_list import model_listing

    for line in model_listing():
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
