"""A worker stopped at once (a headless run's second Ctrl-C): its end is a stop, not a
failure. It is reported as a run stopped, with the summary its reported steps make, in the
shape of the one a worker gives when it stops by itself; a worker that died by itself first
is still a failure."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path

import pytest

from tests.tuitrain.forked_workers import worker_processes
from tuitrain.events import Event, Failed, Finished, Started, Step
from tuitrain.settings import Settings
from tuitrain.worker import ProcessWorker

pytestmark = pytest.mark.slow  # real worker processes (forked): a second or two each

START_SECONDS = 240.0


def tiny_settings(metrics: Path) -> Settings:
    return Settings(model="tiny", engine={"precision": "fp32", "policy": "auto"},
                    training={"steps": 1_000_000, "batch_size": 2, "seq_len": 16},
                    logging={"metrics": str(metrics)})


def follow(worker: ProcessWorker, events: list[Event], until, timeout: float = START_SECONDS
           ) -> None:
    deadline = time.monotonic() + timeout
    while not until():
        assert time.monotonic() < deadline, f"timed out; last events: {events[-3:]}"
        assert not any(isinstance(e, Failed) for e in events), events[-1]
        worker.wait(0.05)
        events.extend(worker.poll())


def steps_seen(events: list[Event]) -> list[int]:
    return [e.stats.step for e in events if isinstance(e, Step)]


def test_a_worker_stopped_at_once_is_a_stopped_run_summed_from_the_steps_it_reported(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its own log goes here
    worker = ProcessWorker(settings=tiny_settings(tmp_path / "now.jsonl"))
    events: list[Event] = []
    worker.start()
    follow(worker, events, lambda: len(steps_seen(events)) >= 3)
    worker.stop_now()
    events.extend(worker.poll())

    assert worker_processes() == []
    assert not any(isinstance(e, Failed) for e in events)
    [finished] = [e for e in events if isinstance(e, Finished)]
    summary = finished.summary
    seen = steps_seen(events)
    assert summary["stopped"] and summary["stopped_now"]
    assert summary["steps"] == len(seen) and summary["last_step"] == seen[-1]
    assert summary["tokens"] == 32 * len(seen)
    assert summary["metrics"] == str(tmp_path / "now.jsonl")
    assert list((tmp_path / "tuitrain").iterdir()) == [], "its log goes, as after a stop"

    # The shape of the summary a worker gives when it stops by itself.
    by_itself = ProcessWorker(settings=tiny_settings(tmp_path / "asked.jsonl"))
    events = []
    by_itself.start()
    follow(by_itself, events, lambda: bool(steps_seen(events)))
    by_itself.stop()
    [own] = [e for e in events + by_itself.poll() if isinstance(e, Finished)]
    assert set(own.summary) | {"stopped_now"} == set(summary)


def test_a_worker_stopped_at_once_before_it_started_leaves_an_earlier_runs_metrics(
        tmp_path: Path) -> None:
    """Its metrics file is begun once it has started; until then the file's last lines are
    an earlier run's, which this run's summary must not end."""
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"settings": {"model": "an earlier run"}}\n{"step": 1}\n')
    worker = ProcessWorker(settings=tiny_settings(metrics), log_path=tmp_path / "w.log")
    worker.start()
    worker.stop_now()
    events = worker.poll()

    assert not any(isinstance(e, Started) for e in events)
    [finished] = [e for e in events if isinstance(e, Finished)]
    assert finished.summary["stopped"] and finished.summary["metrics"] is None
    assert metrics.read_text() == '{"settings": {"model": "an earlier run"}}\n{"step": 1}\n'


def test_a_worker_that_died_by_itself_is_a_failure_though_stopped_at_once_after(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # its own log goes here
    worker = ProcessWorker(settings=tiny_settings(tmp_path / "m.jsonl"))
    events: list[Event] = []
    worker.start()
    follow(worker, events, lambda: bool(steps_seen(events)))
    os.kill(worker.pid, signal.SIGKILL)  # as the out-of-memory killer does
    deadline = time.monotonic() + 30
    while worker.exitcode is None:
        assert time.monotonic() < deadline
        worker.wait(0.05)
    worker.stop_now()
    events.extend(worker.poll())

    [failed] = [e for e in events if isinstance(e, Failed | Finished)]
    assert isinstance(failed, Failed) and failed.exitcode == -signal.SIGKILL
    assert worker.log_path.exists(), "kept: the failure report points to it"


def test_the_summary_is_a_line_of_its_own_after_a_line_the_worker_left_unfinished(
        tmp_path: Path) -> None:
    from tuitrain.metrics import latest_run
    from tuitrain.run_summary import record_summary

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"settings": {}}\n{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert record_summary({"steps": 1, "stopped": True, "metrics": str(metrics)}, []) is None

    lines = metrics.read_text().splitlines()
    assert lines[-2] == '{"step": 2, "lo' and json.loads(lines[-1])["summary"]["stopped"]
    assert [r["step"] for r in latest_run(metrics)] == [1]  # the broken line is skipped


def test_a_checkpoint_a_worker_was_writing_when_ended_at_once_goes_and_the_newest_is_named(
        tmp_path):
    """Ended mid-checkpoint, the worker leaves its temporary folder: it goes at once (it
    may be gigabytes), and what --resume would take is the newest complete checkpoint."""
    import subprocess
    import sys

    from tuitrain.checkpoint_folder import newest_after_a_kill

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    complete = tmp_path / "ck" / "step-000003"
    complete.mkdir(parents=True)
    (complete / "manifest.json").write_text("{}")
    unfinished = tmp_path / "ck" / f".step-000005.tmp-{dead}"
    unfinished.mkdir()
    (unfinished / "config.json").write_text("{}")
    assert newest_after_a_kill(tmp_path / "ck") == complete
    assert not unfinished.exists()
    assert newest_after_a_kill(tmp_path / "none") is None
