"""The runs of this user on this machine: a private runtime folder with one small JSON file
per headless run (and, while it lives, its socket), which `tuitrain runs` lists and
`tuitrain attach` looks runs up in.

The folder is $TUITRAIN_RUNTIME_DIR, else $XDG_RUNTIME_DIR/tuitrain, else runs/ in the user
cache folder; it is made mode 0700 and refused when another user owns it or others can
enter it, since whoever can reach a run's socket can steer the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import platformdirs

LIVE = "running"
KEPT_ENDED_RUNS = 50  # the newest ended runs stay listed; older records are removed
ENV_FOLDER = "TUITRAIN_RUNTIME_DIR"
# How much of a metrics file's end is read for the latest step it records: a step line is a
# few KiB for `tiny`, tens of KiB for the largest models (their memory and timeline).
METRICS_TAIL_BYTES = 1024 * 1024
# The start of a step line (`dataclasses.asdict(StepStats)`, "step" its first key) and of a
# run's settings line (tuitrain.metrics); an evaluation's nested "step" follows no newline.
_STEP_LINE = re.compile(rb'\n\{"step": (\d+)')
_SETTINGS_LINE = re.compile(rb'\n\{"settings": ')


class RuntimeFolderError(ValueError):
    """The runtime folder cannot be made private (its owner, its mode, or no room)."""


@dataclass(frozen=True)
class RunRecord:
    id: str  # "<started, compact>-<pid>": unique, and sorts by start
    pid: int
    model: str
    started: float  # time.time()
    socket: str  # the run's Unix socket while it lives; "" once it ended
    # The run's metrics file, absolute (read from any folder); "" when none was asked for.
    metrics: str
    state: str = LIVE  # "running", "finished", "failed", "interrupted", "gone"
    step: int = 0  # the latest step reported (updated now and then while it runs)
    steps: int = 0  # the steps the run was asked for
    ended: float | None = None

    @property
    def live(self) -> bool:
        return self.state == LIVE

    @property
    def metrics_written(self) -> bool:
        """Whether its metrics file is there to be read: a run that failed before it
        wrote one has none, whatever it asked for."""
        return bool(self.metrics) and Path(self.metrics).is_file()


def runtime_folder() -> Path:
    """The private folder, made if missing; RuntimeFolderError when it is not private."""
    if os.environ.get(ENV_FOLDER):
        folder = Path(os.environ[ENV_FOLDER])
    elif os.environ.get("XDG_RUNTIME_DIR"):
        folder = Path(os.environ["XDG_RUNTIME_DIR"]) / "tuitrain"
    else:
        folder = Path(platformdirs.user_cache_dir("tuitrain", appauthor=False)) / "runs"
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = folder.stat()
    except OSError as error:
        raise RuntimeFolderError(f"{folder}: {error.strerror or error}") from None
    if info.st_uid != os.getuid():
        raise RuntimeFolderError(f"{folder} belongs to another user (uid {info.st_uid})")
    if stat.S_IMODE(info.st_mode) & 0o077:
        os.chmod(folder, 0o700)  # ours: made private rather than refused
    return folder


def record_path(folder: Path, run_id: str) -> Path:
    return folder / f"{run_id}.json"


def new_record(*, model: str, metrics: str, steps: int, folder: Path) -> RunRecord:
    """The record of a run starting now in this process; `metrics` as the user gave it,
    kept absolute, since `attach` may be typed in another folder."""
    pid, now = os.getpid(), time.time()
    run_id = f"{time.strftime('%Y%m%d-%H%M%S', time.localtime(now))}-{pid}"
    sock = str(folder / f"{pid}.sock")
    if metrics:
        metrics = os.path.abspath(Path(metrics).expanduser())
    return RunRecord(id=run_id, pid=pid, model=model, started=now, socket=sock,
                     metrics=metrics, steps=steps)


def write_record(folder: Path, record: RunRecord) -> None:
    """Replace the run's file atomically: a reader sees the old record or the new one."""
    path = record_path(folder, record.id)
    partial = path.with_suffix(".json.part")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as file:
        json.dump(asdict(record), file)
    os.replace(partial, path)


