"""The `tuitrain` command: run, plan, presets, models, export.

Everything a user typed is checked before anything heavy starts (no model is built, no
process spawned), and a mistake is one line on stderr with exit status 2, never a traceback.
Heavy modules (torch, transformers, the app) are imported inside the commands that need
them, so `tuitrain --help` answers at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import NoReturn

from tuitrain import __version__
from tuitrain.closed_pipe import quiet_on_closed_pipe
from tuitrain.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_OK, UsageError
from tuitrain.flags import PLAN, PROG, RUN, RUN_FLAGS
from tuitrain.plan_command import cmd_plan
from tuitrain.run_command import cmd_run, resolve_settings

# Each command checks what the user typed in a module of its own (tuitrain.run_command,
# tuitrain.plan_command); these are the names the command line has always offered.
__all__ = ["PROG", "RUN_FLAGS", "build_parser", "main", "resolve_settings"]


class _Parser(argparse.ArgumentParser):
    """argparse's parser with a mistake said in one line: argparse prints the command's usage
    above it (15 lines for `run`), which buries the line that matters; `--help` shows it."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(  # its subcommands' parsers are of its class (argparse's default)
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
    plan.add_argument("model", nargs="?", metavar="MODEL",
                      help="a zoo name or a local model folder; optional when the preset names "
                      "one")
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
    from tuitrain.attach import add_commands  # `attach` and `runs`

    add_commands(commands)
    from tuitrain.export import add_export_parser

    add_export_parser(commands)
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


def cmd_tune(args: argparse.Namespace) -> int:
    from tuitrain.given import Given
    from tuitrain.plan_command import has_cuda
    from tuitrain.tune_main import tune_command

    return tune_command(args, resolve_settings(args), Given.of(args, RUN),
                        simulated=not has_cuda())


def cmd_calibrate(args: argparse.Namespace) -> int:
    from tuitrain.calibrate import calibrate_main

    return calibrate_main(refresh=args.refresh, as_json=args.json)


def cmd_presets(args: argparse.Namespace) -> int:
    from tuitrain.preset_folders import find_preset, preset_listing
    from tuitrain.presets import PresetError

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
