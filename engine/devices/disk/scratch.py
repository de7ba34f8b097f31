"""The run's scratch folder: private to one engine, and gone when the engine is.

Each engine that spills to disk gets a folder of its own under `disk_dir`, named
`run-<pid>-<token>` (mode 0700; its files 0600). A lock file inside is `flock`ed for the
folder's whole life. The kernel drops that lock when the process ends, however it ends (kill
-9 included), so a folder whose lock can be taken belongs to a dead process: the next engine
that starts under the same `disk_dir` removes it. The pid in the name covers the moment
between creating a folder and locking it, and filesystems without `flock`.

The folder is removed at `remove()` (Engine.close) and, for an engine nobody closed, when it
is collected or at interpreter exit; a process that ends without the interpreter's exit
(os._exit, a signal handler) calls `remove_all` first.

Data-parallel ranks on one machine keep their folders apart under `disk_dir/rank-<rank>`
(`rank_folder`): a folder the engine makes on the user's behalf, so it goes too with the
last scratch folder in it, as the default `disk_dir` under the user's cache folder does
(`remove_if_empty`). A run leaves nothing but what the user asked for: a `disk_dir` the
user named stays, empty.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import secrets
import shutil
import weakref
from pathlib import Path

PREFIX = "run-"
NEW_PREFIX = ".new-"  # a folder being set up; renamed to run-... once locked
LOCK = "lock"
_NAME = re.compile(r"^(?:run-|\.new-)(\d+)-[0-9a-f]{8}$")
_RANK = re.compile(r"^rank-\d+$")
CACHE_ENV = "TUITRAIN_CACHE"  # the same override engine.data's caches honour


def default_disk_dir() -> Path:
    """Where scratch folders go by default: `$TUITRAIN_CACHE/scratch` if set, else the
    user's cache folder (platformdirs: ~/.cache/tuitrain/scratch on Linux)."""
    if override := os.environ.get(CACHE_ENV):
        return Path(override).expanduser() / "scratch"
    import platformdirs

    return Path(platformdirs.user_cache_dir("tuitrain", appauthor=False)) / "scratch"


def rank_folder(disk_dir: Path, rank: int) -> Path:
    """Where data-parallel rank `rank` keeps its scratch folders under `disk_dir`."""
    return Path(disk_dir) / f"rank-{rank}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def _owner_gone(folder: Path, pid: int) -> tuple[bool, int | None]:
    """Whether the folder's process is gone, and a descriptor holding its lock if so (kept
    while the folder is removed, so that two cleaners never race over it)."""
    try:
        fd = os.open(folder / LOCK, os.O_RDWR)
    except FileNotFoundError:
        return not _alive(pid), None  # not locked yet, or never: the pid decides
    except OSError:
        return False, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False, None
    except OSError:  # no flock on this filesystem: the pid decides
        if _alive(pid):
            os.close(fd)
            return False, None
    return True, fd


def remove_stale(parent: Path) -> list[Path]:
    """Remove the scratch folders under `parent` whose process is gone, and those in its
    rank folders (a run on any number of ranks cleans up after one on another), with the
    rank folders they leave empty; returns the scratch folders removed.

    Only entries named as this module names them are looked at: nothing else under
    `parent` is ever touched."""
    removed = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return removed
    for entry in entries:
        if entry.is_symlink() or not entry.is_dir():
            continue
        if _RANK.match(entry.name):
            removed += remove_stale(entry)
            with contextlib.suppress(OSError):  # a live run's folder in it keeps it
                entry.rmdir()
            continue
        m = _NAME.match(entry.name)
        if not m:
            continue
        if entry.name.startswith(NEW_PREFIX):
            # Being set up: its lock may be made and not taken yet, so the pid decides.
            gone, fd = not _alive(int(m.group(1))), None
        else:
            gone, fd = _owner_gone(entry, int(m.group(1)))
        if not gone:
            continue
        try:
            shutil.rmtree(entry, ignore_errors=True)
        finally:
            if fd is not None:
                os.close(fd)
        removed.append(entry)
    return removed


