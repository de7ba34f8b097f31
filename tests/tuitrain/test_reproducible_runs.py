"""A run is reproducible: its seed fixes the initialisation, the data order and every
dropout mask, so the same command twice gives the same losses bit for bit (fp32), and so
does any placement: policy, margin, device budget, a host budget with the disk tier."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from engine.models.zoo import build_model
from tuitrain.events import Step
from tuitrain.settings import Settings
from tuitrain.training_run import TrainingRun

pytestmark = pytest.mark.slow  # four runs of a tiny model, seconds each

STEPS = 2


class Sink(list):
    def put(self, event) -> None:
        self.append(event)


@pytest.fixture(scope="module")
def dropout_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny` with dropout on (the zoo's `tiny` has it off), as a local model folder."""
    folder = tmp_path_factory.mktemp("tiny-dropout")
    model = build_model("tiny")
    model.config.dropout = 0.1
    model.save_pretrained(folder)
    return folder


def losses(tmp_path: Path, model: Path, **engine: object) -> list[float]:
    settings = Settings(
        model=str(model),
        engine={"precision": "fp32", "device_budget": "64MiB", **engine},
        training={"steps": STEPS, "batch_size": 2, "seq_len": 16, "seed": 5, "lr": 1e-3},
    )
    commands, _ = multiprocessing.Pipe(duplex=False)
    sink = Sink()
    run = TrainingRun(settings=settings, log_path=str(tmp_path / "worker.log"),
                      commands=commands, outbox=sink)
    assert run.execute() == 0, [e for e in sink if not isinstance(e, Step)]
    return [e.stats.loss for e in sink if isinstance(e, Step)]


def test_the_same_run_twice_and_under_any_placement_gives_the_same_losses(
        tmp_path: Path, dropout_folder: Path) -> None:
    first = losses(tmp_path, dropout_folder, policy="auto")
    assert len(first) == STEPS
    assert losses(tmp_path, dropout_folder, policy="auto") == first
    assert losses(tmp_path, dropout_folder, policy="cpu") == first
    assert losses(tmp_path, dropout_folder, policy="cpu", host_budget="12MiB",
                  disk_dir=str(tmp_path / "scratch")) == first
