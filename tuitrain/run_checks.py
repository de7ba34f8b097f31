"""What `tuitrain run` and `tuitrain plan` check before anything heavy starts: the model,
and the files and folders a run names. Each mistake is a UsageError, one line."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tuitrain.errors import UsageError
from tuitrain.given import Given
from tuitrain.resume import check_resume
from tuitrain.settings import Settings


def check_model(name: str, seq_len: int) -> None:
    """The model exists (zoo name or model folder) and takes sequences of `seq_len` tokens.

    A zoo name, or a name that is neither that nor a path, is checked from the zoo's
    tables: no torch or transformers in this process just for that. A folder's config is
    read by transformers, which checks it whole."""
    from engine.models.names import KNOWN_MODELS, UnknownModel, positions

    if name in KNOWN_MODELS:
        longest = positions(name)
    elif not Path(name).expanduser().exists():
        raise UsageError(str(UnknownModel(name)))
    else:
        from engine.models.folder_weights import weight_files
        from engine.models.zoo import BadCheckpoint, model_config

        try:
            config = model_config(name)
            weight_files(Path(name).expanduser())  # safetensors there, not only pickles
        except BadCheckpoint as error:
            raise UsageError(str(error)) from None
        longest = getattr(config, "max_position_embeddings", None)
    if longest and seq_len > longest:
        raise UsageError(f"seq_len {seq_len} is longer than the {longest} positions of {name}")


def check_lora(settings: Settings, given: Given | None = None) -> None:
    """The LoRA targets name modules of the model (checked on the meta device: nothing is
    allocated); a mistake names them as `given` (the flag, or the preset and its key)."""
    lora = settings.lora()
    if lora is None:
        return
    from engine.models.lora import NoTargets, apply_lora
    from engine.models.zoo import meta_model

    try:
        apply_lora(meta_model(settings.model), lora)
    except NoTargets as error:
        raise UsageError(f"{(given or Given()).name('training.lora.targets')}: {error}") from None


def check_text_field(settings: Settings, given: Given) -> None:
    """A text field the user chose names a field in the text the run reads (--data, or
    --eval-data, which it reads too): a plain text file has none, and a field named for
    it would be ignored without a word."""
    if not given.gave(settings, "data.text_field"):
        return
    from engine.data.formats import WITH_FIELDS, has_fields

    paths = [p for p in (settings.data.path, settings.data.eval_path) if p is not None]
    if any(has_fields(Path(path).expanduser()) for path in paths):
        return
    read = " and ".join(paths) or "the built-in corpus"
    have = "has" if len(paths) < 2 else "have"
    raise UsageError(f"{given.name('data.text_field')}: {read} {have} no fields; a text field "
                     f"names the one that holds the text in {WITH_FIELDS}")


def check_writable(flag: str, path: str | os.PathLike, *, folder: bool = False) -> None:
    """A UsageError naming `flag` unless the run can write `path`: a file, written anew in
    its folder or appended to, or with `folder` a folder, made if missing (in a folder that
    exists: check_parent).

    Checked before the run starts, so that a long run is not wasted on a file it cannot
    write at its end (a preset) or along the way (metrics, checkpoints)."""
    path = Path(path).expanduser()
    here = path if folder or path.exists() else path.parent
    while not here.exists() and here != here.parent:  # made with its parents: where it starts
        here = here.parent
    if folder and not here.is_dir():
        raise UsageError(f"{flag}: {here} is a file, not a folder")
    wanted = os.W_OK | os.X_OK if here.is_dir() else os.W_OK
    if not os.access(here, wanted):
        read_only = os.statvfs(here).f_flag & os.ST_RDONLY
        why = "read-only file system" if read_only else "permission denied"
        raise UsageError(f"{flag}: cannot write in {here} ({why})")


def check_parent(flag: str, path: str | os.PathLike) -> None:
    """A UsageError naming `flag` unless the folder that holds `path` exists. A run makes
    the folder it is given (--checkpoint-dir, --disk) but none above it, as it writes a
    file (--metrics, --save-preset) only in a folder that exists: a mistyped path is
    refused before the run, not made somewhere the user did not mean."""
    parent = Path(path).expanduser().parent
    if not parent.exists():
        raise UsageError(f"{flag}: folder not found: {parent}")


def check_disk(folder: Path) -> None:
    """--disk: a folder the engine can make its scratch in, checked without leaving
    anything behind. One that is missing is not made here (the engine makes it when the
    run puts something on disk); the folder that would hold it must exist (check_parent)."""
    from engine.devices.disk.scratch import ScratchFolder
    from engine.planning.disk import folder_problem

    if not folder.exists():
        if problem := folder_problem(folder):
            raise UsageError(f"--disk: {problem}")
        check_parent("--disk", folder)
        return
    try:  # made and removed at once: the run's own is made when its engine starts
        ScratchFolder(folder).remove()
    except ValueError as error:
        raise UsageError(f"--disk: {error}") from None


def _appendable_metrics(path: Path) -> bool:
    """Whether a run may append to `path`: missing, empty, or a metrics file (JSON lines,
    tuitrain.metrics). Anything else is the user's file, which appended lines would spoil
    (a preset named by mistake would no longer load)."""
    try:
        with path.open("rb") as file:
            first = file.readline(1 << 20).strip()
    except FileNotFoundError:
        return True
    except OSError:
        return True  # not readable: check_writable has said whether it can be written
    if not first:
        return True
    try:
        return isinstance(json.loads(first), dict)
    except ValueError:  # not JSON, or not text at all
        return False


def _check_earlier_checkpoints(folder: Path, resume: str | None) -> None:
    """A UsageError if `folder` holds complete checkpoints of a run this one does not
    continue (`resume` names neither the folder nor a checkpoint in it): the new run's
    checkpoints would replace those of the same steps and sit beside the others, so that
    `--resume` would pick the newest of the two runs', and the earlier run's are the
    user's."""
    if not folder.is_dir() or not any(folder.iterdir()):
        return
    from tuitrain.checkpoint import CheckpointError, find_checkpoint  # torch: only here

    try:
        newest = find_checkpoint(folder)
    except CheckpointError:
        return  # nothing complete in it
    if resume is not None:
        resumed = Path(resume).expanduser().resolve()
        if folder.resolve() in (resumed, resumed.parent):
            return
    raise UsageError(f"--checkpoint-dir: {folder} holds an earlier run's checkpoints (the "
                     f"newest {newest.name}); continue that run with --resume {folder}, or "
                     f"name another folder")


