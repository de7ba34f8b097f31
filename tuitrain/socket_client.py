"""The app's client for a headless run it attached to: the run's socket, seen as a worker.

It has the shape of tuitrain.client.WorkerClient, so the app shows and steers an attached
run as it does a worker it started. What differs is the end: `stop` detaches (the run goes
on), and a run that goes away without saying how it ended is reported as failed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import socket
import threading

from tuitrain.events import Command, Event, Failed, Finished, Rejected
from tuitrain.wire import (
    MAX_EVENT_BYTES,
    WireError,
    decode_event,
    encode_command,
    frame,
    read_frame,
)

HELLO_SECONDS = 10.0  # a live run answers at once; this long means it is stuck


class AttachError(ValueError):
    """The run cannot be attached to (its socket is gone, refused, or says nothing)."""


class SocketClient:
    """Attached to the run whose socket is at `path`.

    Args:
        path: the run's Unix socket (tuitrain.runs).
        read_only: send nothing; every request is answered Rejected on the screen.

    Raises:
        AttachError: nothing listens there (a run that died), or it did not greet.
    """

    def __init__(self, path: str, *, read_only: bool = False) -> None:
        self.read_only = read_only
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(HELLO_SECONDS)
            self._sock.connect(path)
            hello = read_frame(self._sock, limit=MAX_EVENT_BYTES)
        except (OSError, WireError) as error:
            self._sock.close()
            why = getattr(error, "strerror", None) or str(error) or type(error).__name__
            raise AttachError(f"cannot attach to {path}: {why}") from None
        if not hello or not isinstance(hello.get("hello"), dict):
            self._sock.close()
            raise AttachError(f"cannot attach to {path}: the run did not greet")
        self._sock.settimeout(None)
        self.hello: dict = hello["hello"]
        self._events: queue.Queue[Event] = queue.Queue()
        self._pending: list[Event] = []
        self._send_lock = threading.Lock()
        self._next_id = 0
        self._ended = False  # the run said how it ended
        self._detached = False
        self._reader = threading.Thread(target=self._read, name="tuitrain-attached",
                                        daemon=True)

    @property
    def name(self) -> str:
        """How the run calls this viewer in what it tells the others."""
        return str(self.hello.get("viewer", ""))

    def start(self) -> None:
        if not self._reader.is_alive() and not self._detached:
            self._reader.start()

    def send(self, command: Command) -> int:
        self._next_id += 1
        command = dataclasses.replace(command, id=self._next_id)
        if self.read_only:
            self._pending.append(Rejected(command.id, "attached --read-only: nothing is sent"))
            return command.id
        try:
            with self._send_lock:
                self._sock.sendall(frame(encode_command(command)))
        except OSError:
            self._pending.append(Rejected(command.id, "the run is no longer attached"))
        return command.id

    def poll(self) -> list[Event]:
        events, self._pending = self._pending, []
        with contextlib.suppress(queue.Empty):
            while True:
                events.append(self._events.get_nowait())
        return events

    def stop(self, timeout: float = 5.0) -> None:
        """Detach: the run goes on without this viewer. Idempotent."""
        if self._detached:
            return
        self._detached = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        if self._reader.is_alive():
            self._reader.join(timeout)

    @property
    def alive(self) -> bool:
        return self._reader.is_alive()

    def _read(self) -> None:
        why = "the run closed the connection without saying how it ended (killed?)"
        try:
            while (message := read_frame(self._sock, limit=MAX_EVENT_BYTES)) is not None:
                event = decode_event(message)
                self._ended = self._ended or isinstance(event, (Finished, Failed))
                self._events.put(event)
        except WireError as error:
            why = f"the run sent what this viewer cannot read ({error})"
        except OSError as error:
            why = f"the connection to the run failed: {error.strerror or error}"
        if not self._ended and not self._detached:
            self._events.put(Failed(reason=why))
