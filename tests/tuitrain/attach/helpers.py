"""Shared by the attach tests: a headless run's socket served over a FakeWorker, and raw
viewers that speak the wire protocol by hand."""

from __future__ import annotations

import io
import socket
import threading
import time
from collections.abc import Callable, Iterator

from tests.tuitrain.fakeworker import FakeWorker, fake_started, fake_stats, follow_settings
from tuitrain.events import Event, Step
from tuitrain.served import ServedWorker, serve
from tuitrain.settings import Settings
from tuitrain.wire import MAX_EVENT_BYTES, read_frame

WAIT_SECONDS = 30.0  # threads on a loaded machine; a passing test takes milliseconds


def served_fake(steps: int = 100, *, settings: Settings | None = None, then_wait: bool = False
                ) -> tuple[ServedWorker, FakeWorker]:
    """A fake run of `steps` steps served on a socket in the test's runtime folder, started;
    each poll plays one step. With `then_wait` the run stays alive after its last step, as
    one whose next step is long in coming: a viewer then has nothing more to draw, and a
    Pilot's wait for an idle app returns at once rather than after its one-second limit."""
    def script() -> Iterator[Event | None]:  # made as played: a long fake run costs nothing
        yield fake_started(model="tiny")
        for step in range(1, steps + 1):
            yield Step(fake_stats(step))
        while then_wait:
            yield None  # this poll has nothing; the run goes on

    fake = FakeWorker(script, steps_per_poll=1, restep=follow_settings())
    served = serve(fake, settings or Settings(model="tiny"), err=io.StringIO())
    assert served is not None
    served.start()
    return served, fake


def until(served: ServedWorker, done: Callable[[], bool], *, collect: list | None = None
          ) -> None:
    """Poll the served run (as the headless loop does) until `done()`."""
    deadline = time.monotonic() + WAIT_SECONDS
    while not done():
        assert time.monotonic() < deadline, "timed out"
        events = served.poll()
        if collect is not None:
            collect.extend(events)
        time.sleep(0.005)


class RawViewer:
    """A viewer written by hand: connects, and reads frames in the test's own thread."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(WAIT_SECONDS)
        self.sock.connect(path)

    def read(self) -> dict | None:
        return read_frame(self.sock, limit=MAX_EVENT_BYTES)

    def read_until(self, done: Callable[[dict], bool]) -> list[dict]:
        seen = []
        while (message := self.read()) is not None:
            seen.append(message)
            if done(message):
                return seen
        raise AssertionError(f"the stream ended first: {[m.get('event') for m in seen]}")

    def ended(self) -> bool:
        """Read to the end of the stream; True when the run closed it (cleanly or not)."""
        try:
            while self.read() is not None:
                pass
        except ConnectionResetError:
            pass
        return True

    def close(self) -> None:
        self.sock.close()


class Pump:
    """The headless loop of a served fake run, in a thread: polls until stopped, keeping
    what the run itself saw."""

    def __init__(self, served: ServedWorker) -> None:
        self.served = served
        self.seen: list = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Pump:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.served.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen.extend(self.served.poll())
            time.sleep(0.02)
