"""The app on a real worker process training `tiny`: real steps reach the panels, space
pauses at a step boundary, q cleans up."""

from __future__ import annotations

import time

import pytest

from tests.tuitrain.forked_workers import worker_processes
from tuitrain.settings import Settings
from tuitrain.tui.app import TuitrainApp
from tuitrain.tui.chunk_map import ChunkMap
from tuitrain.tui.header import RunHeader
from tuitrain.tui.memory_chart import MemoryChart
from tuitrain.tui.states_table import StatesTable
from tuitrain.tui.step_panel import StepPanel

from .helpers import SIZE

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

# Generous: the machine is shared and a cold start imports torch and tokenises the corpus.
START_SECONDS = 240.0
STEPS = 3


async def test_real_steps_reach_the_panels_and_q_leaves_no_worker_behind(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    settings = Settings(
        model="tiny",
        engine={"precision": "fp32", "policy": "auto"},
        training={"steps": 1_000_000, "batch_size": 2, "seq_len": 16},
    )
    app = TuitrainApp(settings)
    async with app.run_test(size=SIZE) as pilot:
        deadline = time.monotonic() + START_SECONDS
        while app.run_state != "failed" and time.monotonic() < deadline:
            if app.latest is not None and app.latest.step >= STEPS:
                break
            await pilot.pause(0.2)
        assert app.failure is None, app.failure
        assert app.latest is not None and app.latest.step >= STEPS
        assert worker_processes(), "the worker should be running while the app is open"
        assert "running" in app.query_one(RunHeader).plain
        # Pause, so that no step lands between drawing the panels and reading them: the
        # worker answers Pause at a step boundary, after the last step it reports.
        await pilot.press("space")
        deadline = time.monotonic() + 30
        while app.run_state != "paused" and time.monotonic() < deadline:
            await pilot.pause(0.1)
        assert app.run_state == "paused"
        paused_at = app.latest.step
        await pilot.pause(0.5)
        assert app.latest.step == paused_at, "a step arrived after the worker paused"
        app.redraw()
        await pilot.pause()

        latest = app.latest
        header = app.query_one(RunHeader).plain
        assert f"step {latest.step}/1000000" in header and "tiny" in header
        assert "simulated" in header and "paused" in header
        states = app.query_one(StatesTable)
        counted = sum(
            int(states.cell(state, location).replace(",", ""))
            for state in latest.memory.states["device"]
            for location in ("device", "host")
        )
        assert counted == sum(sum(s.values()) for s in latest.memory.states.values()) > 0
        assert app.query_one(ChunkMap).cell_count == len(latest.memory.chunks) > 0
        assert f"step {latest.step}" in app.query_one(StepPanel).times_text
        assert app.query_one(MemoryChart).samples[-1].step == latest.step

        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0
    deadline = time.monotonic() + 10
    while worker_processes() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker_processes() == []
