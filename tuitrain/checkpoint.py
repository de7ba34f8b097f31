"""Checkpoints: atomic save, complete-or-nothing load, exact resume.

A checkpoint is a folder `DIR/step-NNNNNN/`:

    model/                 a Hugging Face model folder (config, sharded safetensors, tokenizer):
                           `AutoModelForCausalLM.from_pretrained` loads it as is; a LoRA run
                           has adapter/ instead, a PEFT adapter folder (tuitrain.adapter_folder)
                           with the run's tokenizer
    optimizer*.safetensors fp32 master weights, AdamW moments and step counts by name, in
                           the same sharded layout (tuitrain.shard_files): one file, or
                           shards and optimizer.safetensors.index.json
    state.json             engine and training settings, data position, step, loss scale;
                           the data's full path and what its text read as (tokens,
                           tokenizer), by which a resumed run is told to be the same one
                           (tuitrain.resume)
    rng.safetensors        the random number generator states
    manifest.json          every file above with its size and SHA-256; written last

It is written to a hidden temporary folder beside it, synced, then renamed into place, so a
crash mid-write leaves the previous checkpoint intact and nothing `--resume` would pick.
Loading reads safetensors and JSON only: nothing is unpickled, no code runs.

Data parallel (every rank calls save_checkpoint and load_checkpoint at the same point),
the optimizer state is written by each rank for its own shard, never gathered:

    optimizer-rank-00000-of-00002.safetensors ...   each rank's pieces (the same sharded
                                                    layout, per rank, when they are large)
    optimizer-ranks.json                            which elements of each tensor each
                                                    rank's file holds (tuitrain.shard_files)

while rank 0 writes the rest (the model folder gathered, as one process writes it). Each
rank syncs and checksums its own files; rank 0 writes the manifest and renames the folder
only once every rank has said it is done (an agreement bounded by the engine's collective
timeout), so a rank that dies mid-write leaves the previous checkpoint as the newest.
Either kind loads at any world size, one process included: each rank reads only the
elements its own shard needs, by slices of the files, and the checksums are shared out
between the ranks, every rank refusing a bad checkpoint alike before anything changes.

Neither saving nor loading holds the model or its state whole in memory: saving fills one
shard at a time from the engine's chunks as they come (chunks on disk are read back one at
a time), and loading reads tensor by tensor as each chunk is filled. So a checkpoint of a
model larger than the host budget stays within it, give or take one shard and one chunk.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tuitrain.adapter_folder import ADAPTER_DIR, is_adapted, write_adapter
from tuitrain.checkpoint_folder import (
    FORMAT,
    MANIFEST,
    CheckpointError,
    find_checkpoint,
    read_state,
    remove_unfinished,
    sha256,
    step_folder,
    usual_modes,
)
from tuitrain.ranks import gather_from_ranks
from tuitrain.resume import refusal, stream_changed
from tuitrain.shard_files import (
    SHARD_BYTES,
    RankFiles,
    ShardedTensors,
    ShardWriter,
    layout_name,
    rank_name,
    write_layout,
)

OPTIMIZER = "optimizer"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Files first, then their folders, deepest first: all on disk before the rename, the
    weights readable as the rest (usual_modes)."""
    usual_modes(folder)
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

    Data parallel (the engine has collectives), every rank calls this at the same point:
    each writes its own shard of the optimizer state, rank 0 the rest (see the module
    docstring); a failure on any rank is an OSError on every rank, naming it.
    """
    if getattr(engine, "collectives", None) is not None:
        return _save_ranks(engine, model, data, settings, step, shard_bytes)
    root = Path(settings.checkpoint.dir).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    remove_unfinished(root)
    final = step_folder(root, step)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        _write(tmp, engine, model, data, settings, step, shard_bytes)
        _fsync_tree(tmp)
        _rename(root, tmp, final)  # saving the same step again replaces it whole
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write(folder: Path, engine: Any, model: torch.nn.Module, data: Any, settings: Any,
           step: int, shard_bytes: int) -> None:
    with contextlib.closing(engine.iter_model_state()) as pairs:  # a failed write closes it
        _write_weights(folder, model, data, pairs, shard_bytes)
    optimizer = ShardWriter(folder, OPTIMIZER, shard_bytes)
    with contextlib.closing(engine.iter_optimizer_state()) as pairs:
        for name, tensor in pairs:
            optimizer.add(name, tensor)
    optimizer.close()
    _write_rest(folder, engine, data, settings, step, {})


def _write_rest(folder: Path, engine: Any, data: Any, settings: Any, step: int,
                written: dict[str, dict], **record: Any) -> None:
    """The random states, state.json (with `record`'s keys too) and, last, the manifest of
    every file: the ones in `written` (name -> bytes and SHA-256, checked by the rank that
    wrote them) as they are, the others hashed here."""
    save_file(rng_states(), folder / "rng.safetensors")
    record = {"format": FORMAT, "step": step, "engine": engine.state_meta(),
              "settings": settings.model_dump(), "model_folder": model_folder(settings.model),
              # The text as this run read it, which a resumed run must read to continue it
              # (tuitrain.resume.stream_changed).
              "stream": data_stream(data),
              "data": data.state_dict() if hasattr(data, "state_dict") else None, **record}
    (folder / "state.json").write_text(json.dumps(record, indent=2))
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest = {name: written.get(name) or _entry(p)
                for p in files if (name := str(p.relative_to(folder)))}
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT, "files": manifest}, indent=2))


def data_stream(data: Any) -> dict:
    """The text as a run read it: its token count and the tokenizer's fingerprint, which
    tell a resumed run whether it reads the same (tuitrain.resume.stream_changed). Empty
    for batches that are no token stream."""
    tokens = getattr(data, "num_tokens", None)
    if tokens is None:
        return {}
    tokenizer = getattr(data, "tokenizer", None)
    if tokenizer is None:
        return {"tokens": tokens}
    from engine.data.tokenizer import tokenizer_fingerprint

    return {"tokens": tokens, "tokenizer": tokenizer_fingerprint(tokenizer)}


def model_folder(model: str) -> str | None:
    """The absolute path of the run's model when it is a local folder, which its settings
    keep as typed (a preset's `./my-llama` runs elsewhere too): what a checkpoint's adapters
    were trained on, wherever the export runs. None for a zoo name."""
    from engine.models.zoo import is_model_folder

    path = Path(model).expanduser()
    return str(path.resolve()) if is_model_folder(path) else None


def _entry(path: Path) -> dict:
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def _write_weights(folder: Path, model: torch.nn.Module, data: Any,
                   pairs: Iterator[tuple[str, torch.Tensor]], shard_bytes: int) -> None:
    """The model folder, or a LoRA run's adapter folder, from the engine's weights."""
    if is_adapted(model):
        write_adapter(folder / ADAPTER_DIR, model, pairs)
        _save_tokenizer(data, folder / ADAPTER_DIR)  # what the merged model reads with
    else:
        write_model_folder(folder / "model", model, data, pairs, shard_bytes)


def write_model_folder(model_dir: Path, model: torch.nn.Module, data: Any,
                       pairs: Iterator[tuple[str, torch.Tensor]], shard_bytes: int) -> None:
    """What `model.save_pretrained(model_dir, state_dict=engine.model_state_dict())` writes,
    with the weights streamed from the engine (`pairs`, iter_model_state) into shards
    rather than gathered first; the tokenizer, if the data has one, beside them."""
    model_dir.mkdir()
    config = copy.deepcopy(model.config)  # save_pretrained's additions, on a copy
    config.dtype = str(model.dtype).removeprefix("torch.")
    config.architectures = [type(model).__name__]
    config.save_pretrained(model_dir)
    if model.can_generate():
        model.generation_config.save_pretrained(model_dir)
    copies = tied_copies(model)
    shards = ShardWriter(model_dir, "model", shard_bytes)
    for name, tensor in pairs:
        if name not in copies:
            shards.add(name, tensor)
    shards.close()
    _save_tokenizer(data, model_dir)


def _save_tokenizer(data: Any, folder: Path) -> None:
    """The tokenizer the run's data was read with, if it has one, into `folder`."""
    tokenizer = getattr(data, "tokenizer", None)
    if tokenizer is not None:
        from engine.data.tokenizer import save_tokenizer

        save_tokenizer(tokenizer, folder)


def _save_ranks(engine: Any, model: torch.nn.Module, data: Any, settings: Any, step: int,
                shard_bytes: int) -> Path:
    """save_checkpoint on every rank of a data-parallel run (see the module docstring)."""
    collectives = engine.collectives
    rank, world = collectives.rank, collectives.world
    root = Path(settings.checkpoint.dir).expanduser()
    final = step_folder(root, step)
    made: OSError | None = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove_unfinished(root)
            tmp = root / f".{final.name}.tmp-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as err:
            made = err
    # Every rank learns the temporary folder's name (rank 0's pid) once it is there.
    pid, failed = collectives.max_ints([os.getpid() if rank == 0 else 0, int(made is not None)])
    if failed:
        raise made or OSError(f"checkpoint after step {step} not written: rank 0 could not "
                              f"create its folder in {root}")
    tmp = root / f".{final.name}.tmp-{pid}"
    try:
        report: dict[str, Any] = {"files": {}, "error": None}
        own: Exception | None = None
        try:
            names = _write_optimizer_shard(tmp, engine, rank, world, shard_bytes)
            report["files"] = {name: _entry(tmp / name) for name in names}
        except Exception as err:  # noqa: BLE001 - reported to every rank below
            own, report["error"] = err, f"rank {rank}: {err}"
        with contextlib.closing(engine.iter_model_state()) as pairs:
            if rank == 0 and own is None:
                try:
                    _write_weights(tmp, model, data, pairs, shard_bytes)
                except Exception as err:  # noqa: BLE001
                    own, report["error"] = err, f"rank 0: {err}"
            for _ in pairs:  # the rest of the weights' gathers, so no rank waits on them
                pass
        # Every rank has written (or failed to write) its part: the barrier before the rename.
        reports = gather_from_ranks(collectives, report)
        errors = [r["error"] for r in reports if r["error"]]
        if own is not None:
            raise own
        if errors:
            raise OSError(f"checkpoint after step {step} not written: {errors[0]}")
        renamed: Exception | None = None
        if rank == 0:
            try:
                written = {name: entry for r in reports for name, entry in r["files"].items()}
                write_layout(tmp, OPTIMIZER, world, engine.optimizer_layout())
                _write_rest(tmp, engine, data, settings, step, written, ranks=world)
                _fsync_tree(tmp)
                _rename(root, tmp, final)
            except Exception as err:  # noqa: BLE001
                renamed = err
        if collectives.max_ints([int(renamed is not None)])[0]:
            raise renamed or OSError(f"checkpoint after step {step} not written: rank 0 "
                                     f"failed to complete it (see its log)")
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _write_optimizer_shard(folder: Path, engine: Any, rank: int, world: int,
                           shard_bytes: int) -> list[str]:
    """This rank's pieces of the optimizer state into its own files, synced; their names."""
    shards = ShardWriter(folder, rank_name(OPTIMIZER, rank, world), shard_bytes)
    with contextlib.closing(engine.iter_optimizer_shard()) as pairs:
        for name, tensor in pairs:
            shards.add(name, tensor)
    names = shards.close()
    for name in names:
        _fsync(folder / name)
    return names


def _rename(root: Path, tmp: Path, final: Path) -> None:
    """`tmp` becomes `final`, replacing a checkpoint of the same step whole."""
    if final.exists():
        old = root / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync(root)


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


def verify(folder: Path, part: tuple[int, int] = (0, 1)) -> dict:
    """Check every file against the manifest before anything is loaded; returns state.json.

    `part` (rank, world): data parallel, each rank checks every file's size and the
    checksums of its share of them (every world-th, in the manifest's order), so that no
    rank reads the whole checkpoint."""
    rank, world = part
    manifest_path = folder / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is incomplete: {MANIFEST} is missing") from None
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{manifest_path} is unreadable: {err}") from None
    for number, (name, want) in enumerate(files.items()):
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{folder} is incomplete: {name} is missing")
        if path.stat().st_size != want["bytes"] or (
                number % world == rank and sha256(path) != want["sha256"]):
            raise CheckpointError(f"{path} is corrupt (size or checksum differs from the "
                                  f"manifest)")
    return read_state(folder)


def load_checkpoint(engine: Any, model: torch.nn.Module, data: Any, settings: Any) -> int:
    """Restore engine, data position and RNG from `settings.checkpoint.resume`.

    Everything is verified first, so a bad checkpoint is refused whole, never half-loaded.
    Returns the step the checkpoint was saved after; the run continues from the next.

    Data parallel, every rank calls this at the same point: the ranks share out the
    checksums and agree before any of them loads (each raises the same CheckpointError),
    then each reads the elements its own shard needs; a checkpoint written by any number of
    ranks loads at any other.
    """
    collectives = getattr(engine, "collectives", None)
    part = (collectives.rank, collectives.world) if collectives is not None else (0, 1)
    opened = contextlib.ExitStack()
    failure: CheckpointError | None = None
    try:
        folder = find_checkpoint(Path(settings.checkpoint.resume).expanduser())
        state = verify(folder, part)
        # Another run's checkpoint is refused before anything of it loads.
        if problem := (refusal(folder, state, settings)
                       or stream_changed(folder, state, data_stream(data), settings)):
            raise CheckpointError(problem)
        tensors = opened.enter_context(_open_optimizer(folder, state))
        try:
            rng = load_file(folder / "rng.safetensors")
        except Exception as err:  # safetensors raises its own error types
            raise CheckpointError(f"{folder}: unreadable tensors: {err}") from None
    except CheckpointError as err:
        failure = err
    if collectives is not None:
        refused = [r for r in gather_from_ranks(collectives, failure and str(failure)) if r]
        if refused and failure is None:
            failure = CheckpointError(refused[0])
    if failure is not None:
        opened.close()
        raise failure
    with opened:
        try:
            engine.load_state_dict({"ranges": tensors, "meta": state["engine"]})
        except ValueError as err:  # a tensor this model lacks, or of another size
            raise CheckpointError(f"{folder} was saved by a run of {_trained(state['settings'])},"
                                  f" not of {_trained(settings.model_dump())}: {err}") from None
    if state.get("data") is not None and hasattr(data, "load_state_dict"):
        data.load_state_dict(state["data"])
    set_rng_states(rng)
    return int(state["step"])


def _trained(settings: dict) -> str:
    """The model a run's settings (a model_dump) train, and its adapters: "tiny with LoRA
    rank 8"."""
    lora = (settings.get("training") or {}).get("lora")
    return settings.get("model", "?") + (f" with LoRA rank {lora['rank']}" if lora else "")


def _open_optimizer(folder: Path, state: dict) -> ShardedTensors | RankFiles:
    """The optimizer state's files, headers read and checked, tensors read by ranges: the
    ranks' pieces (a data-parallel checkpoint) or the sharded tensors of one process."""
    try:
        if not (folder / layout_name(OPTIMIZER)).exists():
            return ShardedTensors(folder, OPTIMIZER)
        files = RankFiles(folder, OPTIMIZER)
    except Exception as err:  # safetensors raises its own error types
        raise CheckpointError(f"{folder}: unreadable tensors: {err}") from None
    if files.world != state.get("ranks"):
        files.close()
        raise CheckpointError(f"{folder}: state.json says {state.get('ranks')} ranks wrote "
                              f"it, {layout_name(OPTIMIZER)} {files.world}")
    return files


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