def check_runnable(settings: Settings, given: Given | None = None) -> None:
    """Every check that needs no training: the model, the files and folders named.
    `given`: how the user gave the settings, for what a mistake names (default: each
    settings key by its name)."""
    given = given or Given()
    check_model(settings.model, settings.training.seq_len)
    check_lora(settings, given)
    data = settings.data.path
    if data is not None and not Path(data).expanduser().exists():
        raise UsageError(f"data path not found: {data}")
    held_out = settings.data.eval_path
    if held_out is not None and not Path(held_out).expanduser().exists():
        raise UsageError(f"eval data path not found: {held_out}")
    check_text_field(settings, given)
    metrics = settings.logging.metrics
    if metrics is not None:
        metrics_path = Path(metrics).expanduser()
        if metrics_path.is_dir():
            raise UsageError(f"metrics file is a folder: {metrics}")
        if not metrics_path.parent.is_dir():
            raise UsageError(f"folder for the metrics file not found: {metrics_path.parent}")
        check_writable("--metrics", metrics_path)
        if not _appendable_metrics(metrics_path):
            raise UsageError(f"--metrics: {metrics} is not a metrics file (its first line is "
                             f"no JSON record); runs append to one, so name a new file")
    if settings.engine.disk_dir is not None:
        check_disk(Path(settings.engine.disk_dir).expanduser())
    checkpoint = settings.checkpoint
    if checkpoint.every is not None and checkpoint.dir is None:
        raise UsageError("--checkpoint-every needs --checkpoint-dir")
    if checkpoint.dir is not None and Path(checkpoint.dir).expanduser().is_file():
        raise UsageError(f"checkpoint folder is a file: {checkpoint.dir}")
    if checkpoint.dir is not None:
        check_parent("--checkpoint-dir", checkpoint.dir)
        check_writable("--checkpoint-dir", checkpoint.dir, folder=True)
    if checkpoint.resume is not None and not Path(checkpoint.resume).expanduser().is_dir():
        raise UsageError(f"checkpoint to resume from not found: {checkpoint.resume}")
    if checkpoint.dir is not None:
        _check_earlier_checkpoints(Path(checkpoint.dir).expanduser(), checkpoint.resume)
    check_resume(settings)  # the checkpoint is this run's, with steps left after it
