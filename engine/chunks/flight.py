"""UpdateInFlight: the update of a step still running while the next step's forward starts.

With optimizer state on disk, the update is bound by the disk (it reads and writes every
chunk's state), and the forward and backward run while the disk idles. So the optimizer's
walk over host chunks runs in a thread of its own and `Engine.step` returns as soon as it
has started; the next step's forward then waits for each chunk's update just before the
chunk is fetched (the walk goes in the order the forward uses chunks), so the weights it
computes with are exactly the updated ones, and the disk's work overlaps the forward.

Everything else that touches chunk tensors or the disk tier waits for the whole walk first
(`wait()`): the backward, setting changes, checkpoints, evaluation, close. While the walk
runs, the disk tier is its thread's alone.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from engine.chunks.chunk import Chunk


class UpdateInFlight:
    """At most one walk at a time; `run` starts one, `wait` waits for a chunk or for all."""

    def __init__(self) -> None:
        self._executor: ThreadPoolExecutor | None = None
        self._future: Future | None = None
        self._done: dict[int, threading.Event] = {}
        self._failed = False
        self._ended = False  # a walk ended and `take_ended` has not said so yet
        self.waited = 0.0  # seconds the caller's thread waited for updates

    def run(self, chunks: list[Chunk], walk: Callable[[Callable[[Chunk], None]], None]) -> None:
        """Start `walk(done)`, which updates `chunks` in order and calls `done(chunk)` after
        each. A walk still running is waited for first."""
        self.wait()
        self._done = {c.index: threading.Event() for c in chunks}
        self._failed = False
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="tuitrain-update")

        def body() -> None:
            try:
                walk(lambda chunk: self._done[chunk.index].set())
            except BaseException:
                self._failed = True
                raise
            finally:
                for event in self._done.values():
                    event.set()  # nobody waits forever on a walk that stopped

        self._future = self._executor.submit(body)

    @property
    def active(self) -> bool:
        """A walk is running (its thread may be using chunk tensors and the disk tier)."""
        return self._future is not None and not self._future.done()

    def pending(self, index: int) -> bool:
        """Chunk `index` is still to be updated by the running walk."""
        event = self._done.get(index)
        return event is not None and not event.is_set()

    def wait(self, chunk: Chunk | None = None) -> None:
        """Until `chunk`'s update is done (every update: None). Raises what the walk
        raised, once, when it is over."""
        future = self._future
        if future is None:
            return
        t0 = time.perf_counter()
        if chunk is not None:
            event = self._done.get(chunk.index)
            if event is not None:
                event.wait()
            if not self._failed:
                self.waited += time.perf_counter() - t0
                return
        future.exception()  # waits for the end of the walk
        self.waited += time.perf_counter() - t0
        self._future, self._done, self._ended = None, {}, True
        future.result()

    def take_ended(self) -> bool:
        """Whether a walk has ended since the last call (its writes may have failed: the
        engine asks the disk tier then)."""
        ended, self._ended = self._ended, False
        return ended

    def close(self) -> None:
        """Wait for a walk still running (what it raised is dropped: the engine is closing),
        and stop the thread."""
        with contextlib.suppress(Exception):
            self.wait()
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
