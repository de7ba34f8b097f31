"""Output into a pipe whose reader went away (`tuitrain plan --json | head`)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

# The status of a command whose reader went away: 128 + SIGPIPE, what a shell reports for a
# tool that SIGPIPE ended.
EXIT_CLOSED_PIPE = 141


def quiet_on_closed_pipe(command: Callable[[], int]) -> int:
    """Run `command`; when whoever reads our output stops (`tuitrain plan --json | head`),
    end quietly as a Unix tool does on SIGPIPE, rather than with a traceback."""
    try:
        status = command()
        sys.stdout.flush()  # a closed pipe shows at the flush, not at the last print
        return status
    except BrokenPipeError:
        # Point stdout at nothing, so that the interpreter's own flush at exit is quiet too.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return EXIT_CLOSED_PIPE
