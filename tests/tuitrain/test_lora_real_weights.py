"""LoRA on real weights end to end: the small pretrained Llama folder of the fine-tuning
test, adapted by `tuitrain run FOLDER --headless --lora 8`, its checkpoint's adapters merged
by `tuitrain export --merge` and judged by plain transformers on held-out text."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.tuitrain.test_real_weights import (
    BATCH,
    DOMAIN,
    EVAL_BATCHES,
    SEQ_LEN,
    held_out_loss,
    pretrained_model,
    prose,
)

pytestmark = pytest.mark.slow  # a pretraining loop and a worker process: tens of seconds


def test_lora_on_a_pretrained_folder_lowers_its_held_out_loss(tmp_path):
    start = tmp_path / "pretrained"
    pretrained_model(start)
    (tmp_path / "train.txt").write_text("".join(prose(100 + i, DOMAIN, 60) for i in range(10)))
    held_out = prose(999, DOMAIN, 80)
    (tmp_path / "held.txt").write_text(held_out)

    done = subprocess.run(
        [sys.executable, "-m", "tuitrain", "run", str(start), "--headless", "--steps", "12",
         "--lora", "8", "--batch-size", str(BATCH), "--seq-len", str(SEQ_LEN), "--lr", "1e-2",
         "--precision", "fp32", "--data", "train.txt", "--eval-data", "held.txt",
         "--eval-batches", str(EVAL_BATCHES), "--checkpoint-dir", "ck"],
        cwd=tmp_path, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trainable" in done.stdout and "frozen" in done.stdout

    step = tmp_path / "ck" / "step-000012"
    config = json.loads((step / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 8
    merged = tmp_path / "merged"
    exported = subprocess.run(
        [sys.executable, "-m", "tuitrain", "export", str(step), "--merge", str(merged)],
        cwd=tmp_path, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120)
    assert exported.returncode == 0, exported.stdout + exported.stderr
    before = held_out_loss(start, start, held_out)
    after = held_out_loss(merged, start, held_out)
    assert after < before - 0.3, (before, after)
