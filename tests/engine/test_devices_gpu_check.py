"""benchmarks/gpu_check.sh says when it could not check, and never hides a failure.

No GPU is needed: the script's two hooks point it at a stand-in nvidia-smi and a stand-in
Python whose answers each test scripts.
"""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.sh"


def executable(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "GPU_CHECK_OUT": str(tmp_path / "out"), **env})


def fake_gpu(tmp_path: Path) -> Path:
    return executable(tmp_path / "nvidia-smi", 'echo "Fake GPU, 8192 MiB, 550.00"\n')


def fake_python(tmp_path: Path, fail_on: str | None = None) -> Path:
    """A 'python' that answers every check, and fails the one whose command has `fail_on`."""
    failing = f'case "$*" in *{fail_on}*) echo "1 failed, 13 passed in 1.0s"; exit 1;; esac\n'
    return executable(tmp_path / "python", (failing if fail_on else "") + 'echo "fine: $*"\n')


def test_without_a_gpu_it_says_so_in_one_line_and_fails(tmp_path):
    done = run(tmp_path, GPU_CHECK_NVIDIA_SMI=str(tmp_path / "no-such-nvidia-smi"))
    assert done.returncode != 0
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "no NVIDIA GPU" in lines[0]


def test_a_failing_check_stops_the_run_with_a_non_zero_status(tmp_path):
    done = run(tmp_path, GPU_CHECK_NVIDIA_SMI=str(fake_gpu(tmp_path)),
               GPU_CHECK_PYTHON=str(fake_python(tmp_path, fail_on="pytest")))
    assert done.returncode != 0
    assert "ok setup" in done.stdout
    assert "FAIL CUDA tests" in done.stdout
    assert "1 failed, 13 passed" in done.stdout  # the end of the failing log
    assert "budget" not in done.stdout  # nothing ran after the failure


def test_every_check_prints_one_line(tmp_path):
    done = run(tmp_path, GPU_CHECK_NVIDIA_SMI=str(fake_gpu(tmp_path)),
               GPU_CHECK_PYTHON=str(fake_python(tmp_path)))
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "gpu: Fake GPU, 8192 MiB, 550.00"
    checks = [line.split(":")[0] for line in lines[1:-1]]
    assert checks == ["ok setup", "ok CUDA tests", "ok budget held",
                      "ok overhead vs plain PyTorch on the GPU", "ok fine"]
    assert lines[-1].startswith("all checks passed")
