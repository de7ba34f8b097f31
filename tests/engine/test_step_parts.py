"""benchmarks/step_parts.py: a settled step's time in the engine's hooks, by function, by
the wall clock. Its dry run times every hook (they are wrapped before the engine installs
them as bound methods) and puts every wrapped function back."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_dry_run_times_every_hook_and_the_copies():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "step_parts.py"),
                           "--dry-run", "--threads", "1"],
                          capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    first, *rows = done.stdout.splitlines()
    hooks = float(re.search(r"in the hooks ([\d.]+) ms", first).group(1))
    assert hooks > 0
    timed = {line.split()[0]: line.split()[1:] for line in rows[1:]}
    for hook in ("StepRunner._pre_forward", "StepRunner._post_forward",
                 "StepRunner._pre_backward", "GradientArrivals._take"):
        kind, ms, calls = timed[hook]
        assert kind == "hook" and float(ms) > 0 and float(calls) > 0
    assert float(timed["SimulatedDevice.copy"][2]) > 0  # cpu's gradients go home
