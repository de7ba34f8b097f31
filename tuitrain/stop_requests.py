"""What asks a headless run to stop: Ctrl-C, counted, and a reader of its output that went
away, which a Unix tool would end by (SIGPIPE); and what those requests do to the worker
that trains the run (`Stopping`). The line a run so stopped ends with is
tuitrain.run_summary.interrupted_line."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Protocol

from tuitrain.closed_pipe import WatchedOutput, leave_a_hung_up_terminal
from tuitrain.errors import (
    EXIT_CLOSED_PIPE,
    EXIT_HUNG_UP,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
)
from tuitrain.events import STEP_NOT_KEPT, Command, Log, Stop

# After a first request the worker finishes its current step; past this, it is stopped by
# force.
INTERRUPT_WAIT_SECONDS = 30.0
STOP_SECONDS = 10.0  # once the run has ended, how long the worker gets to exit by itself


class StopRequests:
    """Counts Ctrl-C instead of raising KeyboardInterrupt mid-way through a pipe read, and
    notes when the reader of `outputs` goes away, which stops the run as a Ctrl-C does.

    The two may come together (a Ctrl-C sent to a whole `run | tee` pipeline that ends tee
    first): that is one request to stop, and it stops cleanly. Only a Ctrl-C after the
    first stops at once.
    """

    def __init__(self, outputs: tuple[WatchedOutput, ...] = ()) -> None:
        self.count = 0  # Ctrl-C so far (2 after SIGTERM or SIGHUP: at once)
        self.terminated = False  # SIGTERM came
        self.hung_up = False  # SIGHUP came: the terminal went (closed, a dropped ssh)
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
        where it stands: no summary, the worker left to find its parent gone. SIGHUP (the
        terminal closed, `tmux kill-session`, a dropped ssh) stops at once too, what is
        still said going nowhere once the terminal has gone."""
        with (sigint_handled(self._on_sigint),
              signal_handled(signal.SIGTERM, self._on_sigterm),
              signal_handled(signal.SIGHUP, self._on_sighup)):
            yield

    @property
    def status(self) -> int:
        """The exit status the signals that came give the run: 128 + the signal's number,
        SIGHUP's or SIGTERM's first, else SIGINT's."""
        return (EXIT_HUNG_UP if self.hung_up else EXIT_TERMINATED if self.terminated
                else EXIT_INTERRUPTED)

    def _on_sigint(self, signum: int, frame: object) -> None:
        self.count += 1

    def _on_sigterm(self, signum: int, frame: object) -> None:
        self.terminated = True
        self.count = max(self.count, 2)

    def _on_sighup(self, signum: int, frame: object) -> None:
        self.hung_up = True
        self.count = max(self.count, 2)
        leave_a_hung_up_terminal()


class Stoppable(Protocol):
    """The worker as `Stopping` ends it (tuitrain.worker.ProcessWorker)."""

    def send(self, command: Command) -> int: ...

    def stop(self, timeout: float = ...) -> None: ...

    def stop_now(self, *, keep_log: bool = False) -> None: ...


class Stopping:
    """What the stop requests do to the run that `worker` trains, acted on whenever its
    caller looks at the worker (`look`): the first, a Ctrl-C or the output's reader gone,
    sends it Stop, so that the step under way ends at its next layer, and says so with
    `say`; after a second Ctrl-C or SIGTERM, or once the worker has had
    INTERRUPT_WAIT_SECONDS to stop, it is ended (`end`). `status` is the exit status the
    requests give the run."""

    def __init__(self, requests: StopRequests, worker: Stoppable,
                 say: Callable[[str], object]) -> None:
        self.requests = requests
        self.worker = worker
        self.say = say
        self.asked_at: float | None = None  # when the run was asked to stop
        self.at_once = False  # asked before the worker started: nothing to wait for

    @property
    def asked(self) -> bool:
        """Whether the run has been asked to stop, whatever asked."""
        return self.asked_at is not None or self.requests.count > 0

    def look(self, *, reader_matters: bool = True) -> bool:
        """Act on the requests that came since the last look; True once the worker is to be
        ended (`end`) rather than waited for. `reader_matters`: False once the run's last
        step is in, when a reader that goes stops nothing (the run is ending as it is)."""
        count = self.requests.count  # once: a signal may come between two reads
        if count > 1 or self.at_once:  # SIGTERM too, which must not read as a first Ctrl-C
            return True
        if self.asked_at is None and (count or (reader_matters and self.requests.went())):
            self.asked_at = time.monotonic()
            # A worker still building the model or reading the data has trained nothing
            # and reads no command until it trains: ended at once, it loses nothing.
            if getattr(self.worker, "started", True) is None:
                self.at_once = True
                return True
            self.say(stopping_line(ctrl_c=bool(count)))
            self.worker.send(Stop())
        return (self.asked_at is not None
                and time.monotonic() - self.asked_at > INTERRUPT_WAIT_SECONDS)

    def end(self, *, keep_log: bool = False) -> None:
        """End the worker: at once after a second Ctrl-C or SIGTERM (its summary is made
        from the steps it reported, tuitrain.worker.ProcessWorker.stop_now), else given
        STOP_SECONDS to end by itself (a run that ended, or was stopped cleanly)."""
        if self.requests.count > 1 or self.at_once:
            self.worker.stop_now(keep_log=keep_log)
        else:
            self.worker.stop(timeout=STOP_SECONDS)

    def status(self) -> int | None:
        """The exit status of a run the requests stopped: 143 after SIGTERM, 129 after
        SIGHUP, 130 after Ctrl-C, 141 after the output's reader went; None when nothing
        asked."""
        if self.requests.count:
            return self.requests.status
        return EXIT_CLOSED_PIPE if self.asked_at is not None else None


def repeats_the_stop(event: object) -> bool:
    """Whether `event` is the worker's word that the step a stop cut short was not kept
    (tuitrain.training_run), which the stopping line has said already."""
    return (isinstance(event, Log) and event.level == "warning"
            and event.message.endswith(STEP_NOT_KEPT))


def stopping_line(*, ctrl_c: bool) -> str:
    """What a run says when a Ctrl-C (else the output's reader gone) asks it to stop."""
    why, then = ("", " (Ctrl-C again to stop now)") if ctrl_c else (
        " (nothing reads the output any more)", "")
    return (f"stopping{why}: the step under way ends at its next layer, and nothing of it "
            f"is kept{then}")


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


@contextlib.contextmanager
def sighup_held() -> Iterator[None]:
    """Processes started inside start with SIGHUP held back, a mask they keep through exec:
    a terminal that goes away signals every process of the job, and it is their parent
    that then stops the run (StopRequests, the app's tuitrain.tui.termination), with its
    summary and without the log that a worker the hangup ended would leave. This thread
    holds the signal only while inside, and takes it after, if another thread has not."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
