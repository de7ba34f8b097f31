"""A rank that stops answering (it hangs, it does not die) in a data-parallel run: the others
fail once --collective-timeout has passed, not after the default 600 s, naming the
operation they waited in and their rank, and the launcher names the rank that failed first.

Through the real command: `tuitrain run tiny --nproc 2 --headless --collective-timeout 4`;
once rank 0 has trained two steps, rank 1's worker gets SIGSTOP. Its connections stay open,
so only the timeout can tell rank 0 that it is gone. The stopped worker does not outlive
the launcher.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from rank_launch import worker_pid

from engine.distributed.collectives import DEFAULT_TIMEOUT

# alone: a rank starved of the CPU by a test beside it would look hung to its peer.
pytestmark = [pytest.mark.slow, pytest.mark.alone, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT = 4.0  # --collective-timeout: long enough for two ranks starting side by side
# After the timeout, rank 0 reports at once; its run, then the launcher, end soon after.
REPORT_BOUND = TIMEOUT + 5.0
EXIT_BOUND = TIMEOUT + 25.0
assert EXIT_BOUND < DEFAULT_TIMEOUT / 10
START_DEADLINE = 150.0  # seconds for the ranks to start and train two steps


class Lines:
    """A stream's lines as they come, each with when it came (time.monotonic())."""

    def __init__(self, stream) -> None:
        self.seen: list[tuple[float, str]] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.seen.append((time.monotonic(), line.rstrip("\n")))

    def first(self, pattern: str) -> tuple[float, str] | None:
        return next(((t, line) for t, line in self.seen if re.search(pattern, line)), None)

    def text(self) -> str:
        self._thread.join(timeout=5)
        return "\n".join(line for _, line in self.seen)


def test_a_rank_that_hangs_fails_the_others_within_the_collective_timeout(tmp_path):
    script = Path(sys.executable).with_name("tuitrain")
    entry = [str(script)] if script.is_file() else [sys.executable, "-m", "tuitrain"]
    command = [*entry, "run", "tiny", "--nproc", "2", "--headless", "--batch-size", "2",
               "--seq-len", "16", "--precision", "fp32", "--device-mem", "64MiB",
               "--steps", "100000", "--collective-timeout", str(TIMEOUT)]
    env = {**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    run = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    out, err = Lines(run.stdout), Lines(run.stderr)
    hung = None
    try:
        deadline = time.monotonic() + START_DEADLINE
        while out.first(r"^step [2-9]\d*/") is None:
            assert run.poll() is None, err.text()[-3000:]
            assert time.monotonic() < deadline, "no second step in time"
            time.sleep(0.05)
        hung = worker_pid(tmp_path, 1)
        os.kill(hung, signal.SIGSTOP)
        stopped = time.monotonic()
        status = run.wait(timeout=EXIT_BOUND)
        ended = time.monotonic() - stopped
        left = psutil.pid_exists(hung) and psutil.Process(hung).status() != "zombie"
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
        if hung is not None and psutil.pid_exists(hung):
            os.kill(hung, signal.SIGKILL)  # a stopped process outlives its parent
    stderr = err.text()
    assert status == 1, stderr[-3000:]
    assert not left, "the hung rank's worker outlived the launcher"
    failed = err.first(r"^training failed: ")
    assert failed is not None, stderr[-3000:]
    reported = failed[0] - stopped
    print(f"rank 0 reported {reported:.1f} s after the SIGSTOP, the launcher exited after "
          f"{ended:.1f} s (timeout {TIMEOUT:g} s)")
    # The timeout is what told rank 0, and nothing waited longer than it.
    assert TIMEOUT * 0.9 <= reported <= REPORT_BOUND
    assert re.fullmatch(
        r"training failed: CollectiveError: rank 0 of 2: (all-gather|reduce-scatter|all-reduce|"
        r"all-gather of rows) of (chunk \d+|an agreement between the ranks) timed out after "
        r"4 s \(another rank died, or issued different collectives: every rank must run the "
        r"same modules in the same order\)", failed[1]), failed[1]
    # Rank 1 never failed by itself: the launcher stopped it because rank 0 failed.
    assert "rank 1: training failed" not in stderr
    assert stderr.strip().splitlines()[-1] == (
        "tuitrain: rank 0 of 2 failed first (exit status 1); the other rank was stopped "
        "because of it")
