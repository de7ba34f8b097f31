"""How the app ends when it is told to from outside: SIGTERM (`kill`, a batch system's time
limit) or SIGHUP (its terminal went away: closed, `tmux kill-session`, a dropped ssh).

Left to their defaults, either signal ends the process where it stands: the terminal stays in
the app's alternate screen with its input raw, the metrics get no summary, and the worker,
left to find its parent gone, keeps its log. Caught here, the signal ends the run as SIGTERM
ends a headless one (tuitrain.headless): the worker is stopped at once, the summary made from
the steps it reported ends the metrics, and the app leaves by Textual's own exit, which gives
the terminal back as it found it. The process then exits 128 + the signal's number. A viewer
attached to a headless run only detaches: that run is not the viewer's to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from tuitrain.client import WorkerClient
from tuitrain.closed_pipe import hung_up, leave_a_hung_up_terminal
from tuitrain.errors import EXIT_HUNG_UP, EXIT_TERMINATED
from tuitrain.events import Failed

# Each signal caught, and the exit status it ends the process with.
EXIT_STATUSES = {signal.SIGTERM: EXIT_TERMINATED, signal.SIGHUP: EXIT_HUNG_UP}


class EndingApp(Protocol):
    """What the ending needs of the app (tuitrain.tui.app.TuitrainApp): its worker and how
    the run stands, and Textual's own ways to run a callback and to exit."""

    worker: WorkerClient | None
    attached: bool
    failure: Failed | None
    failure_at_quit: Failed | None

    @property
    def live(self) -> bool: ...

    @property
    def return_code(self) -> int | None: ...

    def poll_worker(self) -> int: ...

    def call_later(self, callback: Callable[..., Any], *args: Any, **kwargs: Any) -> bool: ...

    def exit(self, result: Any = None, return_code: int = 0, message: Any = None) -> None: ...


class Termination:
    """SIGTERM and SIGHUP while the app runs (between `catch` and `release`): the first of
    them stops the run at once and ends the app; the process then exits `exit_status`.
    SIGCONT, watched meanwhile, never takes up a terminal that has hung up.

    Args:
        app: the app to end.
    """

    def __init__(self, app: EndingApp) -> None:
        self.app = app
        self.signum: int | None = None  # the signal that came, once one has
        self.stopped_run = False  # it stopped a run of the app's own that was still going
        self._loop: asyncio.AbstractEventLoop | None = None  # the app's, while caught
        self._terminal_gone = False  # the signal found the terminal hung up, and let it go
        self._previous: dict[int, Any] = {}  # each signal's handler before `catch`

    @property
    def exit_status(self) -> int | None:
        """The process's exit status once a signal came (143 for SIGTERM, 129 for SIGHUP),
        whatever else the app would have said; None until then."""
        return None if self.signum is None else EXIT_STATUSES[self.signum]

    def catch(self) -> None:
        """Take SIGTERM and SIGHUP until `release`, and watch SIGCONT. Called on the app's
        running event loop, which the ending is handed to. Only the main thread may take
        signals: elsewhere (an app run in another thread) this does nothing."""
        if self._loop is not None or threading.current_thread() is not threading.main_thread():
            return
        self._loop = asyncio.get_running_loop()
        for signum in EXIT_STATUSES:
            self._previous[signum] = signal.signal(signum, self._arrived)
        self._previous[signal.SIGCONT] = signal.signal(signal.SIGCONT, self._continued)

    def release(self) -> None:
        """Give the signals back the handlers they had before `catch`."""
        for signum, previous in self._previous.items():
            signal.signal(signum, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
        self._loop = None

    def _arrived(self, signum: int, frame: object) -> None:
        """A Python handler, run in the main thread between two bytecodes, rather than one
        the event loop runs when it next looks (loop.add_signal_handler): after a hangup,
        every frame Textual draws on the terminal fails, and the sooner the app lets go
        of it the better. The ending itself runs on the loop."""
        if self.signum is not None or self._loop is None:
            return  # the first is being acted on, and the app ends as soon as it can
        self.signum = signum
        self._terminal_gone = leave_a_hung_up_terminal()  # whichever signal it was
        # After the message being handled: a `q` under way finishes its stop first.
        with contextlib.suppress(RuntimeError):  # a loop already closed: the app has ended
            self._loop.call_soon_threadsafe(self.app.call_later, self._end)

    def _continued(self, signum: int, frame: object) -> None:
        """SIGCONT goes on to Textual's handler, which takes the terminal up again after a
        Ctrl-Z, unless the terminal has hung up: the kernel sends SIGCONT with the hangup's
        SIGHUP, and the two may be handled in either order. Taken up again, the terminal
        would end Textual's drawing thread at its first write, and the app's exit would
        wait for that thread for ever."""
        textual = self._previous.get(signal.SIGCONT)
        if self._terminal_gone or any(map(hung_up, (1, 2))) or not callable(textual):
            return
        textual(signum, frame)

    async def _end(self) -> None:
        """Stop the run at once (an attached viewer detaches), let the app take in how it
        ended (the summary that ends its metrics), and leave."""
        app = self.app
        if app.return_code is not None:
            return  # already leaving (`q`): its stop was asked first; the status is ours
        app.failure_at_quit = app.failure
        self.stopped_run = app.live and not app.attached
        if app.worker is not None:
            # An attached viewer only detaches (its client's stop): the run goes on.
            stop = app.worker.stop if app.attached else partial(_stop_at_once, app.worker)
            await asyncio.to_thread(stop)
        if not app.attached:
            app.poll_worker()
        app.exit(return_code=self.exit_status or 0)


def _stop_at_once(worker: WorkerClient) -> None:
    """End the worker at once where it can be (ProcessWorker.stop_now: its summary is made
    from the steps it reported); others (the ranks of a data-parallel run) are asked to
    stop, and ended past their timeout."""
    stop_now = getattr(worker, "stop_now", None)
    if stop_now is not None:
        stop_now()
    else:
        worker.stop()
