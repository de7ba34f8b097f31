"""`tuitrain tune` stopped as a headless run is stopped: Ctrl-C, a second Ctrl-C, SIGTERM and
a reader of its output that goes away, during its search and during the training with the
best after it. Each ends with the run's summary as the metrics' last line, the headless
run's exit status and lines, no preset, and nothing left behind: no process, no worker log.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest

from tests.tuitrain.fakeworker import fake_stats
from tests.tuitrain.test_headless import (
    START_SECONDS,
    _end,
    _ended,
    _records,
    _session_empties,
    _started,
    _until,
)
from tuitrain.events import Step, Stop
from tuitrain.stop_requests import Stopping, StopRequests
from tuitrain.tune_run import RunEnd, RunSteps

STOPPING = ("stopping: the step under way ends at its next layer, and nothing of it is kept "
            "(Ctrl-C again to stop now)")


class _Worker:
    """A worker as a tune's stop sees it, whose run goes on until a Stop ends it."""

    def __init__(self) -> None:
        self.sent: list = []
        self.ended: str | None = None
        self.result: str | None = None

    def send(self, command) -> int:
        self.sent.append(command)
        self.result = "stopped" if isinstance(command, Stop) else None
        return len(self.sent)

    def stop(self, timeout: float = 5.0) -> None:
        self.ended = "when it has stopped"

    def stop_now(self, *, keep_log: bool = False) -> None:
        self.ended = "at once"

    def wait(self, timeout: float) -> None:
        pass

    def poll(self) -> list:
        return []


class _Gone:
    """An output whose reader went away."""

    def reader_gone(self) -> bool:
        return True


def test_a_ctrl_c_sends_stop_a_second_ends_the_worker_at_once_and_sigterm_says_143():
    worker, said = _Worker(), []
    requests = StopRequests()
    stopping = Stopping(requests, worker, said.append)
    assert not stopping.look() and not stopping.asked and stopping.status() is None

    requests._on_sigint(signal.SIGINT, None)
    assert not stopping.look(), "the worker gets its time to stop"
    assert worker.sent == [Stop()] and said == [STOPPING] and stopping.status() == 130
    requests._on_sigint(signal.SIGINT, None)
    assert stopping.look() and worker.sent == [Stop()], "asked once, said once"
    stopping.end()
    assert worker.ended == "at once" and stopping.status() == 130

    requests._on_sigterm(signal.SIGTERM, None)
    assert stopping.status() == 143


def test_a_reader_gone_stops_the_tune_s_run_unless_its_last_step_is_in():
    """As a headless run: once the run's last step is reported it is ending as it is, and
    a reader that goes asks nothing; before it, the run stops as after a Ctrl-C."""
    worker, said, seen = _Worker(), [], RunSteps()
    requests = StopRequests((_Gone(),))
    ending = RunEnd(worker, Stopping(requests, worker, said.append), seen, lambda event: None,
                    last_step=3)
    seen.see(Step(fake_stats(3)))
    assert not ending.stopped() and worker.sent == [] and said == []

    seen, worker = RunSteps(), _Worker()
    ending = RunEnd(worker, Stopping(StopRequests((_Gone(),)), worker, said.append), seen,
                    lambda event: None, last_step=3)
    seen.see(Step(fake_stats(2)))
    assert ending.stopped() and worker.sent == [Stop()]
    assert said == ["stopping (nothing reads the output any more): the step under way ends "
                    "at its next layer, and nothing of it is kept"]
    ending.end()
    assert worker.ended == "when it has stopped" and ending.stopping.status() == 141


# --- in real processes, a tune and its worker: seconds to start each (slow) ---------------


def _tune_command(tmp_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tuitrain.cli", "tune", "tiny", "--seq-len", "16",
            "--precision", "fp32", "--metrics", str(tmp_path / "metrics.jsonl"), *extra]


def _environment(tmp_path: Path) -> dict[str, str]:
    """The tune's own temporary folder, where its worker's log goes: what is left there
    after it is what it left behind."""
    (tmp_path / "tmp").mkdir()
    return {**os.environ, "TMPDIR": str(tmp_path / "tmp")}


def _left_behind(tmp_path: Path) -> list[str]:
    folder = tmp_path / "tmp" / "tuitrain"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def _tune_until(tmp_path: Path, said: str, *extra: str
                ) -> tuple[subprocess.Popen, list[str], list[str], list[threading.Thread]]:
    """A tune started as test_headless._started starts a run, once a line of its output
    starts with `said`."""
    return _started(_tune_command(tmp_path, *extra), tmp_path, said, _environment(tmp_path))


def _worker(run: subprocess.Popen) -> psutil.Process:
    """The tune's worker: the process it spawned, not multiprocessing's resource tracker."""
    [worker] = [p for p in psutil.Process(run.pid).children()
                if "spawn_main" in " ".join(p.cmdline())]
    return worker


def _said(lines: list[str]) -> list[str]:
    return [line.rstrip("\n") for line in lines]


def _kinds(tmp_path: Path) -> list[str]:
    """The kind of each line of the metrics, in order ("step", "trial", "tuned", ...)."""
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    return [next(iter(json.loads(line))) for line in lines]


