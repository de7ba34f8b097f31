"""A rank killed with SIGKILL in a data-parallel run: the run stops, saying which rank, and
`--resume` from its last checkpoint goes on exactly.

Through the real command: `tuitrain run tiny --nproc 2 --headless` with checkpoints every
two steps; once the first is written, rank 1's worker (the process that trains, which the
out-of-memory killer would pick) gets SIGKILL. The launcher must exit non-zero well within
the ranks' collective timeout, its last line naming rank 1 as the rank that failed first;
the newest complete checkpoint then resumes on two ranks with the losses of one process
that never stopped (fp32, 1e-5).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.distributed.collectives import DEFAULT_TIMEOUT
from tuitrain.checkpoint import find_checkpoint, step_folder
from tuitrain.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--headless", "--batch-size", "6", "--seq-len", "16", "--precision", "fp32",
         "--device-mem", "64MiB", "--seed", "3"]
TOL = 1e-5
# The ranks' collectives wait up to DEFAULT_TIMEOUT (600 s: --collective-timeout is not
# given). A dead rank must not cost that: its own run reports its worker's death within a
# second and exits, the launcher then stops the others; its connections closing fails
# the survivors' collectives at once. So the bound is a small fraction of the timeout.
STOP_BOUND = 30.0
assert STOP_BOUND < DEFAULT_TIMEOUT / 10
START_DEADLINE = 150.0  # seconds for the ranks to start and write their first checkpoint


def command(*args: str) -> list[str]:
    script = Path(sys.executable).with_name("tuitrain")
    entry = [str(script)] if script.is_file() else [sys.executable, "-m", "tuitrain"]
    return [*entry, "run", "tiny", "--nproc", "2", *FLAGS, *args]


def environment(tmp: Path) -> dict[str, str]:
    return {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}


def losses_in(metrics: Path) -> dict[int, float]:
    import json

    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    return {line["step"]: line["loss"] for line in lines if "step" in line}


def one_process(steps: int) -> list[float]:
    """The run as one process trains it, here, with the worker's own building."""
    from tuitrain.run_build import build_run

    settings = Settings(model="tiny", engine={"precision": "fp32", "device_budget": "64MiB"},
                        training={"batch_size": 6, "seq_len": 16, "seed": 3, "steps": steps})
    built = build_run(settings, lambda message: None)
    batches = iter(built.data)
    losses = [built.engine.step(next(batches)).loss for _ in range(steps)]
    built.engine.close()
    return losses


def worker_pid(tmp: Path, rank: int) -> int:
    """The pid of rank `rank`'s worker, from the first line of its log."""
    for log in (tmp / "tuitrain").glob(f"rank{rank}-*.log"):
        found = re.search(r"tuitrain worker pid (\d+) started", log.read_text())
        if found:
            return int(found.group(1))
    raise AssertionError(f"no log of rank {rank}'s worker in {tmp / 'tuitrain'}")


def test_a_rank_killed_with_sigkill_stops_the_run_and_resume_goes_on_exactly(tmp_path):
    ck, killed_metrics, resumed_metrics = (tmp_path / "ck", tmp_path / "killed.jsonl",
                                           tmp_path / "resumed.jsonl")
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        run = subprocess.Popen(
            command("--steps", "1000", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                    "--metrics", str(killed_metrics)),
            cwd=ROOT, env=environment(tmp_path), stdout=out, stderr=err)
        try:
            deadline = time.monotonic() + START_DEADLINE
            while not step_folder(ck, 2).is_dir():
                assert run.poll() is None, (tmp_path / "err").read_text()[-3000:]
                assert time.monotonic() < deadline, "no checkpoint in time"
                time.sleep(0.05)
            os.kill(worker_pid(tmp_path, 1), signal.SIGKILL)
            killed = time.monotonic()
            status = run.wait(timeout=STOP_BOUND)
            stopped = time.monotonic() - killed
        finally:
            if run.poll() is None:
                run.kill()
                run.wait()
    stderr = (tmp_path / "err").read_text()
    assert status != 0
    print(f"the launcher exited {stopped:.1f} s after the kill, status {status}")
    last = stderr.strip().splitlines()[-1]
    # Rank 1 alone is named, whether rank 0's collectives failed first (the connection to
    # rank 1 reset) or the launcher stopped it: rank 1's worker was killed, the cause.
    assert last == ("tuitrain: rank 1 of 2 failed first (exit status 1); the other rank was "
                    "stopped because of it")
    assert "rank 1: training failed: worker exited with signal 9 (SIGKILL)" in stderr

    newest = find_checkpoint(ck)  # the newest complete one: never one cut short
    saved = int(newest.name.removeprefix("step-"))
    assert saved >= 2 and saved % 2 == 0
    steps = saved + 2
    expected = one_process(steps)
    before = losses_in(killed_metrics)
    assert [before[s] for s in range(1, saved + 1)] == pytest.approx(expected[:saved], rel=TOL)

    resumed = subprocess.run(
        command("--steps", str(steps), "--resume", str(ck), "--metrics", str(resumed_metrics)),
        cwd=ROOT, env=environment(tmp_path), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = losses_in(resumed_metrics)
    assert sorted(after) == [saved + 1, saved + 2]
    assert [after[saved + 1], after[saved + 2]] == pytest.approx(expected[saved:], rel=TOL)
