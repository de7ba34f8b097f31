"""A headless run's Unix socket: viewers attach, see the run so far and then live, and
steer it as the app steers a worker it started.

Everything on the socket happens in threads of its own: one accepts, and each viewer has a
reader (commands in) and a writer (events out, from a bounded queue). The run's loop only
hands events over (`publish`, nothing encoded while no viewer is attached) and takes the
commands that came (`take_commands`): a slow or stuck viewer fills its queue and is
dropped, and counted, rather than ever making the run wait.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import socket
import struct
import threading
from collections import deque
from pathlib import Path

from tuitrain.events import (
    Applied,
    Command,
    Event,
    Failed,
    Finished,
    Log,
    Rejected,
    SetBudget,
    SetMargin,
    SetPolicy,
    Started,
)
from tuitrain.wire import (
    MAX_COMMAND_BYTES,
    WireError,
    decode_command,
    encode_event,
    frame,
    read_frame,
)

HISTORY_EVENTS = 5000  # events a viewer that attaches late is sent first (steps, mostly)
QUEUED_FRAMES = 2000  # a viewer this far behind is dropped: it would only fall further
SEND_TIMEOUT_SECONDS = 10.0  # a viewer that takes no bytes for this long is dropped
CLOSE_SECONDS = 2.0  # at the end, how long viewers get to read the last events
ACCEPT_JOIN_SECONDS = 1.0  # at the end, how long the accepting thread gets to return
PEER_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
SETTING_OF = {SetPolicy: "policy", SetMargin: "margin_ratio", SetBudget: "device_budget"}


class Viewer:
    """One attached connection: who it is, and the frames waiting to be sent to it."""

    def __init__(self, conn: socket.socket, pid: int, number: int) -> None:
        self.conn = conn
        self.pid = pid
        self.name = f"viewer {number} (pid {pid})"
        self.outbox: queue.Queue[bytes | None] = queue.Queue(maxsize=QUEUED_FRAMES)
        self.closed = threading.Event()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        with contextlib.suppress(OSError):
            self.conn.shutdown(socket.SHUT_RDWR)  # wakes its reader and writer
        with contextlib.suppress(OSError):
            self.conn.close()


class Listener:
    """Serves one run on the Unix socket at `path` (made 0600; peers of another uid refused).

    Args:
        path: where the socket goes, in a private folder (tuitrain.runs).
        hello: what a viewer is told first (the run's id, model, settings, metrics file).

    Raises:
        OSError: the socket cannot be made (a path too long, no room).
    """

    def __init__(self, path: str | os.PathLike, *, hello: dict) -> None:
        self.path = Path(path)
        self.hello = hello
        self.dropped = 0  # viewers dropped for falling behind
        self._viewers: list[Viewer] = []
        self._count = 0
        self._lock = threading.Lock()
        self._started: Started | None = None
        self._history: deque[Event] = deque(maxlen=HISTORY_EVENTS)
        self._commands: queue.Queue[tuple[Viewer, Command]] = queue.Queue()
        self._notices: queue.Queue[Log] = queue.Queue()
        self._closing = threading.Event()
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a socket left by a killed run of the same pid
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_mask = os.umask(0o177)  # the socket is born 0600: no moment when others may connect
        try:
            self._server.bind(str(self.path))
        finally:
            os.umask(old_mask)
        os.chmod(self.path, 0o600)
        self._server.listen(8)
        self._acceptor = threading.Thread(target=self._accept, name="tuitrain-listener",
                                          daemon=True)
        self._acceptor.start()

    @property
    def viewers(self) -> int:
        with self._lock:
            return len(self._viewers)

    # --- the run's side (its own thread) -------------------------------------------------

    def publish(self, event: Event, *, to: Viewer | None = None, others: Event | None = None
                ) -> None:
        """Send `event` to every viewer; `to` gets it and the rest get `others` instead (an
        answer to one viewer's command, which the others see as who did what)."""
        public = others if to is not None else event
        with self._lock:
            if isinstance(public, Started):
                self._started = public
            elif public is not None:
                self._history.append(public)
            viewers = list(self._viewers)
        if not viewers:
            return
        shared = frame(encode_event(public)) if public is not None else None
        for viewer in viewers:
            data = frame(encode_event(event)) if viewer is to else shared
            if data is not None:
                self._queue(viewer, data)

    def set_engine_setting(self, name: str, value: object) -> None:
        """A setting in force from now: viewers that attach later are greeted with it."""
        with self._lock:
            self.hello["settings"]["engine"][name] = value

    def take_commands(self) -> list[tuple[Viewer, Command]]:
        """The commands viewers sent since the last call, oldest first."""
        if self._commands.empty():  # the usual case, and the cheapest answer
            return []
        taken = []
        with contextlib.suppress(queue.Empty):
            while True:
                taken.append(self._commands.get_nowait())
        return taken

    def take_notices(self) -> list[Log]:
        """What happened on the socket that the run's log should say (one line each)."""
        if self._notices.empty():
            return []
        taken = []
        with contextlib.suppress(queue.Empty):
            while True:
                taken.append(self._notices.get_nowait())
        return taken

    def close(self) -> None:
        """Let viewers read what is queued (up to CLOSE_SECONDS), then close every
        connection and remove the socket."""
        self._closing.set()
        with self._lock:
            viewers, self._viewers = self._viewers, []
        for viewer in viewers:
            with contextlib.suppress(queue.Full):
                viewer.outbox.put_nowait(None)  # the writer closes once it got this far
        for viewer in viewers:
            viewer.closed.wait(CLOSE_SECONDS / max(1, len(viewers)))
            viewer.close()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread now
        with contextlib.suppress(OSError):
            self._server.close()
        with contextlib.suppress(OSError):
            self.path.unlink()
        self._acceptor.join(ACCEPT_JOIN_SECONDS)

    # --- the socket's side (threads) ------------------------------------------------------

    def _queue(self, viewer: Viewer, data: bytes) -> None:
        try:
            viewer.outbox.put_nowait(data)
        except queue.Full:
            self.dropped += 1
            self._drop(viewer, f"{viewer.name} fell {QUEUED_FRAMES} events behind and was "
                       f"dropped ({self.dropped} so far); the run goes on")

    def _drop(self, viewer: Viewer, why: str, *, level: str = "warning") -> None:
        with self._lock:
            if viewer not in self._viewers:
                return
            self._viewers.remove(viewer)
        viewer.close()
        self._notices.put(Log(why, level=level))

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                # Blocks, waking for nothing else: close() shuts the socket down to end it.
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            pid, uid, _ = PEER_CREDENTIALS.unpack(conn.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, PEER_CREDENTIALS.size))
            if uid != os.getuid():
                self._notices.put(Log(f"refused a connection from uid {uid} (pid {pid}): "
                                      "only this user may attach", level="warning"))
                conn.close()
                continue
            self._count += 1
            viewer = Viewer(conn, pid, self._count)
            with self._lock:
                if self._closing.is_set():
                    conn.close()
                    return
                first = [*([self._started] if self._started else []), *self._history]
                self._viewers.append(viewer)
                greeting = frame({"hello": {**self.hello, "viewer": viewer.name}})
                # Said before its threads start: each may say it left (or was dropped) as
                # soon as it runs, and that must come after it came.
                self._notices.put(Log(f"{viewer.name} attached", level="info"))
            threading.Thread(target=self._write, args=(viewer, greeting, first),
                             name="tuitrain-viewer-out", daemon=True).start()
            threading.Thread(target=self._read, args=(viewer,), name="tuitrain-viewer-in",
                             daemon=True).start()

    def _write(self, viewer: Viewer, greeting: bytes, first: list[Event]) -> None:
        # A send timeout only (SO_SNDTIMEO): the reader on this socket may wait for ever.
        viewer.conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO,
                               struct.pack("ll", int(SEND_TIMEOUT_SECONDS), 0))
        try:
            viewer.conn.sendall(greeting)
            for event in first:  # encoded here, not in the run's thread
                viewer.conn.sendall(frame(encode_event(event)))
            while (data := viewer.outbox.get()) is not None:
                viewer.conn.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            # The viewer closed its end (q, or killed) before its reader saw it go.
            if not viewer.closed.is_set():
                self._drop(viewer, f"{viewer.name} detached", level="info")
            return
        except OSError:  # the send timed out: a viewer that stopped reading
            if not viewer.closed.is_set():
                self._drop(viewer, f"{viewer.name} stopped reading and was dropped")
            return
        viewer.close()  # the run ended and everything was sent

    def _read(self, viewer: Viewer) -> None:
        try:
            while (message := read_frame(viewer.conn, limit=MAX_COMMAND_BYTES)) is not None:
                self._commands.put((viewer, decode_command(message)))
        except WireError as error:
            self._drop(viewer, f"{viewer.name} sent what is not a command ({error}); "
                       "its connection was closed")
            return
        except OSError:
            pass
        if not self._closing.is_set():
            self._drop(viewer, f"{viewer.name} detached", level="info")


def answer_for_others(event: Applied | Rejected, viewer: Viewer, command: Command) -> Event:
    """How viewers other than `viewer` see the answer to its `command`: who did what, a
    setting as "<setting> <value as asked>" (what the app reads back as the setting)."""
    if isinstance(event, Applied):
        asked = SETTING_OF.get(type(command))
        what = f"{asked} {getattr(command, asked)}" if asked else event.what
        return dataclasses.replace(event, id=-1, what=f"{what} (by {viewer.name})")
    return Log(f"{viewer.name} asked for a change, refused: {event.reason}", level="warning")


def ended_state(event: Event | None) -> str:
    """The state a run's record keeps for the event that ended it: a run stopped before its
    last step (Ctrl-C, `tuitrain attach --stop`), or that never said how it ended, was
    interrupted."""
    if isinstance(event, Finished):
        return "interrupted" if event.summary.get("stopped") else "finished"
    return "failed" if isinstance(event, Failed) else "interrupted"
