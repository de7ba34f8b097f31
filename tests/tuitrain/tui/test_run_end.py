"""How a run the app started ends: its metrics end with the summary line a headless run
writes (finished, or stopped with q), so `tuitrain attach FILE` shows it as it ended; and a
view that cannot restart a failed run offers no key to.
"""

from __future__ import annotations

import dataclasses
import io
import json
import time
from pathlib import Path

import pytest
from textual.widgets._footer import FooterKey

from tests.tuitrain.fakeworker import fake_run
from tests.tuitrain.forked_workers import worker_processes
from tuitrain.events import Finished, Step
from tuitrain.headless import _Report
from tuitrain.metrics import MetricsWriter
from tuitrain.replay import ReplayClient
from tuitrain.settings import Settings
from tuitrain.tui.app import TuitrainApp
from tuitrain.tui.failure_panel import FailurePanel
from tuitrain.tui.header import RunHeader

from .helpers import SIZE, make_app, settle

pytestmark = pytest.mark.anyio

START_SECONDS = 240.0  # a cold start imports torch and tokenises the corpus


def last_record(path: Path) -> dict:
    return json.loads(path.read_text().splitlines()[-1])


def replayed(path: Path) -> TuitrainApp:
    """The app as `tuitrain attach FILE` opens it."""
    client = ReplayClient(path)
    return TuitrainApp(Settings.model_validate(client.settings),
                       worker_factory=lambda _: client, attached=True, read_only=True)


async def wait_for(pilot, done, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, "timed out"
        await pilot.pause(0.1)


async def test_a_finished_run_ends_its_metrics_with_the_summary_a_headless_run_writes(
        tmp_path: Path) -> None:
    run = fake_run(4, model="tiny")
    app_file, headless_file = tmp_path / "app.jsonl", tmp_path / "headless.jsonl"
    summaries = {}
    for path in (app_file, headless_file):
        summaries[path] = {"steps": 4, "last_step": 4, "planned_steps": 4, "stopped": False,
                           "tokens": 1024, "seconds": 2.0, "metrics": str(path)}
    settings = Settings(model="tiny", training={"steps": 4},
                        logging={"metrics": str(app_file)})
    app, _ = make_app([*run, Finished(summary=summaries[app_file])], settings=settings)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.run_state == "finished"
        await pilot.press("q")
    report = _Report(settings=settings, out=io.StringIO(), err=io.StringIO(), log_path="w.log")
    for event in run[1:]:  # its steps: the settings block wants a real run's Started
        report.handle(event)
    report.handle(Finished(summary=summaries[headless_file]))

    written = last_record(app_file)["summary"]
    assert written == {**last_record(headless_file)["summary"], "metrics": str(app_file)}
    assert [(t["policy"], t["steps"]) for t in written["trials"]] == [("auto", 4)]


async def test_an_attached_app_leaves_the_summary_to_the_run_it_watches(tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    summary = {"steps": 2, "stopped": False, "metrics": str(metrics)}
    app, _ = make_app([*fake_run(2, model="tiny"), Finished(summary=summary)])
    app.attached = True  # a headless run's own process appends it
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.run_state == "finished"
        await pilot.press("q")
    assert not metrics.exists()


@pytest.mark.slow
async def test_q_stops_a_real_run_whose_metrics_then_end_with_a_stopped_summary(
        tmp_path: Path) -> None:
    metrics = tmp_path / "tui1.jsonl"
    settings = Settings(
        model="tiny",
        engine={"precision": "fp32", "policy": "auto"},
        training={"steps": 1_000_000, "batch_size": 2, "seq_len": 16},
        logging={"metrics": str(metrics)},
    )
    app = TuitrainApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.failure is not None
                       or (app.latest is not None and app.latest.step >= 3), START_SECONDS)
        assert app.failure is None, app.failure
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0
    record = last_record(metrics)
    summary = record["summary"]
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()
             if line.startswith('{"step"')]
    assert summary["stopped"] and summary["last_step"] == steps[-1] >= 3
    assert sum(t["steps"] for t in summary["trials"]) == summary["steps"] == len(steps)

    again = replayed(metrics)
    async with again.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: again.finished is not None or again.failure is not None)
        assert again.failure is None and again.run_state == "stopped"
        assert "stopped" in again.query_one(RunHeader).plain
        await pilot.press("q")
    assert again.return_code == 0
    deadline = time.monotonic() + 10
    while worker_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker_processes() == []


async def test_a_run_shown_again_without_a_summary_offers_no_key_that_does_nothing(
        tmp_path: Path) -> None:
    metrics = tmp_path / "killed.jsonl"
    writer = MetricsWriter(metrics)
    writer.write({"settings": Settings(model="tiny").model_dump(mode="json")})
    for event in fake_run(3, model="tiny")[1:]:
        assert isinstance(event, Step)
        writer.write(dataclasses.asdict(event.stats))
    writer.close()
    app = replayed(metrics)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: app.failure is not None)
        await pilot.pause()
        panel = app.query_one(FailurePanel).plain
        assert "the run ended without a summary" in panel and "q quit" in panel
        assert "restart" not in panel and "c + -" not in panel
        def footer() -> set[str]:
            return {key.description for key in app.query(FooterKey)}

        await wait_for(pilot, lambda: "Quit" in footer())  # drawn, on a busy machine too
        assert "Restart" not in footer()
        await pilot.press("q")
    assert app.return_code == 1  # it did fail, as far as anyone can tell
