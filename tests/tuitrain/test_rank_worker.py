"""The ranks of a data-parallel run as the app sees them: two real gloo ranks of `tiny`,
started by DataParallelWorker, steered through rank 0 alone.

A change is applied by both ranks at the step its answer names (each rank's own StepStats
say so), a change an engine refuses leaves both as they were, q stops both at the same
step boundary with rank 0 writing the metrics, and a rank killed with SIGKILL is reported
as a failure naming it, the other rank ended.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from tuitrain.events import (
    Applied,
    Failed,
    Finished,
    RankStep,
    Rejected,
    SetBudget,
    SetMargin,
    Started,
    Step,
)
from tuitrain.rank_worker import DataParallelWorker
from tuitrain.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

START_SECONDS = 240.0  # a cold start imports torch and tokenises the corpus, twice at once
WAIT_SECONDS = 60.0


def settings(tmp_path) -> Settings:
    return Settings(
        model="tiny",
        engine={"precision": "fp32", "policy": "auto", "device_budget": "64MiB"},
        training={"steps": 1_000_000, "batch_size": 2, "seq_len": 16},
        logging={"metrics": str(tmp_path / "metrics.jsonl")},
    )


class Seen:
    """Every event polled so far, by kind: rank 0's steps and the other ranks'."""

    def __init__(self, worker: DataParallelWorker) -> None:
        self.worker = worker
        self.events: list = []

    def until(self, done, seconds: float = WAIT_SECONDS) -> None:
        deadline = time.monotonic() + seconds
        while not done():
            assert time.monotonic() < deadline, f"waited {seconds} s; saw {self.events[-5:]}"
            self.events.extend(self.worker.poll())
            time.sleep(0.05)

    def steps(self, rank: int) -> dict[int, object]:
        if rank == 0:
            return {e.stats.step: e.stats for e in self.events if isinstance(e, Step)}
        return {e.stats.step: e.stats for e in self.events
                if isinstance(e, RankStep) and e.rank == rank}

    def answer(self, command_id: int):
        return next((e for e in self.events if isinstance(e, Applied | Rejected)
                     and e.id == command_id), None)

    def first(self, kind: type):
        return next((e for e in self.events if isinstance(e, kind)), None)


def test_a_change_made_on_rank_0_is_applied_by_both_ranks_at_the_step_its_answer_names(tmp_path):
    worker = DataParallelWorker(settings=settings(tmp_path), nproc=2, log_dir=tmp_path)
    seen = Seen(worker)
    worker.start()
    try:
        seen.until(lambda: 2 in seen.steps(0) and 2 in seen.steps(1), START_SECONDS)
        started = seen.first(Started)
        assert started.ranks == 2 and "2 ranks (gloo)" in started.device

        margin = worker.send(SetMargin(margin_ratio=0.5))
        seen.until(lambda: seen.answer(margin) is not None)
        applied = seen.answer(margin)
        assert isinstance(applied, Applied) and applied.what == "margin_ratio 0.5"
        at = applied.step
        seen.until(lambda: at in seen.steps(0) and at in seen.steps(1))
        for rank in (0, 1):  # each rank's own stats and log: the same step took it
            steps = seen.steps(rank)
            assert steps[at - 1].margin_ratio == 0.0, rank
            assert steps[at].margin_ratio == 0.5 and "margin_ratio 0.5" in steps[at].applied
            log = worker.log_paths[rank].read_text()
            assert f"applied from step {at}: margin_ratio 0.5" in log, rank

        # Far below what a step needs: every engine refuses it, and none takes it.
        budget = worker.send(SetBudget(device_budget=64 * 1024))
        seen.until(lambda: seen.answer(budget) is not None)
        rejected = seen.answer(budget)
        assert isinstance(rejected, Rejected), rejected
        assert rejected.reason.startswith("rank 1: ")  # the first to check it, for all
        assert "refused by rank 1" in worker.log_paths[0].read_text()
        last = max(seen.steps(0))
        seen.until(lambda: last + 1 in seen.steps(0) and last + 1 in seen.steps(1))
        for rank in (0, 1):
            assert seen.steps(rank)[last + 1].device_budget == 64 * 1024**2

        worker.stop(timeout=30.0)
        seen.events.extend(worker.poll())
        finished = seen.first(Finished)
        assert finished is not None and finished.summary["stopped"], seen.events[-5:]
        assert not worker.alive
        assert seen.first(Failed) is None
    finally:
        worker.stop(timeout=5.0)
    # Rank 0 alone wrote the metrics: one line per step, the last the one both stopped after.
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [line["step"] for line in lines if "step" in line]
    assert steps == list(range(1, finished.summary["last_step"] + 1))
    assert max(seen.steps(1)) == finished.summary["last_step"]
    assert sorted(p.name.split("-")[0] for p in tmp_path.glob("rank*.log")) == ["rank0", "rank1"]


def test_the_run_records_the_ranks_it_ran_on_whatever_its_settings_said(tmp_path):
    """Each rank of `tuitrain run --nproc N` is started without the flag, so its settings
    say 1 rank: Started and the metrics' settings line say what ran."""
    worker = DataParallelWorker(settings=settings(tmp_path), nproc=2, log_dir=tmp_path)
    seen = Seen(worker)
    worker.start()
    try:
        seen.until(lambda: seen.first(Started) is not None, START_SECONDS)
    finally:
        worker.stop(timeout=30.0)
    assert seen.first(Started).settings["training"]["nproc"] == 2
    header = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert header["settings"]["training"]["nproc"] == 2


@pytest.mark.alone
def test_a_rank_killed_from_outside_is_a_failure_naming_it_and_the_other_rank_is_ended(tmp_path):
    worker = DataParallelWorker(settings=settings(tmp_path), nproc=2, log_dir=tmp_path)
    seen = Seen(worker)
    worker.start()
    try:
        seen.until(lambda: 1 in seen.steps(1), START_SECONDS)
        os.kill(worker.pids[1], signal.SIGKILL)
        killed_at = time.monotonic()
        seen.until(lambda: seen.first(Failed) is not None, 30.0)
        failed = seen.first(Failed)
        assert failed.rank == 1 and failed.exitcode == -signal.SIGKILL
        # The other rank is stopped, or it failed already in a collective waiting for rank 1
        # (the faster its start, the likelier): either way the reason says it ended.
        assert "signal 9" in failed.reason
        assert ("; the other rank was stopped" in failed.reason
                or "; the other rank ended with it" in failed.reason)
        assert time.monotonic() - killed_at < 5.0
        seen.until(lambda: not worker.alive, 10.0)  # ended, not left waiting in a collective
        assert seen.first(Finished) is None
        assert worker.poll() == []  # one failure reported, not one per rank
    finally:
        worker.stop(timeout=5.0)
