"""ProcessWorker: a real worker training `tiny`, steered and observed over its pipes.

Starting a worker costs seconds (a spawned child imports torch and transformers), so one
long run is shared by the tests that steer it, in the order they are written, and ended by
the last. That run is spawned, as the product starts its workers; the other tests' workers
are forked from the tests' server (tests/tuitrain/forked_workers.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from engine import format_size, parse_size
from tests.tuitrain.forked_workers import spawned, worker_processes
from tuitrain.errors import EXIT_BAD_INPUT
from tuitrain.events import (
    Applied,
    Checkpoint,
    Event,
    Failed,
    Finished,
    Pause,
    Rejected,
    Resume,
    SetBudget,
    SetMargin,
    SetPolicy,
    Started,
    Step,
)
from tuitrain.settings import Settings
from tuitrain.worker import ProcessWorker

pytestmark = pytest.mark.slow  # real worker processes: seconds to start each

# Generous: the machine is shared and a cold start imports torch and tokenises the corpus.
START_SECONDS = 240.0
EVENT_SECONDS = 60.0
GiB = 1024**3


def tiny_settings(**logging: object) -> Settings:
    return Settings(
        model="tiny",
        engine={"precision": "fp32", "policy": "auto"},
        training={"steps": 1_000_000, "batch_size": 2, "seq_len": 16},
        logging=logging,
    )


class Watch:
    """Collects every event of a worker and waits for the ones a test expects."""

    def __init__(self, worker: ProcessWorker) -> None:
        self.worker = worker
        self.events: list[Event] = []
        self.cursor = 0  # events before this one were already looked at by `until`

    def pump(self, seconds: float = 0.05) -> None:
        self.worker.wait(seconds)
        self.events.extend(self.worker.poll())

    def until(self, wanted: Callable[[Event], bool], timeout: float = EVENT_SECONDS) -> Event:
        """The next event (after the last one returned) that `wanted` accepts."""
        deadline = time.monotonic() + timeout
        while True:
            for index in range(self.cursor, len(self.events)):
                event = self.events[index]
                if wanted(event):
                    self.cursor = index + 1
                    return event
                if isinstance(event, Failed) and not wanted(event):
                    pytest.fail(f"worker failed: {event.reason}\n" + "\n".join(event.log_tail))
            self.cursor = len(self.events)
            if time.monotonic() > deadline:
                pytest.fail(f"no such event within {timeout} s; last: {self.events[-3:]}")
            self.pump()

    def answer(self, command_id: int) -> Applied | Rejected:
        return self.until(lambda e: isinstance(e, Applied | Rejected) and e.id == command_id)

    def step(self, number: int) -> Step:
        return self.until(lambda e: isinstance(e, Step) and e.stats.step >= number)

    def steps(self) -> dict[int, Step]:
        return {e.stats.step: e for e in self.events if isinstance(e, Step)}

    def next_step(self) -> Step:
        return self.until(lambda e: isinstance(e, Step))


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Watch]:
    folder = tmp_path_factory.mktemp("live")
    worker = ProcessWorker(
        settings=tiny_settings(metrics=str(folder / "metrics.jsonl")),
        log_path=folder / "worker.log",
    )
    with spawned():
        worker.start()
    try:
        watch = Watch(worker)
        watch.until(lambda e: isinstance(e, Started), timeout=START_SECONDS)
        watch.step(2)
        yield watch
    finally:
        worker.stop()


def test_started_names_the_model_the_device_and_the_settings_used(live: Watch) -> None:
    started = next(e for e in live.events if isinstance(e, Started))
    assert started.model == "tiny"
    assert started.parameters > 0
    # The default budget (6 GiB, less where this machine's memory has no room for it).
    budget = parse_size(started.settings["engine"]["device_budget"])
    assert 0 < budget <= 6 * GiB
    assert started.device == f"simulated, {format_size(budget)}"
    assert started.chunks, "the chunk map is known before the first step"
    assert started.pid == live.worker.pid != os.getpid()
    # The product's own start: a fresh interpreter, not a fork of the tests' server.
    assert "spawn_main" in " ".join(psutil.Process(started.pid).cmdline())
    assert started.log_path == str(live.worker.log_path)
    # the budget the engine runs with is written out, so the settings reproduce the run
    assert started.settings["training"]["seq_len"] == 16


def test_step_events_fill_latest_and_history(live: Watch) -> None:
    live.step(3)
    numbers = [stats.step for stats in live.worker.history]
    assert numbers == list(range(1, len(numbers) + 1))
    assert live.worker.latest is live.worker.history[-1]
    assert live.worker.latest.tokens == 2 * 16


def test_setting_changes_apply_from_the_next_step(live: Watch) -> None:
    started = next(e for e in live.events if isinstance(e, Started))
    default = parse_size(started.settings["engine"]["device_budget"])
    changes = {
        # command: (what StepStats shows, old value, new value, the engine's note)
        SetMargin(margin_ratio=0.25): ("margin_ratio", 0.0, 0.25, "margin"),
        SetPolicy(policy="cpu"): ("policy", "auto", "cpu", "policy"),
        SetBudget(device_budget="400MiB"): ("device_budget", default, 400 * 2**20,
                                            "device_budget"),
    }
    ids = {command: live.worker.send(command) for command in changes}
    assert sorted(ids.values()) == list(range(min(ids.values()), min(ids.values()) + 3))
    answers = {command: live.answer(i) for command, i in ids.items()}
    assert all(isinstance(a, Applied) for a in answers.values()), answers

    live.step(max(a.step for a in answers.values()) + 1)
    steps = live.steps()
    for command, (field, old, new, note) in changes.items():
        first = answers[command].step
        stats = steps[first].stats
        assert getattr(stats, field) == new, (command, stats)
        assert any(note in change for change in stats.applied), (command, stats.applied)
        assert getattr(steps[first + 1].stats, field) == new
        if first - 1 in steps:  # the step before ran with the old value
            assert getattr(steps[first - 1].stats, field) == old


def test_a_margin_outside_0_to_1_is_rejected_and_training_goes_on(live: Watch) -> None:
    answer = live.answer(live.worker.send(SetMargin(margin_ratio=1.5)))
    assert isinstance(answer, Rejected)
    assert "margin" in answer.reason
    after = live.next_step().stats.step
    assert live.step(after + 2).stats.margin_ratio == 0.25  # the last accepted value holds


def test_an_unknown_policy_is_rejected(live: Watch) -> None:
    answer = live.answer(live.worker.send(SetPolicy(policy="gpu")))
    assert isinstance(answer, Rejected)
    assert "policy" in answer.reason


def test_pause_holds_training_until_resume(live: Watch) -> None:
    paused = live.answer(live.worker.send(Pause()))
    assert isinstance(paused, Applied)
    time.sleep(1.0)
    live.pump()
    assert max(live.steps()) == paused.step, "no step runs while paused"
    assert isinstance(live.answer(live.worker.send(Pause())), Rejected)  # already paused

    resumed = live.answer(live.worker.send(Resume()))
    assert isinstance(resumed, Applied)
    assert resumed.step == paused.step
    assert live.step(paused.step + 1).stats.step == paused.step + 1
    assert isinstance(live.answer(live.worker.send(Resume())), Rejected)  # not paused


def test_a_checkpoint_without_a_folder_is_rejected(live: Watch) -> None:
    answer = live.answer(live.worker.send(Checkpoint()))
    assert isinstance(answer, Rejected)
    assert "--checkpoint-dir" in answer.reason
    live.step(live.next_step().stats.step + 1)


def test_stop_finishes_writes_metrics_and_leaves_no_process(live: Watch) -> None:
    worker = live.worker
    pid = worker.pid
    worker.stop()
    live.pump(0)
    finished = live.until(lambda e: isinstance(e, Finished), timeout=1)
    steps = live.steps()
    summary = finished.summary
    assert summary["steps"] == summary["last_step"] == max(steps) == len(steps)
    assert summary["stopped"] is True
    assert summary["tokens"] == 2 * 16 * len(steps)
    assert summary["peak_device_bytes"] > 0
    assert summary["peak_host_bytes"] > 0

    lines = Path(summary["metrics"]).read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert records[0]["settings"]["model"] == "tiny"
    assert [r["step"] for r in records[1:]] == sorted(steps)
    assert records[-1]["memory"]["chunks"], "each line carries the chunk list"

    assert not worker.alive
    assert not psutil.pid_exists(pid)
    assert worker_processes() == []
    worker.stop()  # idempotent
    late = worker.send(SetMargin(margin_ratio=0.5))
    assert worker.poll() == [Rejected(late, "the worker is not running")]


@pytest.mark.alone
def test_a_killed_worker_is_reported_within_a_second(tmp_path: Path) -> None:
    with ProcessWorker(settings=tiny_settings(), log_path=tmp_path / "worker.log") as worker:
        watch = Watch(worker)
        watch.until(lambda e: isinstance(e, Started), timeout=START_SECONDS)
        watch.step(1)
        os.kill(worker.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        while not any(isinstance(e, Failed) for e in watch.events):
            assert time.monotonic() - killed_at < 5, "the death went unnoticed"
            time.sleep(0.01)
            watch.events.extend(worker.poll())
        noticed = time.monotonic() - killed_at
        failed = next(e for e in watch.events if isinstance(e, Failed))
    assert noticed < 1.0
    assert failed.exitcode == -signal.SIGKILL
    assert "signal 9 (SIGKILL)" in failed.reason
    assert any("started" in line for line in failed.log_tail), failed.log_tail
    assert worker.result is failed
    assert worker_processes() == []


@pytest.mark.alone
def test_a_worker_whose_parent_dies_exits_too(tmp_path: Path) -> None:
    parent_program = textwrap.dedent(
        """
        import sys, time
        from tuitrain.events import Started
        from tuitrain.settings import Settings
        from tuitrain.worker import ProcessWorker

        settings = Settings.model_validate_json(sys.argv[1])
        worker = ProcessWorker(settings=settings, log_path=sys.argv[2])
        worker.start()
        while not any(isinstance(event, Started) for event in worker.poll()):
            worker.wait(0.1)
        print(worker.pid, flush=True)
        time.sleep(600)
        """
    )
    log = tmp_path / "worker.log"
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_program, tiny_settings().model_dump_json(), str(log)],
        stdout=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
    )
    try:
        worker_pid = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()
    died_at = time.monotonic()
    while _running(worker_pid):
        assert time.monotonic() - died_at < 5, "the worker outlived its parent"
        time.sleep(0.05)
    # Whichever noticed first: the watcher thread, or the loop finding the channel closed.
    text = log.read_text()
    assert "the parent process is gone" in text or "the command channel closed" in text


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def run_to_its_end(settings: Settings) -> tuple[ProcessWorker, Event]:
    """A worker with a log of its own naming, run until it finishes or fails, stopped."""
    with ProcessWorker(settings=settings) as worker:
        watch = Watch(worker)
        ended = watch.until(lambda e: isinstance(e, Finished | Failed), timeout=START_SECONDS)
        assert worker.log_path.exists()  # there to read while the run lasts
    return worker, ended


def test_a_run_that_finishes_leaves_no_log_behind(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    settings = tiny_settings().model_copy(update={"training": tiny_settings().training
                                                  .model_copy(update={"steps": 1})})
    worker, ended = run_to_its_end(settings)
    assert isinstance(ended, Finished)
    assert worker.log_path.parent == tmp_path / "tuitrain"
    assert list((tmp_path / "tuitrain").iterdir()) == []
    # Stopped when asked to (the app's q, the first Ctrl-C of a headless run): as clean.
    with ProcessWorker(settings=tiny_settings()) as stopped:
        Watch(stopped).step(1)
    assert isinstance(stopped.result, Finished) and stopped.result.summary["stopped"]
    assert list((tmp_path / "tuitrain").iterdir()) == []


def test_a_log_the_caller_names_is_kept_unless_it_is_the_workers_own(tmp_path: Path) -> None:
    """A log path given by the caller is the caller's file; one named for a worker (a
    data-parallel rank's, `own_log`) goes after a clean end as a default one does."""
    settings = tiny_settings().model_copy(update={"training": tiny_settings().training
                                                  .model_copy(update={"steps": 1})})
    for own, kept in ((False, True), (True, False)):
        log = tmp_path / f"rank0-{own}.log"
        with ProcessWorker(settings=settings, log_path=log, own_log=own) as worker:
            ended = Watch(worker).until(lambda e: isinstance(e, Finished | Failed),
                                        timeout=START_SECONDS)
        assert isinstance(ended, Finished)
        assert log.exists() == kept


