"""The flags of `tuitrain run` and `tuitrain plan` that set settings, and the settings
they make.

A flag's value is checked by Settings alone, so a bad one is reported the same way whether
it came from a flag or a preset; the mistake names the flag the user typed.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tuitrain.errors import UsageError

if TYPE_CHECKING:
    from tuitrain.settings import Settings

PROG = "tuitrain"  # what its messages start with, as argparse's own do


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
            parser.add_argument(self.name, action=_Switch, default=None, help=self.help)
        else:
            parser.add_argument(self.name, metavar=self.metavar, help=self.help)

    def value(self, args: argparse.Namespace) -> object:
        """What the user gave, or None."""
        text = getattr(args, self.name.lstrip("-").replace("-", "_"))
        return as_number(text) if self.number and text is not None else text


class _Switch(argparse.BooleanOptionalAction):
    """--name / --no-name, one help entry, and the two refused together as a mutually
    exclusive pair is (argparse's usage line and message, exit status 2): the last one
    typed does not silently win."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: object, option_string: str | None = None) -> None:
        on = not (option_string or "").startswith("--no-")
        before = getattr(namespace, self.dest, None)
        if before is not None and before != on:
            given = self.option_strings[0 if before else 1]
            parser.error(f"argument {option_string}: not allowed with argument {given}")
        setattr(namespace, self.dest, on)


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
         "fp32, bf16 or fp16 (default: bf16 on a GPU, fp16 on one without bf16; simulated, "
         "bf16 where the CPU has bf16 units, else fp32)"),
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
    Flag("--lora", "training.lora.rank", "RANK",
         "train LoRA adapters of this rank; the base weights stay frozen (default: train "
         "every weight)", number=True),
    Flag("--lora-alpha", "training.lora.alpha", "A",
         "with --lora: the adapters' update is scaled by A / RANK (2 x RANK unless given)",
         number=True),
    Flag("--lora-dropout", "training.lora.dropout", "P",
         "with --lora: dropout on the adapters' input, seeded like the model's (default 0)",
         number=True),
    Flag("--lora-targets", "training.lora.targets", "NAMES",
         "with --lora: all-linear, or module names such as q_proj,v_proj (default "
         "all-linear)"),
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
                  "--seq-len", "--checkpointing", "--lora", "--lora-alpha", "--lora-dropout",
                  "--lora-targets")
)
RUN_FLAGS: dict[str, str] = {f.name: f.key for f in RUN}  # flag -> the settings key it sets


def as_number(text: str) -> object:
    """`text` as an int or a float when it reads as one, else as typed (Settings says why)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def merge_flags(
    base: Settings, args: argparse.Namespace, flags: tuple[Flag, ...], **more: object
) -> Settings:
    """`base` with what the user gave for `flags` (and `more`, settings keys), or a
    UsageError that names the flag that set a bad value."""
    from tuitrain.presets import merge
    from tuitrain.settings import InvalidSettings

    given = {f.key: value for f in flags if (value := f.value(args)) is not None}
    try:
        return merge(base, given | more, typed=given.keys())
    except InvalidSettings as error:
        names = {f.key: f.name for f in flags} | {"model": "MODEL"}
        raise UsageError(f"{names.get(error.key, error.key)}: {error.problem}") from None
