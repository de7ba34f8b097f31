"""`tuitrain export CHECKPOINT --merge OUT`: a checkpoint as a Hugging Face model folder.

A LoRA run's checkpoint holds its adapters only (tuitrain.adapter_folder): the base is built
again from the run's model and seed, the adapters are loaded onto it with peft and merged
into its weights layer by layer, in place, and the merged model is written in safetensors
shards. The host holds the model once (merging adds no copy). A checkpoint of a run that
trained every weight already holds the model folder, which is copied.

The folder is written beside OUT under a hidden name and renamed into place once complete;
an OUT that exists is never overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

from tuitrain.errors import EXIT_OK, UsageError


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
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print(f"wrote {out}")
    return EXIT_OK


def merge_adapter(checkpoint: Path, out: Path) -> None:
    """The base of the run that wrote `checkpoint` with its adapter merged in, written as a
    Hugging Face model folder `out`."""
    from peft import PeftModel

    from engine.models.zoo import build_model
    from tuitrain.adapter_folder import ADAPTER_DIR
    from tuitrain.settings import validate_settings

    state = json.loads((checkpoint / "state.json").read_text())
    settings = validate_settings(state["settings"])
    base = build_model(settings.model, seed=settings.training.seed)
    merged = PeftModel.from_pretrained(base, checkpoint / ADAPTER_DIR).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
