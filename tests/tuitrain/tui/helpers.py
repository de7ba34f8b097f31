"""Shared by the TUI tests: an app on a FakeWorker, and a way to let its events land."""

from __future__ import annotations

import time

from textual.command import CommandList
from textual.pilot import Pilot

from tests.tuitrain.fakeworker import FakeWorker
from tuitrain.events import Event
from tuitrain.settings import Settings
from tuitrain.tui.app import TuitrainApp

SIZE = (120, 40)


def make_app(
    script: list[Event], *, settings: Settings | None = None, steps_per_poll: int = 10_000
) -> tuple[TuitrainApp, FakeWorker]:
    """An app whose worker plays `script`; by default one poll delivers all of it."""
    fake = FakeWorker(script, steps_per_poll=steps_per_poll)
    settings = settings or Settings(model="opt-125m")
    return TuitrainApp(settings, worker_factory=lambda _: fake), fake


async def settle(app: TuitrainApp, pilot: Pilot) -> None:
    """Drain the worker and redraw now, instead of waiting for the app's timers."""
    await pilot.pause()
    app.poll_worker()
    app.redraw()
    await pilot.pause()


async def palette_offers(app: TuitrainApp, pilot: Pilot, text: str,
                         timeout: float = 30.0) -> None:
    """Wait until the open command palette's search has put a command containing `text`
    first (it searches in the background, for as long as a busy machine makes it)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await pilot.pause()
        found = app.screen.query(CommandList)
        if found and found.first().option_count and found.first().highlighted is not None:
            listed = found.first()
            if text in str(listed.get_option_at_index(listed.highlighted).prompt).lower():
                return
    raise AssertionError(f"the palette offered no {text!r} within {timeout:g} s")
