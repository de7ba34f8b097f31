"""Output into a pipe whose reader went away (`tuitrain plan --json | head`, or a `| tee`
that a Ctrl-C ended before the run it shows)."""

from __future__ import annotations

import contextlib
import os
import select
import sys
from collections.abc import Callable
from typing import TextIO

from tuitrain.errors import EXIT_CLOSED_PIPE


def quiet_on_closed_pipe(command: Callable[[], int]) -> int:
    """Run `command`; when whoever reads our output stops (`tuitrain plan --json | head`),
    end quietly as a Unix tool does on SIGPIPE, rather than with a traceback."""
    try:
        status = command()
        sys.stdout.flush()  # a closed pipe shows at the flush, not at the last print
        return status
    except BrokenPipeError:
        silence(sys.stdout)
        return EXIT_CLOSED_PIPE


def silence(stream: TextIO) -> None:
    """Point `stream`'s descriptor at the null device, so that what is still buffered in it,
    and the interpreter's own flush at exit, go nowhere instead of raising BrokenPipeError
    ("Exception ignored ...") on a pipe nobody reads."""
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):
        return  # not a descriptor (an in-memory stream): nothing can fail at exit
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


class WatchedOutput:
    """`stream` for as long as someone reads it; once its reader has gone, what is written
    goes nowhere and `gone` is True, so a long run is not ended by a traceback mid-way and
    can end as it would have.

    A reader that goes shows when a write fails, or earlier, without a write, in
    `reader_gone` (a pipe with no reader left polls as an error), so that `| head -3`
    ends a run that prints a line only now and then as soon as head has its lines.
    """

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.gone = False

    def write(self, text: str) -> int:
        if not self.gone:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._went()
        return len(text)

    def flush(self) -> None:
        if not self.gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._went()

    def isatty(self) -> bool:
        return not self.gone and bool(getattr(self.stream, "isatty", lambda: False)())

    def fileno(self) -> int:
        return self.stream.fileno()

    def reader_gone(self) -> bool:
        """Whether the reader has gone, looking at the descriptor now if no write said so."""
        if not self.gone and _no_reader(self.stream):
            self._went()
        return self.gone

    def _went(self) -> None:
        self.gone = True
        silence(self.stream)
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()  # what was buffered for the reader goes to the null device


def _no_reader(stream: TextIO) -> bool:
    """Whether `stream` is a pipe whose reading end every reader has closed (poll says
    POLLERR); False for a terminal, a file, or a stream with no descriptor."""
    poller = select.poll()
    try:
        poller.register(stream.fileno(), 0)  # no event asked for: errors are always reported
        return any(revents & select.POLLERR for _, revents in poller.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def hung_up(fd: int) -> bool:
    """Whether `fd` is a terminal that has hung up: every write there fails (EIO), even one
    of no bytes, which a file, a pipe or a terminal still there takes."""
    try:
        os.write(fd, b"")
    except OSError:
        return True
    return False


def leave_a_hung_up_terminal() -> bool:
    """Point standard output and error at the null device where the terminal behind them
    has hung up; returns whether one had. Textual draws on standard error from a thread of
    its own, which a failed write ends; the app's exit would then wait for it for ever. A
    terminal still there (a `kill -HUP` by hand) is kept, and given back as it was."""
    gone = [fd for fd in (1, 2) if hung_up(fd)]
    if gone:
        null = os.open(os.devnull, os.O_WRONLY)
        for fd in gone:
            os.dup2(null, fd)
        os.close(null)
    return bool(gone)
