"""The worker's log file: where it is written, and its last lines for a failure report.

Both sides read it: the worker when it reports its own failure, the UI side when the worker
died without a word.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

LOG_TAIL_LINES = 20  # what a failure report carries; the rest is in the file

_LOG_NUMBERS = iter(range(1, 1 << 62))


def default_log_path() -> Path:
    """A fresh log file name under the system's temporary folder."""
    folder = Path(tempfile.gettempdir()) / "tuitrain"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return folder / f"worker-{stamp}-{os.getpid()}-{next(_LOG_NUMBERS)}.log"


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
