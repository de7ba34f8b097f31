"""ProcessWorker: the engine in a spawned process, seen from the UI through two pipes.

Commands go down one pipe, events come up the other; nothing else is shared. The UI side
never blocks on the worker: `poll` returns what has arrived, and a worker that died without
a word (kill -9, the out-of-memory killer) is reported as `Failed` by the first `poll` after
its death; one its user ended at once (`stop_now`) as a run stopped. The child side lives in
`tuitrain.worker_main`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from pathlib import Path

from engine.telemetry import StepStats
from tuitrain.errors import EXIT_BAD_INPUT
from tuitrain.events import (
    Command,
    Eval,
    Event,
    Failed,
    Finished,
    Rejected,
    Started,
    Step,
    Stop,
)
from tuitrain.run_summary import StepTally
from tuitrain.settings import Settings
from tuitrain.stop_requests import sighup_held, sigint_handled
from tuitrain.worker_log import default_log_path, read_log_tail
from tuitrain.worker_main import INTERRUPT_SIGNAL, worker_main

HISTORY_LENGTH = 2000  # step samples kept for plots: minutes of a fast run, hours of a slow one
# One poll reads at most this many events, so a UI tick stays short after a long stall; the
# rest wait in the pipe for the next poll.
MAX_EVENTS_PER_POLL = 5000
# After stop() gives up waiting: SIGTERM, then this long before SIGKILL.
TERMINATE_GRACE_SECONDS = 2.0
# How a worker process starts: a fresh interpreter, since CUDA does not survive a fork. The
# tests put a context of their own here, which forks workers from a server that imported
# torch once (tests/tuitrain/forked_workers.py): the same child, without seconds of imports.
CONTEXT: multiprocessing.context.BaseContext = multiprocessing.get_context("spawn")


class ProcessWorker:
    """Trains `settings` in a spawned process; implements `tuitrain.client.WorkerClient`.

    Args:
        settings: the run. The worker reports back the settings it actually used.
        log_path: where the worker's stdout and stderr go (appended). Default: a new file
            under the temporary folder, see `default_log_path`, removed by `stop` when the
            run ended cleanly (finished, stopped when asked to, or at once by `stop_now`)
            or refused bad input, and
            kept when the worker failed or was terminated, since the failure report points
            to it. A log given
            here is the caller's: always kept, unless `own_log`.
        own_log: the log is this worker's to remove after a clean end, as a default one is
            (a data-parallel rank's, named after its rank in the temporary folder).
        history: how many recent StepStats `history` keeps.
        environment: variables set in the worker before it imports anything heavy (a
            data-parallel rank's place in the launch, see tuitrain.rank_worker).

    Besides the events that `poll` returns, the client keeps what a UI draws: `latest`
    (the last step's stats), `history` (recent ones), `started` and `result` (the
    Finished or Failed event, once there is one).
    """

    def __init__(
        self,
        *,
        settings: Settings,
        log_path: str | os.PathLike | None = None,
        history: int = HISTORY_LENGTH,
        environment: dict[str, str] | None = None,
        own_log: bool = False,
    ) -> None:
        self.settings = settings
        self.environment = dict(environment or {})
        self.log_path = Path(log_path) if log_path is not None else default_log_path()
        self._own_log = own_log or log_path is None  # removed after a clean end
        self.latest: StepStats | None = None
        self.history: deque[StepStats] = deque(maxlen=history)
        self.started: Started | None = None
        self.result: Finished | Failed | None = None
        self._process: multiprocessing.process.BaseProcess | None = None
        self._commands: Connection | None = None
        self._events: Connection | None = None
        self._pending: list[Event] = []  # received or made up, not yet returned by poll
        self._next_id = 0
        self._stopped = False
        self._stop_sent = False
        self._forced: str | None = None  # why stop() had to terminate the process
        self._ended_now = False  # stop_now() ended it: its end is a stop, not a failure
        self._keep_log = False  # stop_now(keep_log=True): its log stays whatever the end
        self._tally = StepTally()  # what its steps add up to, for a summary it never sent
        self._started_at = 0.0
        self._lock = threading.Lock()

    # --- WorkerClient --------------------------------------------------------------------

    def start(self) -> None:
        """Spawn the worker; returns at once (the worker reports `Started` when ready)."""
        if self._process is not None:
            raise RuntimeError("this worker was already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path.touch()
        command_reader, command_writer = CONTEXT.Pipe(duplex=False)
        event_reader, event_writer = CONTEXT.Pipe(duplex=False)
        process = CONTEXT.Process(
            target=worker_main,
            name="tuitrain-worker",
            kwargs={
                "settings": self.settings,
                "log_path": str(self.log_path),
                "parent_pid": os.getpid(),
                "commands": command_reader,
                "events": event_writer,
                "environment": self.environment,
            },
            # Daemonic: a parent that exits normally takes its worker with it.
            daemon=True,
        )
        with _sigint_ignored(), sighup_held(), _stderr_with_a_descriptor():
            process.start()
        # Only the child holds these ends now: its death shows up here as end-of-file.
        command_reader.close()
        event_writer.close()
        self._process = process
        self._started_at = time.monotonic()
        self._commands = command_writer
        self._events = event_reader

    def send(self, command: Command) -> int:
        """Queue `command` for the worker; returns the id its Applied or Rejected carries.

        A worker that is no longer running cannot act: the command is answered with a
        Rejected from the next `poll` rather than an exception.
        """
        if self._process is None:
            raise RuntimeError("start the worker before sending commands")
        self._next_id += 1
        command = dataclasses.replace(command, id=self._next_id)
        self._stop_sent = self._stop_sent or isinstance(command, Stop)
        if self.result is not None or self._stopped or self._commands is None:
            self._pending.append(Rejected(command.id, "the worker is not running"))
            return command.id
        try:
            self._commands.send(command)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._pending.append(Rejected(command.id, "the worker is not running"))
            return command.id
        if isinstance(command, Stop) and self.started is not None:
            # Commands are read between steps; the signal ends a long step at its next
            # module (nothing of that step is kept). Only after Started: by then the worker
            # handles the signal instead of dying of it.
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._process.pid, INTERRUPT_SIGNAL)
        return command.id

    def poll(self) -> list[Event]:
        """Every event since the last call; never blocks.

        A worker that exited without reporting how yields a made-up `Failed` with its exit
        code and the end of its log.
        """
        if self._process is None:
            return []
        # Look at the exit first: a worker that had exited by now has written all it ever
        # will, so once the pipe is drained nothing more can come.
        exited = self._process.exitcode is not None
        drained = self._drain()
        events, self._pending = self._pending, []
        if exited and drained and self.result is None:
            events.append(self._stopped_report() if self._ended_now else self._death_report())
        return events

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to stop, wait up to `timeout`, then terminate and kill. Idempotent.

        Events that arrive meanwhile (the final `Finished` above all) are kept for `poll`.
        """
        if self._process is None or self._stopped:
            return
        process = self._process
        if process.exitcode is None and self.result is None and not self._stop_sent:
            self.send(Stop())
        deadline = time.monotonic() + timeout
        while process.exitcode is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            self.wait(min(remaining, 0.1))
            self._drain()
        if process.exitcode is None:
            self._forced = f"the worker did not stop within {timeout:g} s and was terminated"
        self._end(process)

    def stop_now(self, *, keep_log: bool = False) -> None:
        """End the worker at once, as its user asked (a second Ctrl-C): neither the step
        under way nor a checkpoint being written is waited for, and neither is kept.
        Idempotent.

        Asked for, that end is no failure: unless the worker reported how it ended first,
        the next `poll` reports a run stopped, a `Finished` whose summary is made from the
        steps it reported (tuitrain.run_summary.StepTally), and its log goes as after any
        clean end, unless `keep_log`.
        """
        if self._process is None or self._stopped:
            return
        self._keep_log = keep_log
        # One that had already exited otherwise died by itself (the out-of-memory killer):
        # reported so. One that ended by SIGTERM was told so with the rest of its job (a
        # batch system, a `kill` of the process group): ended as asked too.
        self._ended_now = self._process.exitcode in (None, -signal.SIGTERM)
        self._end(self._process)

    def _end(self, process: multiprocessing.process.BaseProcess) -> None:
        """Terminate `process` if it still runs (SIGTERM, which the worker takes to leave
        nothing behind; SIGKILL after TERMINATE_GRACE_SECONDS) and reap it; then read what
        it sent, close the channels, and remove a log nobody needs."""
        if process.exitcode is None:
            process.terminate()
            process.join(TERMINATE_GRACE_SECONDS)
            if process.exitcode is None:
                process.kill()
        process.join()
        self._drain()
        self._stopped = True
        self._close_channels()
        if self._own_log and self._log_unneeded() and not self._keep_log:
            with contextlib.suppress(OSError):
                self.log_path.unlink()

    @property
    def alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def terminate(self, why: str) -> None:
        """End the process now (SIGTERM), without waiting: `stop` reaps it later. `why` is
        what its death report says."""
        if self._process is not None and self._process.exitcode is None:
            self._forced = why
            with contextlib.suppress(ProcessLookupError):
                self._process.terminate()

    # --- beyond the protocol -------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def exitcode(self) -> int | None:
        return self._process.exitcode if self._process is not None else None

    def wait(self, timeout: float) -> bool:
        """Block up to `timeout` seconds until an event is ready or the worker exits.

        For callers with nothing else to do (the headless runner); a UI uses `poll` alone.
        """
        if self._process is None:
            return False
        handles: list = [self._process.sentinel]
        if self._events is not None:
            handles.append(self._events)
        return bool(wait(handles, timeout))

    def __enter__(self) -> ProcessWorker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- internals -----------------------------------------------------------------------

    def _drain(self) -> bool:
        """Move waiting events into the pending list; True when the pipe is empty or closed."""
        with self._lock:
            connection = self._events
            if connection is None:
                return True
            for _ in range(MAX_EVENTS_PER_POLL):
                try:
                    if not connection.poll():
                        return True
                    event = connection.recv()
                except (EOFError, OSError):
                    # The child's end closed: it exited, or died in the middle of a message.
                    connection.close()
                    self._events = None
                    return True
                self._observe(event)
                self._pending.append(event)
            return False

    def _observe(self, event: Event) -> None:
        if isinstance(event, Step):
            self.latest = event.stats
            self.history.append(event.stats)
            self._tally.record(event.stats)
        elif isinstance(event, Eval):
            self._tally.last_eval = event
        elif isinstance(event, Started):
            self.started = event
        elif isinstance(event, Finished | Failed):
            self.result = event

    def _log_unneeded(self) -> bool:
        """Whether the worker's log holds nothing anyone needs to read: it reported its run
        finished (stopped early or not) and exited by itself with status 0, or it refused
        a mistake in the input, which its reason says in full (the report names no log)."""
        process = self._process
        if self._forced is not None or process is None:
            return False
        if self._ended_now:  # ended as asked, unless it had reported a failure of its own
            # (its death by the job's SIGTERM, seen before the stop was asked, is none)
            return not isinstance(self.result, Failed) or self.result.exitcode == -signal.SIGTERM
        if isinstance(self.result, Failed):
            return self.result.exitcode == process.exitcode == EXIT_BAD_INPUT
        # Finished, then ended by a SIGTERM to the whole job as it exited: nothing to read.
        return isinstance(self.result, Finished) and process.exitcode in (0, -signal.SIGTERM)

    def _stopped_report(self) -> Finished:
        """A worker ended at once (stop_now) as a run stopped: its summary, from its steps."""
        summary = self._tally.summary(self.settings, log=str(self.log_path),
                                      seconds=time.monotonic() - self._started_at)
        if self.started is None:
            # It had not begun its metrics file (it does once started), whose last lines
            # may be an earlier run's: the summary is not this run's to end them with.
            summary["metrics"] = None
        finished = Finished(summary=summary)
        self.result = finished
        return finished

    def _death_report(self) -> Failed:
        code = self._process.exitcode if self._process is not None else None
        if self._forced is not None:
            reason = self._forced
        elif code is not None and code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:
                name = "unknown signal"
            reason = f"worker exited with signal {-code} ({name})"
            if -code == signal.SIGKILL:
                reason += ", killed from outside: often the out-of-memory killer"
        else:
            reason = f"worker exited with code {code} without reporting why"
        failed = Failed(reason=reason, exitcode=code, log_tail=read_log_tail(self.log_path))
        self.result = failed
        return failed

    def _close_channels(self) -> None:
        with self._lock:
            for connection in (self._commands, self._events):
                if connection is not None:
                    connection.close()
            self._commands = None
            self._events = None


@contextlib.contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Start children with SIGINT ignored from their first instruction.

    The disposition is inherited through exec, so a Ctrl-C in the terminal during the
    seconds a spawned child spends importing cannot interrupt it. Only the main thread may
    change signal handlers; elsewhere the child ignores SIGINT itself once it runs.
    """
    with sigint_handled(signal.SIG_IGN):
        yield


@contextlib.contextmanager
def _stderr_with_a_descriptor() -> Iterator[None]:
    """Give sys.stderr a real descriptor while the first spawn starts its resource tracker.

    multiprocessing hands stderr's descriptor to that tracker; a UI that swapped sys.stderr
    for an in-memory capture (Textual does, with fileno() -1) would break the start. The
    null device stands in: the tracker only ever writes leak warnings.
    """
    try:
        usable = sys.stderr is not None and sys.stderr.fileno() >= 0
    except (AttributeError, OSError, ValueError):
        usable = False
    if usable:
        yield
        return
    with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
        yield
