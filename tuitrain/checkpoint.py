"""Checkpoints: atomic save, complete-or-nothing load, exact resume.

A checkpoint is a folder `DIR/step-NNNNNN/`:

    model/                 a Hugging Face model folder (config, sharded safetensors, tokenizer):
                           `AutoModelForCausalLM.from_pretrained` loads it as is
    optimizer*.safetensors fp32 master weights, AdamW moments and step counts by name, in
                           the same sharded layout (tuitrain.shard_files): one file, or
                           shards and optimizer.safetensors.index.json
    state.json             engine and training settings, data position, step, loss scale
    rng.safetensors        the random number generator states
    manifest.json          every file above with its size and SHA-256; written last

It is written to a hidden temporary folder beside it, synced, then renamed into place, so a
crash mid-write leaves the previous checkpoint intact and nothing `--resume` would pick.
Loading reads safetensors and JSON only: nothing is unpickled, no code runs.

Neither saving nor loading holds the model or its state whole in memory: saving fills one
shard at a time from the engine's chunks as they come (chunks on disk are read back one at
a time), and loading reads tensor by tensor as each chunk is filled. So a checkpoint of a
model larger than the host budget stays within it, give or take one shard and one chunk.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tuitrain.shard_files import SHARD_BYTES, ShardedTensors, ShardWriter

FORMAT = 1
STEP_DIR = re.compile(r"^step-(\d{6,})$")
MANIFEST = "manifest.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which file and why."""


def step_folder(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Files first, then their folders, deepest first: all on disk before the rename."""
    for path in sorted(folder.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        _fsync(path)
    _fsync(folder)


def save_checkpoint(engine: Any, model: torch.nn.Module, data: Any, settings: Any,
                    step: int, *, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write the checkpoint after `step` under `settings.checkpoint.dir`; returns its folder.

    Weights and optimizer state go in shards of at most `shard_bytes` (a tensor larger than
    that gets one of its own), which bounds the memory saving takes beyond the engine's.
    On any failure (a full disk, say) the temporary folder is removed and the error raised;
    checkpoints already there are untouched, and training can go on.
    """
    root = Path(settings.checkpoint.dir)
    root.mkdir(parents=True, exist_ok=True)
    final = step_folder(root, step)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write(tmp, engine, model, data, settings, step, shard_bytes)
        _fsync_tree(tmp)
        if final.exists():  # saving the same step again: replace it whole
            old = root / f".{final.name}.old-{os.getpid()}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        _fsync(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write(folder: Path, engine: Any, model: torch.nn.Module, data: Any, settings: Any,
           step: int, shard_bytes: int) -> None:
    model_dir = folder / "model"
    _write_model(model_dir, engine, model, shard_bytes)
    tokenizer = getattr(data, "tokenizer", None)
    if tokenizer is not None:
        from engine.data.tokenizer import save_tokenizer

        save_tokenizer(tokenizer, model_dir)
    optimizer = ShardWriter(folder, "optimizer", shard_bytes)
    with contextlib.closing(engine.iter_optimizer_state()) as pairs:
        for name, tensor in pairs:
            optimizer.add(name, tensor)
    optimizer.close()
    save_file(rng_states(), folder / "rng.safetensors")
    record = {"format": FORMAT, "step": step, "engine": engine.state_meta(),
              "settings": settings.model_dump(),
              "data": data.state_dict() if hasattr(data, "state_dict") else None}
    (folder / "state.json").write_text(json.dumps(record, indent=2))
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)}
                for p in files}
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": manifest}, indent=2))


