"""A real headless run of `tiny`, attached to by the app: a policy changed from the app is
applied at a step (the run's metrics say which), q detaches, and the run goes on to its
last step and finishes normally."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path

import pytest

from tuitrain.attach import open_run, stop_run
from tuitrain.headless import run_headless
from tuitrain.runs import find_run, runtime_folder
from tuitrain.settings import Settings
from tuitrain.tui.app import TuitrainApp

pytestmark = [pytest.mark.anyio, pytest.mark.slow]
START_SECONDS = 240.0  # a cold start imports torch and tokenises the corpus
# The run's length: the viewer pauses it once it has seen a step, and detaches as soon as
# it has seen the run resume, so the run must still be going at each of those moments.
# Steps of `tiny` take about 10 ms here: the rest of the run outlasts the app's answer
# (a poll every few hundredths of a second) many times over, and ends seconds later.
STEPS = 300


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_a_real_run_is_steered_from_an_attached_app_and_finishes_after_q(
        tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    settings = Settings(
        model="tiny",
        engine={"policy": "auto", "precision": "fp32"},
        training={"steps": STEPS, "batch_size": 2, "seq_len": 16},
        logging={"metrics": str(metrics)},
    )
    out, err = io.StringIO(), io.StringIO()
    codes: list[int] = []
    # The headless runner in a thread of this process: one interpreter fewer to start.
    run = threading.Thread(target=lambda: codes.append(run_headless(
        settings, out=out, err=err, log_path=str(tmp_path / "w.log"))), daemon=True)
    run.start()
    try:
        deadline = time.monotonic() + START_SECONDS
        while True:
            assert run.is_alive(), (out.getvalue(), err.getvalue())
            assert time.monotonic() < deadline, "the run never listed itself"
            try:
                record = find_run(runtime_folder(), None)
                break
            except LookupError:
                time.sleep(0.2)
        assert record.pid == os.getpid()
        client, settings = open_run(None, read_only=False)
        app = TuitrainApp(settings, worker_factory=lambda _: client, attached=True)
        async with app.run_test(size=(120, 40)) as pilot:
            while app.latest is None:
                assert app.failure is None, app.failure
                assert time.monotonic() < deadline, "no step came"
                await pilot.pause(0.1)
            # Paused, the run waits for the change at a step boundary, wherever it is.
            await pilot.press("space")
            while app.run_state != "paused":
                assert app.finished is None, "the run ended before the pause: make it longer"
                assert time.monotonic() < deadline, "the pause was never applied"
                await pilot.pause(0.05)
            await pilot.press("c")  # auto -> cuda
            while app.settings.engine.policy != "cuda":
                assert time.monotonic() < deadline, "the change was never applied"
                await pilot.pause(0.05)
            await pilot.press("space")  # resumed
            while app.run_state == "paused":
                assert time.monotonic() < deadline, "the run never resumed"
                await pilot.pause(0.05)
            assert app.run_state == "running", "the run ended before q: make it longer"
            await pilot.press("q")
        assert app.return_code == 0
        run.join(START_SECONDS)  # it trains on, undisturbed, to its last step
        assert not run.is_alive(), f"the run did not finish: {out.getvalue()[-600:]}"
    finally:
        if run.is_alive() and find_run(runtime_folder(), str(os.getpid())).live:
            stop_run(str(os.getpid()), yes=True, out=io.StringIO())  # a failed test's run
        run.join(120)
    assert codes == [0], err.getvalue()
    printed = out.getvalue()
    assert f"done: {STEPS} steps" in printed  # finished, not stopped
    assert "policy cuda (by viewer 1" in printed and "viewer 1" in printed
    assert "detached" in printed
    steps = [json.loads(line) for line in metrics.read_text().splitlines()
             if '"step"' in line and '"settings"' not in line]
    applied = [s["step"] for s in steps if "policy cuda" in s.get("applied", [])]
    assert len(applied) == 1 and 1 < applied[0] <= STEPS  # mid-run, at a step boundary
    assert all(s["policy"] == ("cuda" if s["step"] >= applied[0] else "auto") for s in steps)
    assert find_run(runtime_folder(), record.id).state == "finished"