# Every folder of this process not removed yet (their finalizers; a finalizer that has run
# is dead and harmless to call again).
_LIVE: weakref.WeakSet = weakref.WeakSet()


def remove_stale_beside(folder: Path) -> list[Path]:
    """remove_stale where a scratch folder in `folder` would look: among every rank's when
    `folder` is a rank's. Nothing is made: a folder that does not exist has none."""
    return remove_stale(folder.parent if _RANK.match(folder.name) else folder)


def remove_all() -> None:
    """Remove every scratch folder this process still has, whoever holds it: for a process
    about to end without the interpreter's exit (which would run their finalizers)."""
    for folder in list(_LIVE):
        folder.remove()


def remove_if_empty(folder: Path) -> None:
    """Remove `folder` if it is the default scratch folder (default_disk_dir) and empty:
    made on the user's behalf, it goes with the last thing in it. Another run's folder in
    it, or anything else anyone put there, keeps it (rmdir refuses); a run that makes its
    folder there meanwhile makes the parent again (_make_in)."""
    if folder == default_disk_dir():
        with contextlib.suppress(OSError):
            folder.rmdir()


def _remove(path: Path, lock_fd: int, owner: int) -> None:
    if os.getpid() != owner:  # a forked child inherits the finalizer, not the folder
        return
    shutil.rmtree(path, ignore_errors=True)
    os.close(lock_fd)
    parent = path.parent
    if _RANK.match(parent.name):
        # Another run's folder in it, or one being made, keeps it (rmdir refuses).
        with contextlib.suppress(OSError):
            parent.rmdir()
        parent = parent.parent
    remove_if_empty(parent)


# Tries at making a folder in a rank folder that other engines may remove while it is empty.
_MAKE_ATTEMPTS = 20


def _make_in(parent: Path, folder: Path) -> None:
    """os.mkdir(folder) in `parent`, which is made again if it is gone: a rank folder is
    removed by the engine that empties it, or by any start that finds it empty, and can be
    between being made and holding a folder. Once it holds one, it stays."""
    for _ in range(_MAKE_ATTEMPTS - 1):
        parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            os.mkdir(folder, 0o700)
            return
        except FileNotFoundError:
            continue
    parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.mkdir(folder, 0o700)


class ScratchFolder:
    """A new private folder under `parent`, removed by `remove()` or at exit.

    Raises ValueError naming `parent` when it cannot be created or written to.
    """

    def __init__(self, parent: Path | str) -> None:
        self.parent = Path(parent).expanduser()
        try:
            self.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise ValueError(f"scratch folder {self.parent} cannot be created: "
                             f"{e.strerror or e}") from None
        # A rank's folder: the stale ones of every rank, its own included.
        remove_stale_beside(self.parent)
        token = f"{os.getpid()}-{secrets.token_hex(4)}"
        staging = self.parent / f"{NEW_PREFIX}{token}"
        try:
            _make_in(self.parent, staging)
            os.chmod(staging, 0o700)  # whatever the umask
            fd = os.open(staging / LOCK, os.O_CREAT | os.O_RDWR, 0o600)
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)
            raise ValueError(f"scratch folder {self.parent} is not writable: "
                             f"{e.strerror or e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        self.path = self.parent / f"{PREFIX}{token}"
        os.rename(staging, self.path)
        self._finalizer = weakref.finalize(self, _remove, self.path, fd, os.getpid())
        _LIVE.add(self)

    def file(self, name: str) -> Path:
        return self.path / name

    def free_bytes(self) -> int:
        """Bytes free on the filesystem that holds the folder."""
        return shutil.disk_usage(self.path).free

    @property
    def removed(self) -> bool:
        return not self._finalizer.alive

    def remove(self) -> None:
        """Delete the folder and everything in it (harmless twice)."""
        self._finalizer()
