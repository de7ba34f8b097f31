"""Checkpoints: written atomically, loaded whole or not at all, and resumed exactly."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import Engine, EngineConfig
from engine.data.corpus import TokenBatches
from engine.models.lora import apply_lora
from engine.models.zoo import build_model
from tests.tuitrain.forked_workers import worker_processes
from tuitrain import checkpoint
from tuitrain.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, save_checkpoint
from tuitrain.cli import main
from tuitrain.settings import Settings

TOKENS = np.random.default_rng(0).integers(0, 1000, 20_000).astype(np.int64)


class Run:
    """A tiny fp32 training run: the pieces the worker hands to the checkpoint functions."""

    def __init__(self, tmp_path, **checkpoint_settings) -> None:
        self.settings = Settings(model="tiny", checkpoint={"dir": str(tmp_path / "ck"),
                                                           **checkpoint_settings})
        torch.manual_seed(0)
        self.model = build_model("tiny", seed=0)
        self.engine = Engine(self.model, EngineConfig(policy="auto", device_budget="64MiB",
                                                      precision="fp32"))
        self.data = TokenBatches(TOKENS, batch_size=2, seq_len=16, seed=0)
        self.batches = iter(self.data)

    def steps(self, n: int) -> list[float]:
        return [self.engine.step(next(self.batches)).loss for _ in range(n)]

    def save(self) -> object:
        return save_checkpoint(self.engine, self.model, self.data, self.settings,
                               self.engine.step_count)


def test_resume_gives_the_same_losses_as_the_uninterrupted_run(tmp_path):
    straight = Run(tmp_path)
    losses = straight.steps(10)

    first = Run(tmp_path)
    first.steps(5)
    folder = first.save()
    assert folder.name == "step-000005"

    resumed = Run(tmp_path, resume=str(tmp_path / "ck"))  # the newest checkpoint in DIR
    assert load_checkpoint(resumed.engine, resumed.model, resumed.data, resumed.settings) == 5
    assert resumed.steps(5) == losses[5:]
    assert resumed.engine.step_count == 10


def test_the_model_folder_loads_with_transformers(tmp_path):
    run = Run(tmp_path)
    run.steps(2)
    folder = run.save()
    loaded = AutoModelForCausalLM.from_pretrained(folder / "model", local_files_only=True)
    want = run.engine.model_state_dict()
    got = loaded.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in got)
    names = {p.name for p in (folder / "model").iterdir()}
    assert {"config.json", "model.safetensors"} <= names


def test_a_crash_mid_write_leaves_the_previous_checkpoint_and_nothing_to_resume(
        tmp_path, monkeypatch):
    run = Run(tmp_path)
    run.steps(2)
    good = run.save()
    run.steps(1)

    def crash(*_args, **_kw):
        raise KeyboardInterrupt  # the process dies half-way through the optimizer state

    monkeypatch.setattr(checkpoint, "save_file", crash)
    with pytest.raises(KeyboardInterrupt):
        run.save()
    root = tmp_path / "ck"
    assert sorted(p.name for p in root.iterdir()) == [good.name]  # no half checkpoint
    assert find_checkpoint(root) == good


def test_a_full_disk_fails_cleanly_and_training_goes_on(tmp_path, monkeypatch):
    run = Run(tmp_path)
    run.steps(1)

    def full(*_args, **_kw):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "save_file", full)
    with pytest.raises(OSError, match="No space left"):
        run.save()
    assert not any((tmp_path / "ck").iterdir())
    assert len(run.steps(2)) == 2  # the engine is untouched and trains on


@pytest.mark.parametrize("damage", ["missing", "corrupt", "no-manifest"])
def test_a_damaged_checkpoint_is_refused_and_nothing_is_loaded(tmp_path, damage):
    run = Run(tmp_path)
    run.steps(3)
    folder = run.save()
    target = folder / "optimizer.safetensors"
    if damage == "missing":
        target.unlink()
    elif damage == "corrupt":
        data = bytearray(target.read_bytes())
        data[-10] ^= 0xFF
        target.write_bytes(bytes(data))
    else:
        (folder / "manifest.json").unlink()

    fresh = Run(tmp_path, resume=str(folder))
    before = fresh.engine.model_state_dict()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(fresh.engine, fresh.model, fresh.data, fresh.settings)
    assert str(folder) in str(err.value)
    after = fresh.engine.model_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert fresh.engine.step_count == 0


def test_a_checkpoint_of_another_model_says_whose_it_is(tmp_path):
    run = Run(tmp_path)
    run.steps(1)
    folder = run.save()
    other = Settings(model="tiny", training={"lora": {"rank": 4}},
                     checkpoint={"resume": str(folder)})
    adapted = apply_lora(build_model("tiny", seed=0), other.training.lora.as_lora())
    engine = Engine(adapted, EngineConfig(policy="auto", device_budget="64MiB",
                                          precision="fp32"))
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(engine, adapted, run.data, other)
    assert str(err.value).startswith(
        f"{folder} was saved by a run of tiny, not of tiny with LoRA rank 4: ")


def test_resume_picks_the_newest_complete_checkpoint(tmp_path):
    run = Run(tmp_path)
    run.steps(2)
    run.save()
    run.steps(2)
    # What a writer killed mid-checkpoint left, and one still writing: the next save removes
    # the first and keeps the second.
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = tmp_path / "ck" / f".step-000003.tmp-{dead.pid}"
    writing = tmp_path / "ck" / f".step-000003.tmp-{os.getppid()}"
    for folder in (left, writing):
        (folder / "model").mkdir(parents=True)
    newest = run.save()
    assert not left.exists() and writing.exists()
    (tmp_path / "ck" / "step-000009").mkdir()  # a folder with no manifest is not complete
    assert find_checkpoint(tmp_path / "ck") == newest
    with pytest.raises(CheckpointError, match="no checkpoint at"):
        find_checkpoint(tmp_path / "nowhere")


def test_checkpoints_hold_no_pickles(tmp_path):
    run = Run(tmp_path)
    run.steps(1)
    folder = run.save()
    suffixes = {p.suffix for p in folder.rglob("*") if p.is_file()}
    assert suffixes <= {".json", ".safetensors", ".txt", ".model", ""}
    manifest = json.loads((folder / "manifest.json").read_text())
    assert "optimizer.safetensors" in manifest["files"]


def _run(*args: str) -> int:
    """`tuitrain run tiny --headless ...` in this process, from the working folder; its
    worker is a process of its own, as ever (tests/tuitrain/forked_workers.py)."""
    return main(["run", "tiny", "--headless", "--precision", "fp32", "--batch-size", "2",
                 "--seq-len", "16", *args])


def _losses(path) -> dict[int, float]:
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "step" in r}


def _kill_the_worker_once(written: Path, killed: list[float]) -> None:
    """Once `written` exists, SIGKILL the one worker running (noting when in `killed`); if
    it never appears, Ctrl-C the run (the headless run's handler) so that the test fails
    rather than waits for a million steps."""
    deadline = time.monotonic() + 600
    while not written.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    workers = worker_processes()
    if not written.exists() or len(workers) != 1:
        os.kill(os.getpid(), signal.SIGINT)
        return
    workers[0].kill()  # SIGKILL in the middle of whatever it is doing
    killed.append(time.monotonic())


@pytest.mark.slow
def test_kill_9_of_the_worker_mid_run_then_resume_continues_exactly(tmp_path, monkeypatch,
                                                                     capsys):
    monkeypatch.chdir(tmp_path)
    assert _run("--steps", "8", "--metrics", "straight.jsonl") == 0, capsys.readouterr()

    killed: list[float] = []
    killer = threading.Thread(target=_kill_the_worker_once,
                              args=(tmp_path / "ck" / "step-000003", killed), daemon=True)
    killer.start()
    status = _run("--steps", "1000000", "--checkpoint-dir", "ck", "--checkpoint-every", "3",
                  "--metrics", "killed.jsonl")
    ended = time.monotonic()
    killer.join()
    said = capsys.readouterr()
    assert killed, f"no single worker to kill once step 3 was saved: {said}"
    assert status == 1, said  # reported as a training failure, not a hang
    assert ended - killed[0] < 60
    assert "training failed: worker exited with signal 9 (SIGKILL)" in said.err
    newest = find_checkpoint(tmp_path / "ck")
    done = int(newest.name.split("-")[1])
    assert done >= 3 and done % 3 == 0

    assert _run("--steps", "8", "--resume", "ck", "--metrics", "resumed.jsonl") == 0, \
        capsys.readouterr()
    want = _losses(tmp_path / "straight.jsonl")
    got = _losses(tmp_path / "resumed.jsonl")
    assert sorted(got) == list(range(done + 1, 9))
    assert all(got[step] == want[step] for step in got)


def test_resuming_a_checkpoint_at_or_past_the_last_step_is_refused_in_one_line(
        tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _run("--steps", "2", "--checkpoint-dir", "ck", "--checkpoint-every", "2") == 0, \
        capsys.readouterr()
    capsys.readouterr()
    assert _run("--steps", "2", "--resume", "ck") == 2
    assert capsys.readouterr().err.splitlines() == [
        "tuitrain: error: the checkpoint in ck is after step 2, and the run's last step is 2: "
        "nothing left to train (give --steps more than 2)"]


def test_a_checkpoint_of_another_run_is_refused_before_anything_loads(tmp_path):
    """The worker's own check, as every rank under torchrun and the tune's run make it: the
    data's order (here the seed) must be the saved run's."""
    run = Run(tmp_path)
    run.steps(2)
    folder = run.save()
    other = Run(tmp_path, resume=str(folder))
    other.settings = Settings(model="tiny", training={"seed": 1},
                              checkpoint={"resume": str(folder)})
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(other.engine, other.model, other.data, other.settings)
    assert str(err.value) == (
        f"{folder} was saved by a run with --seed 0; this run has --seed 1: give the same "
        f"to continue it, or leave out --resume to start a new run")
    assert other.engine.step_count == 0 and other.data.state_dict()["position"] == 0


def test_a_checkpoint_folder_named_from_home_in_a_preset_is_the_home_folders(
        tmp_path, monkeypatch):
    """A shell expands `~` in a flag, not in a preset's `checkpoint.dir` or `resume`: the
    run does, as the checks before it do, rather than make a folder named `~`."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    monkeypatch.chdir(tmp_path)
    first = Run(tmp_path)
    first.settings = Settings(model="tiny", checkpoint={"dir": "~/ck"})
    first.steps(2)
    assert first.save() == tmp_path / "home" / "ck" / "step-000002"
    assert not (tmp_path / "~").exists()
    resumed = Run(tmp_path)
    resumed.settings = Settings(model="tiny", checkpoint={"resume": "~/ck"})
    assert load_checkpoint(resumed.engine, resumed.model, resumed.data, resumed.settings) == 2
