"""The app on a scripted data-parallel run: a row per rank with its own memory, rank 0's
step panel, a change answered with the step every rank took it at, a failure that names
its rank. A single-process run shows no rank rows."""

from __future__ import annotations

import dataclasses
import os
import signal
import time

import pytest

from tests.tuitrain.fakeworker import MiB, fake_run, fake_stats
from tests.tuitrain.forked_workers import worker_processes
from tuitrain.events import Failed, RankStep, SetMargin, Step
from tuitrain.formatting import format_size
from tuitrain.settings import Settings
from tuitrain.tui.app import TuitrainApp
from tuitrain.tui.controls import Controls
from tuitrain.tui.failure_panel import FailurePanel, failure_line
from tuitrain.tui.log_panel import LogPanel
from tuitrain.tui.ranks_table import RanksTable
from tuitrain.tui.spawn import data_parallel_factory
from tuitrain.tui.step_panel import StepPanel

from .helpers import SIZE, make_app, settle
from .test_real_worker import START_SECONDS

pytestmark = pytest.mark.anyio


def rank_step(rank: int, step: int, **settings: object) -> RankStep:
    """Rank `rank`'s step: rank 0's numbers, its own peak and process."""
    stats = fake_stats(step, **settings)
    memory = dataclasses.replace(stats.memory, device_peak=stats.memory.device_peak + rank * MiB,
                                 process_rss=(900 + rank) * MiB)
    return RankStep(rank, dataclasses.replace(stats, memory=memory))


async def test_every_rank_has_a_row_with_its_own_memory_and_the_panels_show_rank_0():
    app, _ = make_app(fake_run(3, ranks=3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        table = app.query_one(RanksTable)
        assert table.display and table.row_count == 3
        rank0 = fake_stats(3)
        for rank in range(3):
            assert table.cell(rank, "step") == "3"
            assert table.cell(rank, "budget") == format_size(rank0.device_budget)
        # Each rank's own peak and process, as its RankStep said (fake_run: +3 MiB and
        # +40 MiB a rank).
        assert table.cell(0, "peak") == format_size(rank0.memory.device_peak)
        assert table.cell(2, "peak") == format_size(rank0.memory.device_peak + 6 * MiB)
        assert table.cell(1, "rss") == format_size(rank0.memory.process_rss + 40 * MiB)
        # The step panel follows rank 0 alone: the other ranks' steps do not move it.
        assert app.latest.step == 3 and app.latest.memory == rank0.memory
        assert app.query_one(StepPanel).display


async def test_a_rank_reports_its_own_step_and_the_rows_follow_each_rank():
    app, fake = make_app(fake_run(2, ranks=2))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        fake.emit(Step(fake_stats(3)))  # rank 1 is a step behind: its row says so
        await settle(app, pilot)
        table = app.query_one(RanksTable)
        assert (table.cell(0, "step"), table.cell(1, "step")) == ("3", "2")
        fake.emit(rank_step(1, 3))
        await settle(app, pilot)
        assert table.cell(1, "step") == "3"
        assert table.cell(1, "rss") == format_size(901 * MiB)


async def test_a_change_is_answered_with_the_step_every_rank_took_it_at():
    app, fake = make_app(fake_run(3, ranks=2))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("plus")
        await settle(app, pilot)
        controls = app.query_one(Controls)
        assert "margin: 0.00 → 0.05 (pending)" in controls.changes_text
        assert [c.margin_ratio for c in fake.commands if isinstance(c, SetMargin)] == [0.05]
        fake.emit(Step(fake_stats(4)), rank_step(1, 4))
        await settle(app, pilot)
        assert "margin: 0.00 → 0.05, applied at step 4" in controls.changes_text
        assert any("applied at step 4" in m for m in app.query_one(LogPanel).messages)
        # Both ranks' step 4 ran with it.
        assert app.latest.step == 4 and app.latest.margin_ratio == 0.05
        assert app.query_one(RanksTable).latest[1].margin_ratio == 0.05


async def test_a_failure_names_the_rank_that_failed():
    app, fake = make_app(fake_run(2, ranks=2))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        fake.emit(Failed(reason="worker exited with signal 9 (SIGKILL); the other rank was "
                         "stopped", exitcode=-9, rank=1, log_path="/tmp/tuitrain/rank1-x.log"))
        await settle(app, pilot)
        panel = app.query_one(FailurePanel)
        assert panel.display
        text = panel.plain
        assert text.startswith("Training failed on rank 1 (exit code -9): worker exited with "
                               "signal 9")
        assert "full log: /tmp/tuitrain/rank1-x.log" in text  # the failed rank's own log
        assert any(m.startswith("failed on rank 1: ") for m in app.query_one(LogPanel).messages)
        assert failure_line(app.failure, log_path=app.log_path).startswith(
            "training failed on rank 1: worker exited with signal 9")


async def test_the_rank_rows_go_with_the_memory_charts_on_a_small_screen():
    app, _ = make_app(fake_run(2, ranks=2))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        table = app.query_one(RanksTable)
        assert app.view.name == "run" and table.display
        await pilot.press("v")  # trials: no memory, no rank rows
        assert app.view.name == "trials" and not table.display


async def test_a_single_process_shows_no_rank_rows():
    app, _ = make_app(fake_run(3), settings=Settings(model="opt-125m"))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert not app.query_one(RanksTable).display
        assert app.query_one(RanksTable).row_count == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_two_real_ranks_take_a_change_at_one_step_and_a_killed_rank_is_named(tmp_path,
                                                                                 monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the ranks' logs
    settings = Settings(model="tiny", engine={"precision": "fp32", "device_budget": "64MiB"},
                        training={"steps": 1_000_000, "batch_size": 2, "seq_len": 16})
    app = TuitrainApp(settings, worker_factory=data_parallel_factory(2))
    async with app.run_test(size=SIZE) as pilot:
        table = app.query_one(RanksTable)

        async def until(done, seconds: float = 60.0) -> None:
            deadline = time.monotonic() + seconds
            while not done():
                assert app.failure is None, app.failure
                assert time.monotonic() < deadline, "waited too long"
                await pilot.pause(0.1)

        await until(lambda: 1 in table.latest and 2 <= table.latest[1].step, START_SECONDS)
        assert table.display and table.row_count == 2
        await pilot.press("plus")
        controls = app.query_one(Controls)
        await until(lambda: "applied at step" in controls.changes_text)
        at = int(controls.changes_text.split("applied at step ")[1].split()[0])
        await until(lambda: all(table.latest[r].step >= at for r in (0, 1)))
        steps = {r: table.latest[r] for r in (0, 1)}  # the latest of each: at or after
        assert all(s.margin_ratio == 0.05 for s in steps.values())
        assert app.latest.margin_ratio == 0.05

        assert len(worker_processes()) == 2  # a process per rank
        os.kill(app.worker.pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while app.failure is None and time.monotonic() < deadline:
            await pilot.pause(0.1)
        assert app.failure is not None and app.failure.rank == 1
        assert app.query_one(FailurePanel).plain.startswith("Training failed on rank 1")
        deadline = time.monotonic() + 10.0
        while worker_processes() and time.monotonic() < deadline:
            await pilot.pause(0.1)
        assert worker_processes() == []  # rank 0 ended too, nothing left waiting
        await pilot.press("q")
