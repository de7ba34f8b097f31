"""Finding a checkpoint folder and reading its state.json, without torch: what the command
line reads before a run starts (tuitrain.resume), and what loading reads first
(tuitrain.checkpoint)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

FORMAT = 1
STEP_DIR = re.compile(r"^step-(\d{6,})$")
MANIFEST = "manifest.json"
STATE = "state.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says which file and why."""


def step_folder(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"step-{step:06d}"


def find_checkpoint(path: str | os.PathLike) -> Path:
    """The step folder `path` names, or the newest complete one inside it."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"no checkpoint at {path}")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint folder")
    if (path / MANIFEST).exists() or STEP_DIR.match(path.name):
        return path
    steps = sorted((int(m.group(1)), p) for p in path.iterdir()
                   if p.is_dir() and (m := STEP_DIR.match(p.name)) and (p / MANIFEST).exists())
    if not steps:
        raise CheckpointError(f"no complete checkpoint (step-NNNNNN with {MANIFEST}) in {path}")
    return steps[-1][1]


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_state(folder: Path) -> dict:
    """The checkpoint's state.json (its step, the settings of the run that saved it...),
    from a complete checkpoint of the format this version reads, checked against the
    manifest: what it says decides whether a run may resume from it. The other files are
    not checked here (tuitrain.checkpoint.verify does, before loading)."""
    manifest = folder / MANIFEST
    if not manifest.exists():
        raise CheckpointError(f"{folder} is incomplete: {MANIFEST} is missing")
    path = folder / STATE
    try:
        want = json.loads(manifest.read_text())["files"][STATE]
        same = path.stat().st_size == want["bytes"] and sha256(path) == want["sha256"]
        state = json.loads(path.read_text())
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{path} is unreadable: {err}") from None
    if not same:
        raise CheckpointError(f"{path} is corrupt (size or checksum differs from the "
                              f"manifest)")
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise CheckpointError(f"{folder} has format {found!r}; this version reads {FORMAT}")
    return state


def remove_unfinished(root: Path) -> None:
    """Remove the temporary folders (`.step-N.tmp-PID`) of writers that are gone: a run
    killed mid-checkpoint (kill -9, the machine's memory killer) leaves its folder, which
    the next checkpoint written here removes. A folder whose PID still runs is kept: it may
    be another run's checkpoint on its way."""
    for folder in root.glob(".step-*.tmp-*"):
        pid = folder.name.rpartition("-")[2]
        if pid.isdigit() and int(pid) != os.getpid() and not _running(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: it runs
        return True
    return True


def newest_after_a_kill(root: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint in `root`, after its writer was ended at once (a
    second Ctrl-C): one it was writing is unfinished, and its temporary folder goes now
    rather than at the next checkpoint written here. None when there is none."""
    root = Path(root).expanduser()
    if root.is_dir():
        remove_unfinished(root)
    try:
        return find_checkpoint(root)
    except CheckpointError:
        return None


def usual_modes(folder: Path) -> None:
    """Give every safetensors file under `folder` the mode any other file written there
    has, the one the umask leaves of 0666. safetensors (0.8) writes through a temporary
    file it makes owner-only and renames into place, whatever the umask: a model folder
    shared with a group, or served by another user, would be readable but for its weights.
    A file this process may not change (another user's rank wrote it) keeps its mode."""
    mode = 0o666 & ~_umask()
    for path in folder.rglob("*.safetensors"):
        with contextlib.suppress(OSError):
            path.chmod(mode)


def _umask() -> int:
    """This process's umask, read where Linux shows it; elsewhere set and put back (which
    another thread creating a file at that moment would see)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o077)
    os.umask(mask)
    return mask
