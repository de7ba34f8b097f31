"""The worker process's entry point: the plumbing around a TrainingRun.

This is the child side of `tuitrain.worker.ProcessWorker`. It runs in a `spawn`ed process
with its stdout and stderr (native libraries' included) sent to a log file, so nothing it
prints reaches the terminal that a UI draws on. Events leave through a sending thread, and
a watcher thread ends the process when its parent is gone.

Module-level imports stay light: torch and transformers are imported inside the run, after
SIGINT is ignored, so that a Ctrl-C in the terminal during the seconds of start-up cannot
interrupt the child (only the parent decides when training stops).
"""

from __future__ import annotations

import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from tuitrain.errors import EXIT_ORPHANED
from tuitrain.events import Event, Step
from tuitrain.settings import Settings
from tuitrain.training_run import TrainingRun

INTERRUPT_SIGNAL = signal.SIGUSR1  # cuts the running step short; a Stop comes with it

# The parent sentinel wakes the watcher at once; the parent pid is also checked this often.
PARENT_CHECK_SECONDS = 0.5
# Events wait in memory when the UI reads slower than steps are made (or not at all, as in a
# benchmark). Past this many, further step samples are dropped rather than stalling training;
# every other event is always kept, and the metrics file never loses a step.
EVENT_BACKLOG = 10_000
# At exit the last events (Finished above all) get this long to reach the parent.
FLUSH_SECONDS = 10.0


def worker_main(
    *,
    settings: Settings,
    log_path: str,
    parent_pid: int,
    commands: Connection,
    events: Connection,
    environment: dict[str, str] | None = None,
) -> None:
    """Entry point of the spawned process; never returns, the process exits here.

    Args:
        settings: the run, validated where it entered (pickled as it is, not read again).
        log_path: file that receives the process's stdout and stderr, appended to.
        parent_pid: the process that started this one; when it is gone, training stops.
        commands: read end of the UI -> worker channel.
        events: write end of the worker -> UI channel.
        environment: variables to set first, before torch is imported (a data-parallel
            rank's place and rendezvous, its threads).
    """
    os.environ.update(environment or {})
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run: TrainingRun | None = None

    def interrupt() -> None:
        if run is not None:
            run.interrupt()

    # First, before any thread starts (see _route_interrupts), and before Started.
    _route_interrupts(interrupt)
    _redirect_output(log_path)
    _watch_parent(parent_pid)
    outbox = Outbox(events)
    run = TrainingRun(
        settings=settings,
        log_path=log_path,
        commands=commands,
        outbox=outbox,
    )
    code = run.execute()
    outbox.close(FLUSH_SECONDS)
    _exit(code)


def _exit(code: int) -> None:
    """End the process now, leaving nothing behind (`_leave_nothing`). Skips the rest of
    interpreter teardown: a library thread that never ends cannot keep a finished worker
    alive."""
    _leave_nothing()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _leave_nothing() -> None:
    """Remove the scratch folders this process still has (the run closed its engine; this
    covers one that failed while being built), with the rank folders they were in.

    Nothing else needs the interpreter's exit: the worker makes no multiprocessing object
    that cleans up at exit (no lock, queue or semaphore: its channels are plain pipes),
    so no private hook of multiprocessing's is run here."""
    scratch = sys.modules.get("engine.devices.disk.scratch")
    if scratch is not None:  # not imported: no folder was ever made
        scratch.remove_all()


def _route_interrupts(callback: Callable[[], None]) -> None:
    """Hand the parent's interrupt signal (it follows a Stop, see ProcessWorker.send) to
    `callback` on a listening thread, so a long step ends at its next module.

    A Python signal handler runs only on the main thread between bytecodes: not while the
    main thread waits in a CUDA backward, whose hooks run on autograd's own thread. So the
    signal is blocked here, before any other thread exists (threads inherit the block), and
    a thread of its own takes it with sigwait. The handler is the fallback should a thread
    started earlier by a library take delivery: never the default action, which would end
    the process.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {INTERRUPT_SIGNAL, signal.SIGTERM})
    signal.signal(INTERRUPT_SIGNAL, lambda _signum, _frame: callback())

    def listen() -> None:
        while True:
            if signal.sigwait({INTERRUPT_SIGNAL, signal.SIGTERM}) == signal.SIGTERM:
                _terminated()
            callback()

    threading.Thread(target=listen, name="tuitrain-interrupt", daemon=True).start()


def _terminated() -> None:
    """SIGTERM (a stop that took too long, the launcher ending a rank): what it would do,
    but with nothing left behind first. The same signal, unblocked here, ends the process
    as it would have, so its exit status still says SIGTERM."""
    _leave_nothing()
    sys.stdout.flush()
    sys.stderr.flush()
    # Its disposition is the default (nothing here sets one): unblocked in this thread
    # alone, the signal is this thread's to take, and ends the process.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(60)  # the signal ends the process; nothing after it runs


def _redirect_output(log_path: str) -> None:
    """Point fd 1 and 2 at the log file, so output written by C/C++ code lands there too."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    # Line-buffered, so the log tail sent with a failure is current.
    sys.stdout = open(1, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="replace", buffering=1, closefd=False)


def _watch_parent(parent_pid: int) -> None:
    """Exit when the parent dies, so that no training process is ever left orphaned.

    The multiprocessing parent sentinel becomes readable the moment the parent's end closes;
    the parent-pid check covers a sentinel that is missing.
    """
    import multiprocessing
    from multiprocessing.connection import wait

    parent = multiprocessing.parent_process()
    sentinel = parent.sentinel if parent is not None else None

    def watch() -> None:
        while True:
            if sentinel is not None:
                gone = bool(wait([sentinel], timeout=PARENT_CHECK_SECONDS))
            else:
                time.sleep(PARENT_CHECK_SECONDS)
                gone = False
            if gone or os.getppid() != parent_pid:
                print("the parent process is gone; the worker exits", file=sys.stderr)
                _exit(EXIT_ORPHANED)

    threading.Thread(target=watch, name="tuitrain-parent-watch", daemon=True).start()


class Outbox:
    """Sends events from a thread, so a UI that reads slowly never stalls a training step."""

    _CLOSE = object()

    def __init__(self, connection: Connection) -> None:
        self._connection = connection
        self._queue: queue.Queue[Any] = queue.Queue()
        self._peer_gone = False
        self._thread = threading.Thread(target=self._send_all, name="tuitrain-events", daemon=True)
        self._thread.start()

    def put(self, event: Event) -> None:
        if isinstance(event, Step) and self._queue.qsize() >= EVENT_BACKLOG:
            return
        self._queue.put(event)

    def close(self, timeout: float) -> None:
        """Send what is queued (waiting up to `timeout`), then stop the thread."""
        self._queue.put(self._CLOSE)
        self._thread.join(timeout)

    def _send_all(self) -> None:
        while True:
            event = self._queue.get()
            if event is self._CLOSE:
                return
            if self._peer_gone:
                continue
            try:
                self._connection.send(event)
            except (BrokenPipeError, ConnectionResetError, EOFError):
                self._peer_gone = True
            except Exception:  # an event that does not pickle must not silence the rest
                traceback.print_exc()
