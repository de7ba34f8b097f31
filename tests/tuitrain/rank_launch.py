"""Starting `tuitrain run tiny` on several ranks from a test, and reading back what the ranks
left: the command as a user types it, its environment, the metrics file, the ranks' logs,
and the run one process trains on the same global batches (the reference).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tuitrain.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--headless", "--batch-size", "6", "--seq-len", "16", "--precision", "fp32",
         "--device-mem", "64MiB", "--seed", "3", "--eval-fraction", "0.05", "--eval-batches", "2"]
TOL = 1e-5  # fp32: the ranks' reduce-scatter sums in another order than one backward


def tuitrain(*args: str) -> list[str]:
    """`tuitrain ARGS` as the installed command (not `python -m`: see tuitrain.launch)."""
    script = Path(sys.executable).with_name("tuitrain")
    entry = [str(script)] if script.is_file() else [sys.executable, "-m", "tuitrain"]
    return [*entry, *args]


def launched(nproc: int, *args: str) -> list[str]:
    """The ranks started by tuitrain itself: `tuitrain run tiny --nproc N FLAGS ARGS`."""
    return tuitrain("run", "tiny", "--nproc", str(nproc), *FLAGS, *args)


def environment(tmp: Path) -> dict[str, str]:
    """The test's environment with TMPDIR `tmp`, where the ranks' logs go (tmp/tuitrain)."""
    return {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}


def run(command: list[str], tmp: Path) -> subprocess.CompletedProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.run(command, cwd=ROOT, env=environment(tmp), capture_output=True,
                          text=True, timeout=240)


def losses_in(metrics: Path) -> tuple[dict[int, float], dict[int, float]]:
    """(loss per step, held-out loss per step evaluated after) from a metrics file."""
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = {line["step"]: line["loss"] for line in lines if "step" in line}
    evals = {line["eval"]["step"]: line["eval"]["loss"] for line in lines if "eval" in line}
    return steps, evals


def rank_logs(tmp: Path) -> list[str]:
    """"rank<R>" of each rank's log the ranks of a launch with TMPDIR `tmp` wrote."""
    return sorted(p.name.split("-")[0] for p in (tmp / "tuitrain").glob("rank*.log"))


def worker_pid(tmp: Path, rank: int) -> int:
    """The pid of rank `rank`'s worker, from the first line of its log."""
    for log in (tmp / "tuitrain").glob(f"rank{rank}-*.log"):
        found = re.search(r"tuitrain worker pid (\d+) started", log.read_text())
        if found:
            return int(found.group(1))
    raise AssertionError(f"no log of rank {rank}'s worker in {tmp / 'tuitrain'}")


def one_process(steps: int, evaluated: tuple[int, ...] = ()) -> tuple[list[float],
                                                                     dict[int, float]]:
    """The run as one process trains it, in this process with the worker's own building:
    its losses over `steps` steps, and its held-out loss after each step of `evaluated`
    (scored as the worker does)."""
    from tuitrain.run_build import build_run

    settings = Settings(model="tiny", engine={"precision": "fp32", "device_budget": "64MiB"},
                        training={"batch_size": 6, "seq_len": 16, "seed": 3, "steps": steps,
                                  "eval_batches": 2},
                        data={"eval_fraction": 0.05})
    built = build_run(settings, lambda message: None)
    batches = iter(built.data)
    losses, evals = [], {}
    for step in range(1, steps + 1):
        losses.append(built.engine.step(next(batches)).loss)
        if step in evaluated:
            scored = [(built.engine.evaluate(b), b["input_ids"].shape)
                      for b in built.eval_data.batches]
            evals[step] = (sum(loss * r * (c - 1) for loss, (r, c) in scored)
                           / sum(r * (c - 1) for _, (r, c) in scored))
    built.engine.close()
    return losses, evals
