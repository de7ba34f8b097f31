"""benchmarks/gpu_check.sh says when it could not check, runs every check even after one
fails, and its dry run shows what the GPU machine will be sent and asked to run.

No GPU is needed: the script's hooks point it at a stand-in nvidia-smi, a stand-in Python
whose answers each test scripts, and a folder of stand-in wheels.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
WHEEL_LIST = ROOT / "benchmarks" / "gpu_wheels.txt"
CHECKS = ["ok setup", "ok bandwidth", "ok CUDA tests", "ok budget", "ok overhead",
          "ok overhead, small OPT", "ok evaluation", "ok opt-1.3b bf16 8x1024"]


def executable(path: Path, body: str) -> Path:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def wanted() -> list[str]:
    lines = WHEEL_LIST.read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def wheels(tmp_path: Path, leave_out: str | None = None) -> Path:
    """A folder of empty stand-ins named as pip names the real wheels."""
    folder = tmp_path / "whl"
    folder.mkdir()
    for spec in wanted():
        name, version = spec.split("==")
        if name != leave_out:
            (folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl").write_bytes(b"")
    return folder


def run(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k != "OUT"}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=120, env={**environment, "OUT": str(tmp_path / "out"),
                                            "GPU_CHECK_SITE": str(tmp_path / "site"),
                                            "GPU_CHECK_SCRATCH": str(tmp_path / "scratch"),
                                            **env})


def fake_gpu(tmp_path: Path) -> Path:
    return executable(tmp_path / "nvidia-smi", 'echo "Fake GPU, 8192 MiB, 550.00"\n')


def fake_python(tmp_path: Path, fail_on: str | None = None) -> Path:
    """A 'python' that answers every check, and fails the one whose command has `fail_on`."""
    failing = f'case "$*" in *{fail_on}*) echo "1 failed, 13 passed in 1.0s"; exit 1;; esac\n'
    return executable(tmp_path / "python", (failing if fail_on else "") + 'echo "fine: $*"\n')


def on_gpu(tmp_path: Path, fail_on: str | None = None) -> subprocess.CompletedProcess:
    return run(tmp_path, GPU_CHECK_NVIDIA_SMI=str(fake_gpu(tmp_path)),
               GPU_CHECK_PYTHON=str(fake_python(tmp_path, fail_on)),
               GPU_CHECK_WHEELS=str(wheels(tmp_path)))


def test_without_a_gpu_it_says_so_in_one_line_and_fails(tmp_path):
    done = run(tmp_path, GPU_CHECK_NVIDIA_SMI=str(tmp_path / "no-such-nvidia-smi"))
    assert done.returncode != 0
    assert done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "no NVIDIA GPU" in lines[0]


def test_a_failing_check_shows_its_log_and_the_others_still_run(tmp_path):
    done = on_gpu(tmp_path, fail_on="test_cuda.py")
    assert done.returncode == 1  # one check failed
    assert "FAIL CUDA tests" in done.stdout
    assert "1 failed, 13 passed" in done.stdout  # the end of the failing log
    later = done.stdout.split("FAIL CUDA tests")[1]
    for name in CHECKS[3:]:
        assert f"\n{name}: fine" in later  # every check after it ran
    assert "1 checks failed" in done.stdout.splitlines()[-1]


def test_every_check_prints_one_line_and_its_results_come_back_in_8_files(tmp_path):
    done = on_gpu(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "gpu: Fake GPU, 8192 MiB, 550.00"
    assert [line.split(":")[0] for line in lines[1:-1]] == CHECKS
    assert lines[-1].startswith("0 checks failed")
    out = tmp_path / "out"
    assert (out / "summary.txt").read_text() == done.stdout
    assert len(list(out.iterdir())) <= 8  # all that comes back from the machine
    # The wheels go, without a registry, into a folder put first on PYTHONPATH.
    setup = (out / "setup.log").read_text()
    assert "-m pip install -q --no-index --no-deps" in setup
    assert f"--target {tmp_path / 'site'}" in setup
    assert setup.splitlines()[0].count(".whl") == len(wanted())


def test_the_dry_run_names_each_wheel_its_size_and_every_command(tmp_path):
    done = run(tmp_path, "--dry-run", GPU_CHECK_PYTHON=str(fake_python(tmp_path)),
               GPU_CHECK_WHEELS=str(wheels(tmp_path)))
    assert done.returncode == 0, done.stdout + done.stderr
    for spec in wanted():
        assert f"  {spec}\n" in done.stdout
    assert "textual==" in done.stdout and "pydantic-core==" in done.stdout
    size = next(line for line in done.stdout.splitlines() if line.startswith("size:"))
    assert size.endswith("(limit 64 MiB)")
    would = [line for line in done.stdout.splitlines() if line.startswith("would run")]
    assert [line.split(" (")[0] for line in would] == [
        "would run wheels", "would run setup", "would run bandwidth", "would run CUDA tests",
        "would run budget", "would run overhead", "would run overhead, small OPT",
        "would run evaluation", "would run opt-1.3b run", "would run opt-1.3b bf16 8x1024"]
    assert not (tmp_path / "out").exists()  # nothing was run


def test_the_dry_run_fails_when_a_wheel_is_missing(tmp_path):
    done = run(tmp_path, "--dry-run", GPU_CHECK_PYTHON=str(fake_python(tmp_path)),
               GPU_CHECK_WHEELS=str(wheels(tmp_path, leave_out="pydantic-core")))
    assert done.returncode != 0
    assert "pydantic-core==2.50.5 MISSING" in done.stdout
    assert "gpu_wheels.sh" in done.stderr


def test_the_budget_holds_only_with_the_cuda_context_counted():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from budget_check import held
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    gib = 2**30
    # The allocator alone within the budget, the process over it: not held.
    assert not held(max_reserved=int(5.8 * gib), context=500 * 2**20, budget=6 * gib)
    assert held(max_reserved=5 * gib, context=500 * 2**20, budget=6 * gib)
