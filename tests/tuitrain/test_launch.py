"""The launcher's last line: which rank failed first, of those torchrun's agent reports.

Each case is the agent's own record of the ranks' ends (ProcessFailure, which reads the
error file each rank that failed by itself writes with tuitrain.ranks.record_failure).
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from tuitrain.launch import ended_with, failure_line, first_failure
from tuitrain.ranks import ERROR_FILE_ENV, record_failure


def ended(tmp_path, rank: int, exitcode: int, *, killed: bool | None = None) -> ProcessFailure:
    """Rank `rank`'s end as the agent sees it: with the record the rank wrote when it failed
    by itself (`killed`: whether its worker was killed by a signal), none when it was
    killed or stopped (`killed` None)."""
    error_file = tmp_path / f"error-{rank}.json"
    if killed is not None:
        record_failure(f"rank {rank}: training failed", killed=killed,
                       env={ERROR_FILE_ENV: str(error_file)})
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode,
                          error_file=str(error_file))


def test_a_rank_whose_worker_was_killed_failed_first_though_another_said_so_earlier(tmp_path):
    rank0 = ended(tmp_path, 0, 1, killed=False)  # its collectives lost rank 1
    time.sleep(0.01)
    rank1 = ended(tmp_path, 1, 1, killed=True)
    assert first_failure({0: rank0, 1: rank1})[0] == 1
    # torchrun reads the same record: the message, and when.
    assert rank1.message == "rank 1: training failed"
    assert abs(rank1.timestamp - time.time()) < 5


def test_of_ranks_that_failed_by_themselves_the_one_that_saw_it_first(tmp_path):
    rank2 = ended(tmp_path, 2, 1, killed=False)
    time.sleep(0.01)
    rank0, rank1 = ended(tmp_path, 0, 1, killed=False), ended(tmp_path, 1, 1, killed=False)
    assert first_failure({0: rank0, 1: rank1, 2: rank2})[0] == 2


def test_a_rank_killed_from_outside_failed_first_one_stopped_by_the_launcher_did_not(tmp_path):
    rank0 = ended(tmp_path, 0, 1, killed=False)
    rank1 = ended(tmp_path, 1, -signal.SIGKILL)  # no word from it: it was killed
    assert first_failure({0: rank0, 1: rank1})[0] == 1
    stopped = ended(tmp_path, 1, -signal.SIGTERM)  # the launcher's SIGTERM, after rank 0
    assert first_failure({0: rank0, 1: stopped})[0] == 0
    # A rank that ended badly by itself without a word still counts before a stopped one.
    crashed = ended(tmp_path, 2, 1)
    assert first_failure({1: stopped, 2: crashed})[0] == 2


def test_when_every_rank_was_ended_from_outside_the_first_seen_then_the_lowest(tmp_path):
    rank0, rank1 = ended(tmp_path, 0, -signal.SIGTERM), ended(tmp_path, 1, -signal.SIGTERM)
    rank0.timestamp = rank1.timestamp = 1_000
    assert first_failure({1: rank1, 0: rank0})[0] == 0
    rank0.timestamp = 1_001
    assert first_failure({1: rank1, 0: rank0})[0] == 1


def test_a_rank_stopped_after_it_recorded_its_failure_ended_with_its_own_status(tmp_path):
    # Rank 1's worker was killed; before rank 1 exited with status 1, rank 0 (whose
    # collectives lost rank 1) ended, and the launcher stopped rank 1 with SIGTERM.
    rank0 = ended(tmp_path, 0, 1, killed=False)
    rank1 = ended(tmp_path, 1, -signal.SIGTERM, killed=True)
    rank, failure = first_failure({0: rank0, 1: rank1})
    assert (rank, ended_with(failure)) == (1, 1)
    assert ended_with(ended(tmp_path, 2, -signal.SIGTERM)) == -signal.SIGTERM  # no record
    assert ended_with(ended(tmp_path, 3, -signal.SIGKILL, killed=False)) == -signal.SIGKILL


def test_the_line_names_the_first_rank_how_it_ended_and_the_others():
    assert failure_line(1, 1, 2, 1) == (
        "rank 1 of 2 failed first (exit status 1); the other rank was stopped because of it")
    assert failure_line(0, -9, 3, 2) == (
        "rank 0 of 3 failed first (killed by SIGKILL); the other 2 ranks were stopped "
        "because of it")
    assert failure_line(2, 1, 3, 0) == "rank 2 of 3 failed (exit status 1)"


def test_a_preset_saved_from_n_ranks_runs_on_n_ranks_without_nproc(tmp_path, monkeypatch):
    from tuitrain import cli, launch

    started: list[int] = []

    def launched(nproc, argv, *, batch_size, err=None) -> int:  # the ranks, not started
        started.append(nproc)
        if used := os.environ.get(launch.USED_SETTINGS_ENV):  # rank 0 says what it used
            settings = cli.resolve_settings(cli.build_parser().parse_args(["run", *argv]))
            Path(used).write_text(json.dumps(settings.model_dump(mode="json")))
        return 0

    monkeypatch.setattr(launch, "launch", launched)
    monkeypatch.setenv("TUITRAIN_CONFIG", str(tmp_path / "config"))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    preset = tmp_path / "p.yaml"
    assert cli.main(["run", "tiny", "--headless", "--nproc", "2", "--batch-size", "4",
                     "--steps", "1", "--save-preset", str(preset)]) == 0
    assert cli.main(["run", "--preset", str(preset), "--headless"]) == 0
    assert started == [2, 2]
    assert cli.main(["run", "--preset", str(preset), "--headless", "--nproc", "1"]) == 0
    assert started[-1] == 1  # --nproc given wins