@pytest.mark.slow
@pytest.mark.parametrize("to", ["the tune", "its process group"])
def test_sigterm_while_the_best_trains_on_stops_at_once_with_the_summary(
        tmp_path: Path, to: str) -> None:
    """`kill PID`, or a batch system's time limit signalling every process of the job, once
    the search is over and the best trains on: the run stops at once, as after a second
    Ctrl-C, its summary made from the steps it reported; exit status 143 (128 + SIGTERM),
    one line, and the worker's log gone with it."""
    run, out, err, readers = _tune_until(tmp_path, "training on with it",
                                         "--steps", "100000", "--trial-steps", "3")
    with _ended(run, readers):
        if to == "the tune":
            os.kill(run.pid, signal.SIGTERM)
        else:
            os.killpg(run.pid, signal.SIGTERM)
        assert run.wait(timeout=30) == 143
    assert _left_behind(tmp_path) == []
    steps, summary = _records(tmp_path)
    assert summary["stopped"] and summary["stopped_now"]
    # The steps the tune was told of: the worker, ended at once, may have sent the last
    # without writing its line, or written the line of one it had not sent.
    assert abs(summary["last_step"] - steps[-1]["step"]) <= 1
    assert "tuned" in _kinds(tmp_path), "the search was over: its result stays"
    assert _said(err) == [
        f"stopped now after step {summary['last_step']}: the step under way was not kept; "
        f"metrics in {tmp_path / 'metrics.jsonl'}"]


@pytest.mark.slow
def test_ctrl_c_during_the_search_leaves_it_where_it_is_and_saves_no_preset(
        tmp_path: Path) -> None:
    """One Ctrl-C while a trial waits for its steps (a worker that cannot move, so the
    search is surely under way): the run stops cleanly, its step under way ending at its
    next layer, as a headless run's does; the search has no result (no `tuned` record), so
    no preset is saved, which the last line says; exit status 130."""
    preset = tmp_path / "tuned.yaml"
    run, out, err, readers = _tune_until(tmp_path, "tuning tiny", "--trial-steps", "30",
                                         "--save-preset", str(preset))
    with _ended(run, readers):
        worker = _worker(run)
        worker.suspend()
        os.killpg(run.pid, signal.SIGINT)
        _until(lambda: any(line.startswith("stopping:") for line in err), 30, "the stop")
        worker.resume()
        assert run.wait(timeout=60) == 130
    assert _left_behind(tmp_path) == []
    assert not preset.exists()
    _, summary = _records(tmp_path)
    assert summary["stopped"] and not summary.get("stopped_now")
    assert "tuned" not in _kinds(tmp_path)
    assert _said(err) == [
        STOPPING,
        f"interrupted after step {summary['last_step']}; metrics in "
        f"{tmp_path / 'metrics.jsonl'}; no preset saved to {preset} (the search was cut short)"]
    assert not any(line.startswith("tuned in") for line in out)


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_search_stops_at_once(tmp_path: Path) -> None:
    """Ctrl-C offers "Ctrl-C again to stop now": the second does that, with no wait for
    the step under way (a worker that cannot move at all), and it is no failure: exit
    status 130, the summary of the steps reported, with `stopped_now`."""
    run, out, err, readers = _tune_until(tmp_path, "tuning tiny", "--trial-steps", "30")
    with _ended(run, readers):
        _worker(run).suspend()
        os.killpg(run.pid, signal.SIGINT)
        _until(lambda: any(line.startswith("stopping:") for line in err), 30, "the first stop")
        os.killpg(run.pid, signal.SIGINT)
        assert run.wait(timeout=30) == 130
    assert _left_behind(tmp_path) == []
    steps, summary = _records(tmp_path)
    assert summary["stopped"] and summary["stopped_now"]
    last = summary.get("last_step", 0)  # the steps the tune was told of, as above
    assert abs(last - (steps[-1]["step"] if steps else 0)) <= 1
    assert "tuned" not in _kinds(tmp_path)
    head = (f"stopped now after step {last}: the step under way was not kept" if last
            else "stopped before its first step")  # a worker frozen before it made one
    assert _said(err) == [STOPPING, f"{head}; metrics in {tmp_path / 'metrics.jsonl'}"]


@pytest.mark.slow
@pytest.mark.parametrize("goes", ["in the search", "while the best trains on"])
def test_a_reader_that_goes_away_stops_the_tune_as_ctrl_c_does(tmp_path: Path,
                                                                goes: str) -> None:
    """`tuitrain tune ... | head -3`, whose lines come from the search; or a reader that
    goes while the best trains on, when the tune writes nothing that could fail: as a Unix
    tool ends when its reader goes, the run stops as Ctrl-C stops it, exit status 141, and
    stderr says so and nothing else."""
    read_end, write_end = os.pipe()
    if goes == "in the search":
        reader = subprocess.Popen(["head", "-3"], stdin=read_end, stdout=subprocess.PIPE)
    else:  # reads until the search is over, then goes
        script = ("import sys\nfor line in sys.stdin:\n"
                  "    if line.startswith('training on with it'): break")
        reader = subprocess.Popen([sys.executable, "-c", script], stdin=read_end)
    with (tmp_path / "err").open("w") as err:
        run = subprocess.Popen(
            _tune_command(tmp_path, "--steps", "100000", "--trial-steps", "3"),
            cwd=tmp_path, env=_environment(tmp_path), stdout=write_end, stderr=err,
            start_new_session=True)
    os.close(read_end)
    os.close(write_end)
    try:
        reader.communicate(timeout=START_SECONDS)
        assert run.wait(timeout=START_SECONDS) == 141  # 128 + SIGPIPE, as a shell says
    finally:
        _end(run, reader, session=run.pid)

    assert _session_empties(run.pid), "a process of the tune is still alive"
    assert _left_behind(tmp_path) == []
    _, summary = _records(tmp_path)
    assert summary["stopped"] and not summary.get("stopped_now")
    assert (tmp_path / "err").read_text().splitlines() == [  # no traceback, no noise
        "stopping (nothing reads the output any more): the step under way ends at its next "
        "layer, and nothing of it is kept",
        f"interrupted after step {summary['last_step']}; metrics in "
        f"{tmp_path / 'metrics.jsonl'}"]
    if goes == "while the best trains on":
        assert "tuned" in _kinds(tmp_path), "the search was over: its result stays"