def forget_record(folder: Path, run_id: str) -> None:
    """Remove the record of a run the worker refused for a mistake in its input (said in
    one line, exit status 2): it never trained, so it is no more a run to list than one
    the command line refused before it started."""
    with contextlib.suppress(OSError):
        record_path(folder, run_id).unlink()


def list_runs(folder: Path) -> list[RunRecord]:
    """Every run recorded, oldest first. A run said to be live whose process or socket is gone
    (killed) is recorded as "gone" and its socket removed; the oldest ended runs past
    KEPT_ENDED_RUNS are forgotten."""
    records = []
    for path in sorted(folder.glob("*.json")):
        try:
            record = RunRecord(**json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError):
            continue  # half-written by a run killed mid-write, or not ours: not a run
        # A run makes its socket before its record: a live record with no socket is a run
        # whose pid another process has taken since.
        if record.live and not (_alive(record.pid) and Path(record.socket).exists()):
            with contextlib.suppress(OSError):
                os.unlink(record.socket)
            record = replace(record, state="gone", socket="", step=_reached(record))
            with contextlib.suppress(OSError):
                write_record(folder, record)
        elif record.live:  # the run rewrites its record, now and then: not written here
            record = replace(record, step=_reached(record))
        records.append(record)
    records.sort(key=lambda r: r.started)
    ended = [r for r in records if not r.live]
    for old in ended[: max(0, len(ended) - KEPT_ENDED_RUNS)]:
        with contextlib.suppress(OSError):
            record_path(folder, old.id).unlink()
        records.remove(old)
    return records


def find_run(folder: Path, name: str | None) -> RunRecord:
    """The run `name` names (its id, a unique start of it, or its pid), or with no name the
    newest live run. Raises LookupError with what to type instead."""
    records = list_runs(folder)
    if name is None:
        live = [r for r in records if r.live]
        if not live:
            raise LookupError("no live run to attach to (`tuitrain runs` lists the ended ones)")
        return live[-1]
    exact = [r for r in records if r.id == name or str(r.pid) == name]
    found = exact or [r for r in records if r.id.startswith(name)]
    if not found:
        raise LookupError(f"no run {name!r} (`tuitrain runs` lists them)")
    if len({r.id for r in found}) > 1 and not exact:
        raise LookupError(f"{name!r} names {len(found)} runs: " + ", ".join(r.id for r in found))
    return found[-1]


def _reached(record: RunRecord) -> int:
    """The latest step a live or vanished run reached: its record's, or its metrics file's
    when that is further on. A run rewrites its record at most every few seconds, and a run
    killed with kill -9 never again, while its metrics have a line for every step."""
    return max(record.step, _metrics_step(record.metrics, since=record.started))


def _metrics_step(path: str, *, since: float) -> int:
    """The last step of the latest run in the metrics file at `path`, read from its end; 0
    when there is none, or the file was last written before `since` (a run killed before
    its first line, whose file holds an earlier run's)."""
    if not path:
        return 0
    try:
        with open(path, "rb") as file:
            if os.fstat(file.fileno()).st_mtime < since:
                return 0
            start = max(0, file.seek(0, os.SEEK_END) - METRICS_TAIL_BYTES)
            file.seek(start)
            # A line starts after a newline; the file's first line, after none.
            tail = (b"" if start else b"\n") + file.read()
    except OSError:
        return 0
    steps = list(_STEP_LINE.finditer(tail))
    settings = list(_SETTINGS_LINE.finditer(tail))
    if not steps or (settings and settings[-1].start() > steps[-1].start()):
        return 0  # no step yet since the latest run started
    return int(steps[-1].group(1))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user took the number: ours is gone
        return False
    return True
