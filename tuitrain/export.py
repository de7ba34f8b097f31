"""`tuitrain export CHECKPOINT --merge OUT`: a checkpoint as a Hugging Face model folder.

A LoRA run's checkpoint holds its adapters only (tuitrain.adapter_folder): the base is made
again from the run's model and seed on the meta device, and each of its weights is made (or
read from the run's model folder), has its adapters' update added and goes into the
safetensors shards before the next is made (engine.models.merged_weights). The host holds
one shard being filled, at most half the run's host budget (SHARD_BYTES without one), one
weight and its update: never the model. The tokenizer the run read its data with (kept
beside the adapters), or else its model folder's, is copied beside. A checkpoint of a run
that trained every weight already holds the model folder (its tokenizer too), which is
copied.

The folder is written beside OUT under a hidden name and renamed into place once complete;
an OUT that exists is never overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from tuitrain.checkpoint_folder import usual_modes
from tuitrain.errors import EXIT_OK, UsageError

if TYPE_CHECKING:
    import torch


def add_export_parser(commands: argparse._SubParsersAction) -> argparse.ArgumentParser:
    export = commands.add_parser(
        "export",
        help="write a checkpoint's model as a Hugging Face folder (a LoRA run's merged)",
        description="Write the model of a checkpoint as a Hugging Face model folder. A LoRA "
        "run's adapters are merged into the base weights.",
    )
    export.add_argument("checkpoint", metavar="CHECKPOINT",
                        help="a checkpoint folder (step-NNNNNN), or a folder of them (newest)")
    export.add_argument("--merge", metavar="OUT", required=True,
                        help="the model folder to write; must not exist")
    export.set_defaults(handler=cmd_export, command_parser=export)
    return export


def cmd_export(args: argparse.Namespace) -> int:
    from tuitrain.checkpoint import CheckpointError, find_checkpoint, verify

    out = Path(args.merge).expanduser()
    if out.exists():
        raise UsageError(f"--merge: {out} exists; give a folder that does not")
    if not out.parent.is_dir():
        raise UsageError(f"--merge: no folder {out.parent} to write {out.name} in")
    from tuitrain.run_checks import check_writable

    check_writable("--merge", out.parent, folder=True)  # before a merge that takes minutes
    try:
        folder = find_checkpoint(args.checkpoint)
        verify(folder)
    except CheckpointError as error:
        raise UsageError(str(error)) from None
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        if (folder / "model").is_dir():
            shutil.copytree(folder / "model", tmp)
        else:
            merge_adapter(folder, tmp)
        usual_modes(tmp)  # a checkpoint saved before its weights were given them
        tmp.rename(out)
    except OSError as error:  # a folder it may not write in, a full disk
        shutil.rmtree(tmp, ignore_errors=True)
        raise UsageError(f"--merge: cannot write {out}: {error.strerror or error}") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {out}")
    return EXIT_OK


# A model folder's tokenizer, in the files transformers' tokenizers save.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
                   "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json")


def merge_adapter(checkpoint: Path, out: Path) -> None:
    """The base of the run that wrote `checkpoint` with its adapter merged in, written as a
    Hugging Face model folder `out` (made here), a weight at a time."""
    from engine.models.merged_weights import merged_tensors
    from engine.models.zoo import is_model_folder, meta_build
    from tuitrain.adapter_folder import ADAPTER_DIR
    from tuitrain.checkpoint import tied_copies, write_model_folder
    from tuitrain.settings import validate_settings
    from tuitrain.shard_files import SHARD_BYTES

    state = json.loads((checkpoint / "state.json").read_text())
    settings = validate_settings(state["settings"])
    # The model folder the run trained on, as it found it; older checkpoints kept the path
    # as typed, read from here.
    model = state.get("model_folder") or settings.model
    if state.get("model_folder") and not is_model_folder(model):
        raise UsageError(f"{checkpoint}: the model folder its adapters were trained on, "
                         f"{model}, is gone; the merge needs its base weights")
    try:
        built = meta_build(model, seed=settings.training.seed)
    except ValueError as error:  # a folder that is no model (any more), a name not known
        raise UsageError(f"{checkpoint}: its base model {model}: {error}") from None
    base = built.model
    left_out = tied_copies(base)  # by the names it saves under, before peft renames them
    entries = [(name, t) for name, t in base.state_dict(keep_vars=True).items()
               if name not in left_out]
    adapted = read_adapter(base, checkpoint / ADAPTER_DIR)
    budget = settings.engine.host_budget
    shard_bytes = SHARD_BYTES if budget is None else min(SHARD_BYTES, budget.nbytes // 2)
    write_model_folder(out, base, None, merged_tensors(entries, built.weights, adapted),
                       shard_bytes)
    # The tokenizer the run's data was read with (kept beside its adapters), else the
    # model folder's.
    for folder in (checkpoint / ADAPTER_DIR, Path(model).expanduser()):
        found = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
        if found and (folder.name == ADAPTER_DIR or is_model_folder(folder)):
            for name in found:
                shutil.copy2(folder / name, out / name)
            break


def read_adapter(base: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """`base` (on the meta device) wrapped by peft with the adapters of the adapter folder
    `folder`, their weights read from it onto the CPU; the base weights stay on the meta
    device. peft wraps the layers of `base` in place."""
    import torch
    from peft import LoraConfig
    from safetensors import safe_open

    from engine.models.lora import is_lora_parameter, peft_wrapped
    from tuitrain.adapter_folder import ADAPTER_WEIGHTS, peft_name

    config = LoraConfig.from_pretrained(folder)
    if config.use_dora:
        raise UsageError(f"{folder}: DoRA adapters cannot be merged a weight at a time")
    adapted = peft_wrapped(base, config)  # the adapters it draws are replaced below
    with safe_open(folder / ADAPTER_WEIGHTS, framework="pt") as f:
        stored = set(f.keys())
        for name, param in adapted.named_parameters():
            if not is_lora_parameter(name):
                continue
            key = peft_name(name)
            if key not in stored:
                raise UsageError(f"{folder / ADAPTER_WEIGHTS} lacks {key}")
            value = f.get_tensor(key)
            if value.shape != param.shape:
                raise UsageError(f"{folder / ADAPTER_WEIGHTS}: {key} has shape "
                                 f"{tuple(value.shape)}, the model needs {tuple(param.shape)}")
            torch.utils.swap_tensors(
                param, torch.nn.Parameter(value.to(torch.float32), requires_grad=False))
    return adapted
