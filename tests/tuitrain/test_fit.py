"""The warning a run prints at its start when the planner says it will not fit: why, what
would, and planned with the budget the engine really got."""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from tuitrain import run_build
from tuitrain.events import Log, Stop
from tuitrain.fit import warn_if_unfit
from tuitrain.settings import Settings
from tuitrain.training_run import TrainingRun

MiB = 2**20


def test_warn_if_unfit_says_why_and_what_would_fit():
    tight = Settings.model_validate(
        {
            "model": "tiny",
            "engine": {"policy": "cuda", "device_budget": "20MiB", "precision": "bf16"},
            "training": {"batch_size": 2, "seq_len": 64},
        }
    )
    line = warn_if_unfit(tight)
    assert line is not None and "\n" not in line
    assert "policy cuda will not fit" in line and "20.0 MiB" in line
    assert "policy auto would" in line


def test_warn_if_unfit_is_silent_when_the_run_fits():
    roomy = Settings.model_validate(
        {
            "model": "tiny",
            "engine": {"policy": "auto", "device_budget": "1GiB", "precision": "bf16"},
            "training": {"batch_size": 2, "seq_len": 64},
        }
    )
    assert warn_if_unfit(roomy) is None


class Sink(list):
    def put(self, event) -> None:
        self.append(event)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default budget shrinks when simulated")
def test_a_run_start_warns_with_the_budget_the_engine_got_not_the_default(tmp_path, monkeypatch):
    # A machine short of memory: the default simulated device (6 GiB, where the tiny model
    # fits under every policy) shrinks to 16 MiB, where it fits under none.
    monkeypatch.setattr(run_build, "simulated_budget", lambda default, **_: 16 * MiB)
    commands, sender = multiprocessing.Pipe(duplex=False)
    sender.send(Stop(id=1))  # read before the first step: the run's start is all there is
    settings = Settings(
        model="tiny",
        engine={"policy": "cuda", "precision": "fp32"},
        training={"batch_size": 2, "seq_len": 64},
    )
    sink = Sink()
    run = TrainingRun(
        settings=settings, log_path=str(tmp_path / "log"), commands=commands, outbox=sink
    )
    assert run.execute() == 0
    warnings = [e.message for e in sink if isinstance(e, Log) and e.level == "warning"]
    assert any("policy cuda will not fit" in w and "16.0 MiB" in w for w in warnings), warnings