def test_a_mistake_in_the_input_leaves_no_log_behind(tmp_path: Path, monkeypatch) -> None:
    """Bad input the worker alone can find (a budget below the working set) is told by its
    reason in full; its log, a traceback behind that line, is not kept."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    settings = Settings(model="tiny", engine={"precision": "fp32", "device_budget": "1KiB"},
                        training={"batch_size": 2, "seq_len": 16})
    worker, ended = run_to_its_end(settings)
    assert isinstance(ended, Failed) and ended.exitcode == EXIT_BAD_INPUT, ended
    assert list((tmp_path / "tuitrain").iterdir()) == []


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_run_that_fails_keeps_the_log_its_report_points_to(tmp_path: Path,
                                                              monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    worker, ended = run_to_its_end(tiny_settings(metrics="/dev/full"))
    assert isinstance(ended, Failed)
    assert "No space left on device" in worker.log_path.read_text()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_an_error_after_start_reaches_the_client_with_the_log_tail(tmp_path: Path) -> None:
    # /dev/full accepts the open and fails every write: the disk filling up mid-run.
    settings = tiny_settings(metrics="/dev/full")
    with ProcessWorker(settings=settings, log_path=tmp_path / "worker.log") as worker:
        watch = Watch(worker)
        watch.until(lambda e: isinstance(e, Started), timeout=START_SECONDS)
        failed = watch.until(lambda e: isinstance(e, Failed))
        worker.stop()
    assert failed.reason == "OSError: [Errno 28] No space left on device"
    assert failed.exitcode == 1
    assert any(line.startswith("Traceback") for line in failed.log_tail), failed.log_tail
    assert "No space left on device" in failed.log_tail[-1]
    assert worker.exitcode == 1
    assert worker_processes() == []


def test_a_worker_ended_by_the_jobs_sigterm_after_its_run_finished_needs_no_log() -> None:
    """A SIGTERM to the whole job (a batch system's end) that reaches the worker as it exits
    after reporting its run finished: that end is no failure, and its log holds nothing
    anyone needs, so it goes as after any clean end. Before its run finished, a death by
    SIGTERM nobody asked for still keeps the log."""
    from types import SimpleNamespace

    worker = ProcessWorker(settings=Settings(model="tiny"))
    worker._process = SimpleNamespace(exitcode=-signal.SIGTERM)
    worker.result = Finished(summary={"steps": 3})
    assert worker._log_unneeded()
    worker.result = None
    assert not worker._log_unneeded()
    # Stopped at once (stop_now) after its death by that SIGTERM was seen: ended as asked.
    worker._ended_now = True
    worker.result = Failed(reason="worker exited with signal 15", exitcode=-signal.SIGTERM)
    assert worker._log_unneeded()
    worker.result = Failed(reason="out of memory", exitcode=1)  # its own failure: kept
    assert not worker._log_unneeded()
