"""How the app looks at 120x40 with a scripted run (regenerate: pytest --snapshot-update)."""

from __future__ import annotations

import pytest

from tuitrain.events import Step
from tuitrain.fakeworker import FakeWorker, GiB, fake_run, fake_stats
from tuitrain.settings import Settings
from tuitrain.tui import memory_chart
from tuitrain.tui.app import TuitrainApp

from .helpers import SIZE

# opt-1.3b on a 3 GiB budget under auto: some chunks stay on the device, the rest live on
# the host, so the chunk map and the states table show both.
RUN = dict(
    model="opt-1.3b",
    parameters=1_315_758_080,
    device_budget=3 * GiB,
    n_chunks=72,
    policy="auto",
    margin_ratio=0.3,
)


@pytest.fixture(autouse=True)
def same_host_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory_chart, "host_total_bytes", lambda: 32 * GiB)


def scripted_app() -> tuple[TuitrainApp, FakeWorker]:
    settings = Settings(model=RUN["model"])
    settings.engine.device_budget = "3GiB"
    settings.engine.margin_ratio = RUN["margin_ratio"]
    settings.training.steps = 500
    fake = FakeWorker(fake_run(120, **RUN), steps_per_poll=10_000)
    return TuitrainApp(settings, worker_factory=lambda _: fake), fake


def test_main_screen(snap_compare):
    app, fake = scripted_app()
    stats = {k: v for k, v in RUN.items() if k != "model"}

    async def run_before(pilot) -> None:
        await pilot.pause()
        app.poll_worker()
        await pilot.press("plus")  # applied at the next step
        fake.emit(Step(fake_stats(121, **stats)))
        app.poll_worker()
        await pilot.press("c")  # still pending on screen
        app.poll_worker()
        app.redraw()
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_help_screen(snap_compare):
    app, _ = scripted_app()

    async def run_before(pilot) -> None:
        await pilot.pause()
        app.poll_worker()
        app.redraw()
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
