"""Whether a run that names a checkpoint (--resume) continues the run that saved it.

A checkpoint holds a run after one of its steps: weights, optimizer state, the data's
position and the random states. The position counts global batches of one token stream in
an order drawn from the seed, so it means the same only for the same stream, cut and
ordered the same way. What decides that is the saved run's and must be this run's too:

    --data, --text-field   the text and the field it is read from; the tokenizer follows
                           (the model folder's, or the corpus's own BPE). Here only whether
                           it is the built-in corpus or a file: which file is its text, and
                           a copy of it elsewhere, or the project moved, continues the run
    --eval-fraction        the share of that text held out of training
    --seq-len              how the stream is cut into sequences
    --batch-size x --grad-accum
                           the global batch: the sequences a step takes (any split of the
                           same number continues it, as the tuner's changes do mid-run)
    --seed                 the order of the sequences (and the model's first weights)
    --lora-alpha           how much the adapters' weights count; the model and the
                           adapters' rank and targets are checked by the tensors as they load

A difference is refused, before anything is built, in one line that names each one as the
flags that give it. The text itself is checked once the run has read it: its tokens'
count and its tokenizer must be the saved run's (`stream_changed`), so another file, or
one changed since, is refused then.

The rest is the user's to change when going on: the length and the learning rate's course
(--steps, --lr, --lr-schedule, --warmup-steps: the rate follows this run's, and a change
is said once, `schedule_changes`), weight decay and clipping, placement (policy, margin,
budgets, disk, precision, chunk size), the split of the global batch and activation
checkpointing, the number of ranks, evaluation, logging and checkpointing.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from tuitrain.checkpoint_folder import CheckpointError, find_checkpoint, read_state
from tuitrain.errors import UsageError
from tuitrain.settings import Settings

# What a refusal ends with: the two ways on.
_WAYS_ON = "give the same to continue it, or leave out --resume to start a new run"

# An entry of what a run is: its flags as typed, and what they mean (compared).
Entry = tuple[str, object]


def check_resume(settings: Settings) -> int | None:
    """The step after which the run resumes (None: it does not), or a UsageError, one line:
    a checkpoint that cannot be found or read, one saved by another run (`refusal`), or one
    at or past the run's last step. Reads state.json alone: no torch, nothing loaded."""
    if settings.checkpoint.resume is None:
        return None
    folder, state = resumed_state(settings)
    try:
        problem = refusal(folder, state, settings)
        done = int(state.get("step", 0))
    except (TypeError, ValueError, KeyError, AttributeError) as error:
        # A state.json its manifest vouches for that this version cannot read.
        raise UsageError(f"{folder}/state.json does not say which run saved it: "
                         f"{error}") from None
    if problem:
        raise UsageError(problem)
    if done >= settings.training.steps:
        raise UsageError(nothing_left(settings.checkpoint.resume, done, settings.training.steps))
    return done


def resumed_state(settings: Settings) -> tuple[Path, dict]:
    """The checkpoint `settings.checkpoint.resume` names and its state.json (UsageError)."""
    assert settings.checkpoint.resume is not None, "a resumed run"
    try:
        folder = find_checkpoint(Path(settings.checkpoint.resume).expanduser())
        return folder, read_state(folder)
    except CheckpointError as error:
        raise UsageError(str(error)) from None


def nothing_left(resume: str, done: int, last: int) -> str:
    """Why a run whose checkpoint is after its last step is refused."""
    return (f"the checkpoint in {resume} is after step {done}, and the run's last step is "
            f"{last}: nothing left to train (give --steps more than {done})")


def refusal(folder: Path, state: dict, settings: Settings) -> str | None:
    """The line that refuses to resume `folder` (its `state`, state.json) in a run of
    `settings` that is not the saved one; None when it continues it."""
    saved_dump, this_dump = _saved_settings(state), settings.model_dump()
    saved, this = _what_it_is(saved_dump), _what_it_is(this_dump)
    if _lora_rank(saved_dump) != _lora_rank(this_dump):
        # Other adapters altogether: the tensors say so, naming them, as they load.
        saved.pop("--lora-alpha", None)
        this.pop("--lora-alpha", None)
    return _differences(folder, saved, this, then="was saved by a run with",
                        ending=_WAYS_ON)


