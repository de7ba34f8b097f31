"""How the app looks at 80x24, 120x40 and 200x60 with a scripted run in which three
settings were tried (regenerate: pytest --snapshot-update)."""

from __future__ import annotations

import pytest

from tests.tuitrain.fakeworker import FakeWorker, GiB, fake_run, fake_stats, follow_settings
from tuitrain.events import Step
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


STATS = {k: v for k, v in RUN.items() if k != "model"}
SIZES = {"80x24": (80, 24), "120x40": SIZE, "200x60": (200, 60)}


def scripted_app() -> tuple[TuitrainApp, FakeWorker]:
    settings = Settings(model=RUN["model"])
    settings.engine.device_budget = "3GiB"
    settings.engine.margin_ratio = RUN["margin_ratio"]
    settings.training.steps = 500
    fake = FakeWorker(
        fake_run(100, **RUN), steps_per_poll=10_000, restep=follow_settings(**STATS)
    )
    return TuitrainApp(settings, worker_factory=lambda _: fake), fake


async def three_settings(app: TuitrainApp, fake: FakeWorker, pilot) -> None:
    """auto at margin 0.30 for steps 1-100, cuda for 101-110 (over the budget), cpu at 0.35
    for 111-121, and a change still pending on screen."""
    await pilot.pause()
    app.poll_worker()
    for key, steps in (("c", range(101, 111)), ("c", ()), ("plus", range(111, 122))):
        await pilot.press(key)
        fake.emit(*(Step(fake_stats(n, **STATS)) for n in steps))
        app.poll_worker()
    await pilot.press("c")  # still pending on screen
    app.poll_worker()
    app.redraw()
    await pilot.pause()


@pytest.mark.parametrize("size", SIZES, ids=list(SIZES))
def test_main_screen(snap_compare, size):
    app, fake = scripted_app()

    async def run_before(pilot) -> None:
        await three_settings(app, fake, pilot)

    assert snap_compare(app, terminal_size=SIZES[size], run_before=run_before)


# The trials view: the cursor on the setting in force (cpu), which it followed through
# three settings even when the first row's highlight message came late.
@pytest.mark.parametrize("view", ["trials", "step"])
def test_a_view_a_key_away_on_a_small_screen(snap_compare, view):
    app, fake = scripted_app()

    async def run_before(pilot) -> None:
        await three_settings(app, fake, pilot)
        while app.view.name != view:
            await pilot.press("v")
            await pilot.pause()  # each view switch settles before the next key
        app.poll_worker()
        app.redraw()
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZES["80x24"], run_before=run_before)


def test_help_screen(snap_compare):
    app, _ = scripted_app()

    async def run_before(pilot) -> None:
        await pilot.pause()
        app.poll_worker()
        app.redraw()
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


# The same model under cpu with a 2 GiB host budget: optimizer state and the last chunks'
# payloads on disk, so the disk shows as a third tier in every panel that has one.
DISK_RUN = {**STATS, "policy": "cpu", "host_budget": 2 * GiB}


def test_a_run_with_a_disk_tier(snap_compare):
    settings = Settings(model=RUN["model"])
    settings.engine.device_budget = "3GiB"
    settings.engine.policy = "cpu"
    settings.engine.margin_ratio = RUN["margin_ratio"]
    settings.training.steps = 500
    events = fake_run(30, model=RUN["model"], **DISK_RUN)
    fake = FakeWorker(events, steps_per_poll=10_000)
    app = TuitrainApp(settings, worker_factory=lambda _: fake)

    async def run_before(pilot) -> None:
        await pilot.pause()
        app.poll_worker()
        app.redraw()
        await pilot.pause()

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
