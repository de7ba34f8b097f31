"""The worker's log file: where it is written, and its last lines for a failure report.

Both sides read it: the worker when it reports its own failure, the UI side when the worker
died without a word.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path

LOG_TAIL_LINES = 20  # what a failure report carries; the rest is in the file

_LOG_NUMBERS = iter(range(1, 1 << 62))
# Set by the launcher of --nproc ranks for them: their logs are named for that launch, so
# that it can remove them once the run ended as a stop or on a mistake in the input, which
# a rank it ended (SIGTERM) cannot tell from another rank's failure.
LAUNCH_ENV = "TUITRAIN_LAUNCH"


def default_log_path() -> Path:
    """A fresh log file name under the system's temporary folder."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return _folder() / f"worker-{stamp}-{os.getpid()}-{next(_LOG_NUMBERS)}.log"


def rank_log_path(rank: int) -> Path:
    """A fresh log file name for rank `rank`'s worker, named for its launch if any."""
    launch = os.environ.get(LAUNCH_ENV)
    default = default_log_path()
    return default.with_name(f"rank{rank}-" + (f"{launch}-" if launch else "") + default.name)


def remove_rank_logs(launch: str) -> None:
    """Remove the logs the ranks of launch `launch` left (rank_log_path)."""
    for path in _folder().glob(f"rank*-{launch}-worker-*.log"):
        with contextlib.suppress(OSError):
            path.unlink()


def _folder() -> Path:
    return Path(tempfile.gettempdir()) / "tuitrain"


def read_log_tail(path: str | os.PathLike, lines: int = LOG_TAIL_LINES) -> list[str]:
    """The last `lines` lines of a log file; empty when it cannot be read."""
    try:
        with open(path, "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - 64 * 1024))
            text = log.read().decode("utf-8", errors="replace")
    except OSError:
        return []
    return text.splitlines()[-lines:]