def schedule_changes(folder: Path, state: dict, settings: Settings) -> str | None:
    """What a resumed run changes of the learning rate's course that the saved run had
    (--lr, --lr-schedule, --warmup-steps; --steps where the rate decays to the last step),
    in one line; None when nothing. Not refused: going on at another rate, or for longer,
    is a choice; but one the user should see, since the run no longer repeats the steps
    the saved run would have made."""
    saved, this = _saved_settings(state)["training"], settings.model_dump()["training"]
    decays = "constant" not in (saved["lr_schedule"], this["lr_schedule"])
    keys = [("--lr", "lr"), ("--lr-schedule", "lr_schedule"), ("--warmup-steps", "warmup_steps")]
    if decays:
        keys.append(("--steps", "steps"))

    def course(training: dict) -> dict[str, Entry]:
        return {flag: (_flag(flag, training[key]), training[key]) for flag, key in keys}

    return _differences(folder, course(saved), course(this), then="was saved by a run with",
                        ending="the learning rate follows this run's from here")


def stream_changed(folder: Path, state: dict, stream: dict, settings: Settings) -> str | None:
    """The line that refuses to resume `folder` when the text this run read under the same
    settings is not what the saved run read: another token count or another tokenizer
    (`stream` and state.json's "stream": {"tokens", "tokenizer"}). None when they agree, or
    when the checkpoint did not record its stream."""
    then = state.get("stream")
    if not isinstance(then, dict) or not then or not stream:
        return None
    tokens = then.get("tokens") == stream.get("tokens")
    tokenizer = then.get("tokenizer") == stream.get("tokenizer")
    if tokens and tokenizer:
        return None
    source = _flag("--data", settings.data.path) if settings.data.path else "the built-in corpus"
    now = f"{stream.get('tokens')} tokens" + ("" if tokenizer else " with another tokenizer")
    return (f"{folder} was saved by a run that read {source} as {then.get('tokens')} tokens, "
            f"and this run reads {now}: the text changed since; give it as it was to continue "
            f"the run, or leave out --resume to start a new one")


# --- what a run is ---------------------------------------------------------------------

def _saved_settings(state: dict) -> dict:
    """The saved run's settings (a model_dump), every key there: one written before a key
    existed had its default."""
    defaults = Settings().model_dump()
    saved = state.get("settings") if isinstance(state.get("settings"), dict) else {}
    return {key: ({**value, **(saved.get(key) or {})} if isinstance(value, dict)
                  else saved.get(key, value))
            for key, value in defaults.items()}


def _what_it_is(dump: dict) -> dict[str, Entry]:
    """The settings of `dump` (a model_dump) that decide what a run is, by name: each as
    the flags that give it, and the value compared (for --data, whether the text is the
    built-in corpus: a file's text is compared once read)."""
    t, d = dump["training"], dump["data"]
    batch = f"--batch-size {t['batch_size']} --grad-accum {t['grad_accum']}"
    what = {
        "--data": (_flag("--data", d["path"]), d["path"] is None),
        "--text-field": (_flag("--text-field", d["text_field"]), d["text_field"]),
        "--eval-fraction": (_flag("--eval-fraction", d["eval_fraction"]), d["eval_fraction"]),
        "--seq-len": (_flag("--seq-len", t["seq_len"]), t["seq_len"]),
        "--batch-size": (batch, t["batch_size"] * t["grad_accum"]),
        "--seed": (_flag("--seed", t["seed"]), t["seed"]),
    }
    if rank := _lora_rank(dump):  # alpha unset is 2 x rank
        alpha = t["lora"].get("alpha") or 2 * rank
        what["--lora-alpha"] = (_flag("--lora-alpha", alpha), float(alpha))
    return what


def _lora_rank(dump: dict) -> int | None:
    lora = dump["training"].get("lora")
    return lora["rank"] if lora else None


def _differences(folder: Path, saved: dict[str, Entry], this: dict[str, Entry], *,
                 then: str, ending: str) -> str | None:
    """`folder` {then} (the saved run's flags); this run has (its own): {ending}. For every
    name both have whose values differ; None when none does."""
    differ = [name for name in saved if name in this and saved[name][1] != this[name][1]]
    if not differ:
        return None
    before, now = [], []
    for name in differ:
        (typed_then, value_then), (typed_now, value_now) = saved[name], this[name]
        if typed_then == typed_now:  # the same words, meant in another folder
            typed_then, typed_now = _flag(name, value_then), _flag(name, value_now)
        before.append(typed_then)
        now.append(typed_now)
    return f"{folder} {then} {' '.join(before)}; this run has {' '.join(now)}: {ending}"


def _flag(flag: str, value: Any) -> str:
    """`flag value` as the user would type it; a value left unset in words."""
    if value is None:
        return f"{flag} (built-in corpus)" if flag == "--data" else f"{flag} (none)"
    if isinstance(value, float):
        return f"{flag} {value:g}"
    return f"{flag} {shlex.quote(str(value))}"
