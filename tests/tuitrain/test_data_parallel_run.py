"""Data parallel from the command line: `torchrun -m tuitrain run ... --headless`, and the
same ranks started by tuitrain itself (tuitrain.launch, behind `--nproc`).

Two and then three gloo ranks on this CPU, the second run resuming the first's checkpoint:
the same global batches as one process (so the same losses, in fp32 within 1e-5), rank 0
alone writing the metrics and the checkpoint, every rank logging to a file of its own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tuitrain import ranks
from tuitrain.settings import Settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
FLAGS = ["--headless", "--batch-size", "6", "--seq-len", "16", "--precision", "fp32",
         "--device-mem", "64MiB", "--seed", "3", "--eval-fraction", "0.05", "--eval-batches", "2"]
STEPS = 4
TOL = 1e-5


def torchrun(nproc: int, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "tuitrain", "run", "tiny", *FLAGS, *args]
    return _run(command, tmp)


def launched(nproc: int, tmp: Path, *args: str) -> subprocess.CompletedProcess:
    """The ranks started by tuitrain itself: `tuitrain run --nproc N` (tuitrain.launch)."""
    script = Path(sys.executable).with_name("tuitrain")
    entry = [str(script)] if script.is_file() else [sys.executable, "-m", "tuitrain"]
    return _run([*entry, "run", "tiny", "--nproc", str(nproc), *FLAGS, *args], tmp)


def _run(command: list[str], tmp: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)


def losses_in(metrics: Path) -> tuple[dict[int, float], dict[int, float]]:
    """(loss per step, held-out loss per step evaluated after) from a metrics file."""
    lines = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = {line["step"]: line["loss"] for line in lines if "step" in line}
    evals = {line["eval"]["step"]: line["eval"]["loss"] for line in lines if "eval" in line}
    return steps, evals


def one_process() -> tuple[list[float], dict[int, float]]:
    """The run as one process trains it, in this process with the worker's own building:
    its losses, and its held-out loss after steps 2 and 4 (scored as the worker does)."""
    from tuitrain.run_build import build_run

    settings = Settings(model="tiny", engine={"precision": "fp32", "device_budget": "64MiB"},
                        training={"batch_size": 6, "seq_len": 16, "seed": 3, "steps": STEPS,
                                  "eval_batches": 2},
                        data={"eval_fraction": 0.05})
    built = build_run(settings, lambda message: None)
    batches = iter(built.data)
    losses, evals = [], {}
    for step in range(1, STEPS + 1):
        losses.append(built.engine.step(next(batches)).loss)
        if step in (2, STEPS):
            scored = [(built.engine.evaluate(b), b["input_ids"].shape)
                      for b in built.eval_data.batches]
            evals[step] = (sum(loss * r * (c - 1) for loss, (r, c) in scored)
                           / sum(r * (c - 1) for _, (r, c) in scored))
    built.engine.close()
    return losses, evals


def test_ranks_train_the_global_batches_and_resume_on_another_world_size(tmp_path):
    expected, expected_evals = one_process()
    ck, first, second = tmp_path / "ck", tmp_path / "two.jsonl", tmp_path / "three.jsonl"

    preset = tmp_path / "two.yaml"
    two = launched(2, tmp_path, "--steps", "2", "--checkpoint-dir", str(ck),
                   "--metrics", str(first), "--save-preset", str(preset))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    # The preset runs it again on as many ranks.
    assert f"preset saved to {preset}" in two.stdout
    header = [line for line in preset.read_text().splitlines() if line.startswith("#")]
    assert f"# reproduce: tuitrain run --preset {preset} --headless --nproc 2" in header
    assert "2 ranks (gloo)" in two.stdout
    assert two.stdout.count("done: 2 steps, 192 tokens") == 1  # rank 0's summary only
    got, evals = losses_in(first)
    assert sorted(got) == [1, 2]  # one line per step: rank 0 alone writes the metrics
    assert [got[1], got[2]] == pytest.approx(expected[:2], rel=TOL)
    assert evals == pytest.approx({2: expected_evals[2]}, rel=TOL)
    assert sorted(p.name for p in ck.iterdir()) == ["step-000002"]  # nothing half-written
    assert (ck / "step-000002" / "model" / "config.json").is_file()
    logs = sorted(p.name.split("-")[0] for p in (tmp_path / "tuitrain").glob("rank*.log"))
    assert logs == ["rank0", "rank1"]

    three = torchrun(3, tmp_path, "--steps", str(STEPS), "--resume", str(ck),
                     "--metrics", str(second))
    assert three.returncode == 0, three.stdout[-3000:] + three.stderr[-3000:]
    got, evals = losses_in(second)
    assert sorted(got) == [3, 4]
    assert evals == pytest.approx({STEPS: expected_evals[STEPS]}, rel=TOL)
    # Resharded from two ranks to three, the run goes on as if it had never stopped.
    assert [got[3], got[4]] == pytest.approx(expected[2:], rel=TOL)


def test_a_global_batch_splits_into_contiguous_equal_parts():
    import torch

    batch = {"input_ids": torch.arange(12).view(6, 2), "labels": torch.arange(12).view(6, 2)}
    parts = [ranks.Ranks(r, 3).slice(batch) for r in range(3)]
    assert torch.equal(torch.cat([p["input_ids"] for p in parts]), batch["input_ids"])
    assert [p["labels"].shape[0] for p in parts] == [2, 2, 2]
    assert ranks.Ranks().slice(batch) is batch
    # Held-out batches need not split evenly: near-equal parts, and a rank left without a
    # row scores one that counts for nothing.
    short = {"input_ids": torch.arange(10).view(5, 2)}
    parts = [ranks.Ranks(r, 3).eval_part(short) for r in range(3)]
    assert [counted for _, counted in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["input_ids"] for p, _ in parts]), short["input_ids"])
    single = {"input_ids": torch.arange(2).view(1, 2)}
    assert [ranks.Ranks(r, 2).eval_part(single)[1] for r in range(2)] == [1, 0]
    assert ranks.Ranks(1, 2).eval_part(single)[0]["input_ids"].shape[0] == 1


def test_with_accumulation_the_ranks_kth_micro_batches_are_one_process_kth():
    """So that each rank's dropout masks, its rows of the whole micro-batch's, are one
    process's (engine.step.dropout)."""
    import torch

    from engine.step.engine import split_batch

    batch = {"input_ids": torch.arange(24).view(12, 2)}  # 3 micro-batches of 4
    parts = [split_batch(ranks.Ranks(r, 2).slice(batch, 3), 3) for r in range(2)]
    for k, whole in enumerate(split_batch(batch, 3)):
        ranks_kth = torch.cat([parts[r][k]["input_ids"] for r in range(2)])
        assert torch.equal(ranks_kth, whole["input_ids"]), f"micro-batch {k}"
    with pytest.raises(ValueError, match="batch_size 5 does not split evenly over 2 ranks"):
        ranks.Ranks(0, 2).check_batch(5)


def test_torchruns_environment_names_the_rank():
    assert ranks.from_environment({}) == ranks.Ranks(0, 1, 0)
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}
    assert ranks.from_environment(env) == ranks.Ranks(3, 4, 1)
    with pytest.raises(ValueError, match="RANK=4 is not a rank of WORLD_SIZE=4"):
        ranks.from_environment({"WORLD_SIZE": "4", "RANK": "4"})


def test_the_launcher_refuses_what_cannot_run_before_starting_a_rank():
    from tuitrain.launch import check_nproc, launch, rank_arguments

    argv = ["tiny", "--nproc", "2", "--headless", "--save-preset", "p.yaml", "--steps", "5",
            "--nproc=3", "--save-preset=q.yaml", "--force"]
    assert rank_arguments(argv) == ["tiny", "--headless", "--steps", "5", "--force"]

    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="--nproc: must be a whole number of ranks"):
            check_nproc(bad)
    assert check_nproc(3) == 3
    with pytest.raises(ValueError, match="batch_size 4 does not split evenly over 3 ranks"):
        launch(3, ["tiny", "--headless"], batch_size=4)
