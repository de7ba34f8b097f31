"""A run leaves nothing of itself in its scratch folder, however it ends short of a kill -9
of its worker (which the next start cleans): done, failed, or its worker terminated. And
it reports the disk writes of its last step's update, which still runs when the step
returns (optimizer state on disk)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from engine.placement import disk_rules
from engine.step.engine import Engine
from tuitrain.events import Failed, Finished, Started, Step
from tuitrain.settings import Settings
from tuitrain.training_run import TrainingRun
from tuitrain.worker import ProcessWorker

START_SECONDS = 240.0


class Sink(list):
    def put(self, event) -> None:
        self.append(event)


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process runs: pieces of disk I/O small enough for tiny whatever the sizing."""
    monkeypatch.setattr(disk_rules, "DISK_PIECE", 2**14)


def settings(disk: Path, steps: int = 2) -> Settings:
    # 9 MiB of host for tiny's 10 MiB of chunk bytes: optimizer state on disk, so that
    # each step's update overlaps the next step.
    return Settings(
        model="tiny",
        engine={"precision": "fp32", "policy": "cpu", "device_budget": "64MiB",
                "host_budget": "9MiB", "disk_dir": str(disk)},
        training={"steps": steps, "batch_size": 2, "seq_len": 16},
    )


def execute(tmp_path: Path, s: Settings) -> tuple[int, Sink]:
    commands, _ = multiprocessing.Pipe(duplex=False)
    sink = Sink()
    run = TrainingRun(settings=s, log_path=str(tmp_path / "log"), commands=commands,
                      outbox=sink)
    return run.execute(), sink


def leftovers(disk: Path) -> list[Path]:
    return list(disk.rglob("*")) if disk.exists() else []


def test_a_finished_run_leaves_nothing_and_reports_its_last_updates_writes(
        tmp_path, monkeypatch, small_pieces):
    written: list[int] = []  # the tier's own count: before the first step, at the end
    step, finish = Engine.step, getattr(Engine, "finish_update", None)

    def first(self, batch):
        if not written:
            written.append(self.manager.spill.tier.bytes_written)
        return step(self, batch)

    def last(self):
        tail = finish(self)
        written.append(self.manager.spill.tier.bytes_written)
        return tail

    monkeypatch.setattr(Engine, "step", first)
    monkeypatch.setattr(Engine, "finish_update", last, raising=False)
    disk = tmp_path / "scratch"
    code, sink = execute(tmp_path, settings(disk))
    assert code == 0
    assert leftovers(disk) == []
    steps = [e.stats for e in sink if isinstance(e, Step)]
    assert len(steps) == 2 and all(s.memory.disk_model for s in steps)
    summary = next(e for e in sink if isinstance(e, Finished)).summary
    # The last update's writes come after the last step's report, and are counted in it.
    assert summary["bytes_disk_written"] == sum(s.bytes_disk_written for s in steps)
    assert summary["bytes_disk_written"] == written[1] - written[0]


def test_a_failed_run_leaves_nothing(tmp_path, monkeypatch, small_pieces):
    step = Engine.step

    def fails_second(self, batch):
        if self.step_count == 1:
            raise RuntimeError("broken on purpose")
        return step(self, batch)

    monkeypatch.setattr(Engine, "step", fails_second)
    disk = tmp_path / "scratch"
    code, sink = execute(tmp_path, settings(disk))
    assert code == 1
    assert any(isinstance(e, Failed) for e in sink)
    assert leftovers(disk) == []


@pytest.mark.slow  # a real worker process
def test_a_terminated_worker_leaves_nothing(tmp_path):
    disk = tmp_path / "scratch"
    with ProcessWorker(settings=settings(disk, steps=1_000_000),
                       log_path=tmp_path / "worker.log") as worker:
        deadline = time.monotonic() + START_SECONDS
        seen: list = []
        while not any(isinstance(e, Step) for e in seen):
            assert time.monotonic() < deadline
            worker.wait(0.1)
            seen.extend(worker.poll())
        assert any(isinstance(e, Started) for e in seen)
        assert any(p.name.startswith("run-") for p in disk.iterdir())
        os.kill(worker.pid, signal.SIGTERM)
        ended = time.monotonic()
        while worker.exitcode is None:
            assert time.monotonic() - ended < 30
            time.sleep(0.05)
    assert worker.exitcode == -signal.SIGTERM
    assert leftovers(disk) == []
