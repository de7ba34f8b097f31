"""What a headless run says of its viewers comes in the order things happened to them:
a viewer is said to have attached before it is said to have detached, however the
threads that serve it are scheduled."""

from __future__ import annotations

import os
import threading

from tuitrain import listener as listener_module
from tuitrain.events import Log

from .helpers import RawViewer, served_fake, until


class RunsAtOnce(threading.Thread):
    """A thread that, once started, runs as far as it can (up to a moment) before the
    thread that started it goes on: the schedule under which a viewer that leaves at once
    is said to leave first, if its arrival is said only after its threads start."""

    def start(self) -> None:
        super().start()
        self.join(timeout=0.5)


def test_a_viewer_that_leaves_at_once_is_said_to_attach_then_to_detach(monkeypatch) -> None:
    served, _ = served_fake(then_wait=True)
    try:
        monkeypatch.setattr(listener_module.threading, "Thread", RunsAtOnce)
        RawViewer(served.record.socket).close()  # connects and leaves before a word
        said: list = []
        until(served, lambda: any("detached" in e.message for e in said if isinstance(e, Log)),
              collect=said)
        monkeypatch.undo()
    finally:
        served.close()
    viewer = f"viewer 1 (pid {os.getpid()})"
    assert [e.message for e in said if isinstance(e, Log)] == [
        f"{viewer} attached", f"{viewer} detached"]
