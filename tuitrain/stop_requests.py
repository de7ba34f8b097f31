"""What asks a headless run to stop: Ctrl-C, counted, and a reader of its output that went
away, which a Unix tool would end by (SIGPIPE)."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator

from tuitrain.closed_pipe import WatchedOutput


class StopRequests:
    """Counts Ctrl-C instead of raising KeyboardInterrupt mid-way through a pipe read, and
    notes when the reader of `outputs` goes away, which stops the run as a Ctrl-C does.

    The two may come together (a Ctrl-C sent to a whole `run | tee` pipeline that ends tee
    first): that is one request to stop, and it stops cleanly. Only a Ctrl-C after the
    first stops at once.
    """

    def __init__(self, outputs: tuple[WatchedOutput, ...] = ()) -> None:
        self.count = 0  # Ctrl-C so far
        self.outputs = outputs
        self.reader_gone = False  # seen while the run went on, so it was what stopped it

    def asked_to_stop(self) -> bool:
        """Whether a Ctrl-C came or the output's reader has gone."""
        if not self.reader_gone:
            self.reader_gone = any(output.reader_gone() for output in self.outputs)
        return bool(self.count) or self.reader_gone

    def catching(self) -> contextlib.AbstractContextManager[None]:
        """Count Ctrl-C while inside (the main thread only: elsewhere it cannot be caught)."""
        return sigint_handled(self._on_sigint)

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.count += 1


@contextlib.contextmanager
def sigint_handled(handler: Callable[[int, object], object] | int) -> Iterator[None]:
    """SIGINT goes to `handler` (or signal.SIG_IGN) while inside, then back to what it was.
    Only the main thread may change signal handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
