"""The app attached to a run it did not start: it steers over the socket, follows what
another viewer changed, detaches with q (the run goes on), and shows a finished run again
from its metrics file."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import pytest
from textual.widgets._footer import FooterKey

from tests.tuitrain.fakeworker import fake_run
from tuitrain.events import SetMargin, SetPolicy
from tuitrain.metrics import MetricsWriter
from tuitrain.replay import ReplayClient
from tuitrain.settings import Settings
from tuitrain.socket_client import SocketClient
from tuitrain.trials import append_summary
from tuitrain.tui.app import TuitrainApp
from tuitrain.tui.header import RunHeader
from tuitrain.tui.log_panel import LogPanel

from .helpers import WAIT_SECONDS, Pump, served_fake

pytestmark = pytest.mark.anyio
SIZE = (80, 24)  # the smallest screen: the least to draw


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def wait_for(pilot, done) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not done():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.05)


def attached_app(path: str, **options) -> TuitrainApp:
    client = SocketClient(path, **options)
    settings = Settings.model_validate(client.hello["settings"])
    return TuitrainApp(settings, worker_factory=lambda _: client, attached=True,
                       read_only=client.read_only)


async def test_c_steers_the_run_and_q_detaches_leaving_it_running() -> None:
    served, fake = served_fake(steps=10_000)
    with Pump(served) as pump:
        app = attached_app(served.record.socket)
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.latest is not None)
            await pilot.press("c")  # auto -> cuda
            await wait_for(pilot, lambda: app.settings.engine.policy == "cuda")
            assert [c.policy for c in fake.commands if isinstance(c, SetPolicy)] == ["cuda"]
            assert "policy cuda" in app.query_one(RunHeader).plain
            await pilot.press("q")
        assert app.return_code == 0
        assert fake.stop_calls == 0 and fake.alive  # detached: the run goes on
        deadline = time.monotonic() + WAIT_SECONDS
        def detached() -> bool:
            return any("detached" in getattr(e, "message", "") for e in pump.seen)

        while (served.listener.viewers or not detached()) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert served.listener.viewers == 0
        assert detached()


async def test_a_change_another_viewer_made_is_shown_in_force_with_who_made_it() -> None:
    served, _ = served_fake(steps=10_000)
    with Pump(served):
        app = attached_app(served.record.socket)
        other = SocketClient(served.record.socket)
        other.start()
        async with app.run_test(size=SIZE) as pilot:
            await wait_for(pilot, lambda: app.latest is not None)
            other.send(SetMargin(margin_ratio=0.3))
            await wait_for(pilot, lambda: app.settings.engine.margin_ratio == 0.3)
            assert app.steering.target["margin_ratio"] == 0.3  # + goes on from there
            log = "\n".join(app.query_one(LogPanel).messages)
            assert f"margin_ratio 0.3 (by {other.name})" in log
            await pilot.press("q")
        other.stop()


def footer_keys(app) -> set[str]:
    return {key.description for key in app.query(FooterKey)}


def palette_titles(app) -> set[str]:
    return {c.title for c in app.get_system_commands(app.screen)}


STEERING = {"Policy", "Margin+", "Margin-", "Pause", "Resume", "Tune"}


async def test_read_only_offers_no_steering_key_sends_nothing_and_says_so() -> None:
    served, fake = served_fake(steps=2, then_wait=True)
    with Pump(served):
        app = attached_app(served.record.socket, read_only=True)
        async with app.run_test(size=(120, 40)) as pilot:
            await wait_for(pilot, lambda: app.latest is not None)
            # The footer is drawn a moment later, a longer one on a busy machine.
            await wait_for(pilot, lambda: "Quit" in footer_keys(app))
            assert "read-only" in app.query_one(RunHeader).plain
            assert not STEERING & footer_keys(app) and "Quit" in footer_keys(app)
            assert not {"Cycle policy", "Pause", "Tune", "Save checkpoint"} & palette_titles(app)
            assert "Save preset" in palette_titles(app)  # a file of the viewer's own
            assert app.query_one("#policy").disabled and app.query_one("#margin").disabled
            for key in ("c", "plus", "space", "a"):
                await pilot.press(key)
            await pilot.press("question_mark")
            await pilot.pause()
            shown = str(app.screen.query_one("#help-keys").render())
            assert "placement policy" not in shown and "pause training" not in shown
            assert "Read-only" in str(app.screen.query_one("#help-intro").render())
            await pilot.press("escape")
            assert app.settings.engine.policy == "auto"
            await pilot.press("q")
    assert fake.commands == []


async def test_a_finished_run_is_shown_again_from_its_metrics(tmp_path: Path) -> None:
    metrics = tmp_path / "run.jsonl"
    events = fake_run(12, model="tiny")
    writer = MetricsWriter(metrics)
    settings = Settings(model="tiny").model_dump(mode="json")
    writer.write({"settings": settings, "parameters": 657_000, "device": "simulated, 6.0 GiB"})
    for i, event in enumerate(events[1:], start=1):
        stats = event.stats if i <= 6 else dataclasses.replace(event.stats, policy="cpu")
        writer.write(dataclasses.asdict(stats))
    writer.close()
    append_summary(metrics, {"steps": 12, "tokens": 3072}, [])
    client = ReplayClient(metrics)
    assert client.settings["engine"]["policy"] == "cpu"  # as the run ended
    app = TuitrainApp(Settings.model_validate(client.settings),
                      worker_factory=lambda _: client, attached=True)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.finished is not None)
        assert app.latest.step == 12 and app.run_state == "finished"
        assert [row.policy for row in app.trial_book.rows()] == ["auto", "cpu"]
        assert not app.can_run("restart")  # nothing of this app's to restart
        # Nothing can change a run that has ended and is not this app's to restart (the
        # footer redraws on the app's next refresh after the end).
        await wait_for(pilot, lambda: not STEERING & footer_keys(app))
        assert not STEERING & footer_keys(app)
        await pilot.press("c")
        app.request("margin_ratio", 0.5)
        await pilot.pause()
        assert app.settings.engine.policy == "cpu" and app.settings.engine.margin_ratio == 0.0
        assert "restarts" not in "\n".join(app.query_one(LogPanel).messages)
        await pilot.press("q")
    assert app.return_code == 0


def test_a_metrics_file_with_no_run_is_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text(json.dumps({"step": 1}) + "\n")
    with pytest.raises(ValueError, match="no run in it"):
        ReplayClient(empty)