def _write_model(model_dir: Path, engine: Any, model: torch.nn.Module,
                 shard_bytes: int) -> None:
    """What `model.save_pretrained(model_dir, state_dict=engine.model_state_dict())` writes,
    with the weights streamed from the engine into shards rather than gathered first."""
    model_dir.mkdir()
    config = copy.deepcopy(model.config)  # save_pretrained's additions, on a copy
    config.dtype = str(model.dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    config.save_pretrained(model_dir)
    if model.can_generate():
        model.generation_config.save_pretrained(model_dir)
    copies = tied_copies(model)
    shards = ShardWriter(model_dir, "model", shard_bytes)
    with contextlib.closing(engine.iter_model_state()) as pairs:  # a failed write closes it
        for name, tensor in pairs:
            if name not in copies:
                shards.add(name, tensor)
    shards.close()


def tied_copies(model: torch.nn.Module) -> set[str]:
    """Names of tied weights that save_pretrained leaves out (safetensors holds a tensor
    once): of the names one parameter goes by, those the model declares tied
    (`_tied_weights_keys`, a pattern per name) in sorted order, never all of them, so one
    name always stays. from_pretrained ties them again."""
    patterns = []
    for prefix, module in model.named_modules():
        tied = getattr(module, "_tied_weights_keys", None) or ()
        patterns += [f"{prefix}.{key}" if prefix else key for key in tied]
    groups: dict[int, list[str]] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        groups.setdefault(id(value), []).append(name)
    left_out: set[str] = set()
    for names in groups.values():
        if len(names) < 2:
            continue
        matched = [n for n in sorted(names) if any(re.search(p, n) for p in patterns)]
        left_out.update(matched[:len(names) - 1])
    return left_out


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The step folder `path` names, or the newest complete one inside it."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    if (path / MANIFEST).exists() or STEP_DIR.match(path.name):
        return path
    steps = sorted((int(m.group(1)), p) for p in path.iterdir()
                   if p.is_dir() and (m := STEP_DIR.match(p.name)) and (p / MANIFEST).exists())
    if not steps:
        raise CheckpointError(f"no complete checkpoint (step-NNNNNN with {MANIFEST}) in {path}")
    return steps[-1][1]


def verify(folder: Path) -> dict:
    """Check every file against the manifest before anything is loaded; returns state.json."""
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is incomplete: {MANIFEST} is missing") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest_path} is unreadable: {err}") from None
    for name, want in files.items():
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder} is incomplete: {name} is missing")
        if path.stat().st_size != want["bytes"] or _sha256(path) != want["sha256"]:
            raise CheckpointError(f"{path} is corrupt (size or checksum differs from the "
                                  f"manifest)")
    try:
        state = json.loads((folder / "state.json").read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{folder / 'state.json'} is unreadable: {err}") from None
    if state.get("format") != FORMAT:
        raise CheckpointError(f"{folder} has format {state.get('format')!r}; "
                              f"this version reads {FORMAT}")
    return state


def load_checkpoint(engine: Any, model: torch.nn.Module, data: Any, settings: Any) -> int:
    """Restore engine, data position and RNG from `settings.checkpoint.resume`.

    Everything is verified first, so a bad checkpoint is refused whole, never half-loaded.
    Returns the step the checkpoint was saved after; the run continues from the next.
    """
    folder = find_checkpoint(settings.checkpoint.resume)
    state = verify(folder)
    try:
        tensors = ShardedTensors(folder, "optimizer")  # the headers; tensors as chunks ask
        rng = load_file(folder / "rng.safetensors")
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"{folder}: unreadable tensors: {err}") from None
    with tensors:
        engine.load_state_dict({"tensors": tensors, "numels": tensors.numels,
                                "meta": state["engine"]})
    if state.get("data") is not None and hasattr(data, "load_state_dict"):
        data.load_state_dict(state["data"])
    set_rng_states(rng)
    return int(state["step"])


def rng_states() -> dict[str, torch.Tensor]:
    """The random number generators' states: the CPU one and each GPU's."""
    rng = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng.update({f"cuda{i}": s for i, s in enumerate(torch.cuda.get_rng_state_all())})
    return rng


def set_rng_states(rng: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(rng["torch"])
    if torch.cuda.is_available():
        devices = sorted((k for k in rng if k.startswith("cuda")), key=lambda k: int(k[4:]))
        torch.cuda.set_rng_state_all([rng[k] for k in devices])
