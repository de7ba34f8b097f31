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
        self.count = 0  # Ctrl-C so far (2 after SIGTERM: at once)
        self.terminated = False  # SIGTERM came
        self.outputs = outputs
        self.reader_gone = False  # seen while the run went on, so it was what stopped it

    def went(self) -> bool:
        """Whether the output's reader has gone."""
        if not self.reader_gone:
            self.reader_gone = any(output.reader_gone() for output in self.outputs)
        return self.reader_gone

    @contextlib.contextmanager
    def catching(self) -> Iterator[None]:
        """Count Ctrl-C, and take SIGTERM (`kill`, a batch system's time limit, torch's
        launcher passing on a second Ctrl-C) as the second one, while inside (the main
        thread only: elsewhere no signal can be caught). Without it SIGTERM ends the process
        where it stands: no summary, the worker left to find its parent gone."""
        with sigint_handled(self._on_sigint), signal_handled(signal.SIGTERM, self._on_sigterm):
            yield

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.count += 1

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.terminated = True
        self.count = max(self.count, 2)


def sigint_handled(handler: Callable[[int, object], object] | int
                   ) -> contextlib.AbstractContextManager[None]:
    return signal_handled(signal.SIGINT, handler)


@contextlib.contextmanager
def signal_handled(signum: int, handler: Callable[[int, object], object] | int
                   ) -> Iterator[None]:
    """`signum` goes to `handler` (or signal.SIG_IGN) while inside, then back to what it
    was. Only the main thread may change signal handlers: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signum, handler)
    try:
        yield
    finally:
        signal.signal(signum, previous)
