"""A Stop that arrives mid-step cuts the step short: nothing of it is kept, the final
checkpoint is the last whole step's, and resuming from it continues exactly."""

from __future__ import annotations

import json
import multiprocessing

import torch
from safetensors.torch import load_file

from engine.step.runner import StepRunner
from tests.forked import run_script
from tuitrain.events import Finished, Log, Step, Stop
from tuitrain.settings import Settings
from tuitrain.training_run import TrainingRun

STEPS = 8
STOP_DURING = 4  # the step during whose forward the Stop arrives


class Sink(list):
    def put(self, event) -> None:
        self.append(event)


def settings(tmp_path, **checkpoint) -> Settings:
    return Settings(
        model="tiny",
        engine={"precision": "fp32", "policy": "auto", "device_budget": "64MiB"},
        training={"steps": STEPS, "batch_size": 2, "seq_len": 16, "seed": 3},
        checkpoint=checkpoint,
    )


def train(tmp_path, s: Settings) -> tuple[TrainingRun, Sink]:
    commands, _ = multiprocessing.Pipe(duplex=False)
    sink = Sink()
    run = TrainingRun(settings=s, log_path=str(tmp_path / "log"), commands=commands,
                      outbox=sink)
    assert run.execute() == 0
    return run, sink


def losses(sink: Sink) -> dict[int, float]:
    return {e.stats.step: e.stats.loss for e in sink if isinstance(e, Step)}


def test_stop_mid_step_keeps_nothing_of_it_and_resume_continues_exactly(
        tmp_path, monkeypatch):
    _, straight = train(tmp_path, settings(tmp_path, dir=str(tmp_path / "straight"),
                                           every=STOP_DURING - 1))
    expected = losses(straight)
    assert sorted(expected) == list(range(1, STEPS + 1))

    point = StepRunner._point
    runs: list[TrainingRun] = []

    def stop_mid_step(self, key, phase, *fetch):
        # Deep in the forward of step STOP_DURING: what the worker's signal handler does
        # when the parent sends Stop (the command, then the signal).
        if self.step_number == STOP_DURING and self.pos == 5 and not runs[0].stopping:
            runs[0].commands_sent.send(Stop(id=1))
            runs[0].interrupt()
            torch.rand(100)
        point(self, key, phase, *fetch)

    commands, sender = multiprocessing.Pipe(duplex=False)
    sink = Sink()
    run = TrainingRun(settings=settings(tmp_path, dir=str(tmp_path / "ck")),
                      log_path=str(tmp_path / "log"), commands=commands, outbox=sink)
    run.commands_sent = sender
    runs.append(run)
    monkeypatch.setattr(StepRunner, "_point", stop_mid_step)
    assert run.execute() == 0
    monkeypatch.setattr(StepRunner, "_point", point)

    finished = [e for e in sink if isinstance(e, Finished)]
    assert finished and finished[0].summary["last_step"] == STOP_DURING - 1
    assert losses(sink) == {k: v for k, v in expected.items() if k < STOP_DURING}
    said = [e.message for e in sink if isinstance(e, Log)]
    assert f"step {STOP_DURING} was interrupted in the forward; nothing of it was kept" in said
    saved = sorted(p.name for p in (tmp_path / "ck").iterdir())
    assert saved == [f"step-{STOP_DURING - 1:06d}"]
    # The data position and the random number generators are the last whole step's: the
    # checkpoint equals the one an uninterrupted run writes after that step (the step cut
    # short drew random numbers, as dropout would).
    ours, theirs = tmp_path / "ck" / saved[0], tmp_path / "straight" / saved[0]
    assert load_file(ours / "rng.safetensors")["torch"].equal(
        load_file(theirs / "rng.safetensors")["torch"])
    assert (json.loads((ours / "state.json").read_text())["data"]
            == json.loads((theirs / "state.json").read_text())["data"])

    _, resumed = train(tmp_path, settings(tmp_path, resume=str(tmp_path / "ck")))
    assert losses(resumed) == {k: v for k, v in expected.items() if k >= STOP_DURING}


def test_the_interrupt_signal_reaches_a_listening_thread_while_the_main_thread_is_busy():
    """On a GPU, backward's hooks run on autograd's thread while the main thread waits in
    native code, where a Python signal handler would never run until the step is over."""
    script = """
import os, threading, time
from tuitrain.worker_main import INTERRUPT_SIGNAL, _route_interrupts
heard = []
_route_interrupts(lambda: heard.append(threading.current_thread().name))
threading.Timer(0.2, os.kill, (os.getpid(), INTERRUPT_SIGNAL)).start()
lock = threading.Lock()
lock.acquire()
lock.acquire(timeout=2)  # the main thread blocked in native code, as in a CUDA backward
print(heard)
"""
    # A process of its own, for its signal mask and threads: forked (tests/forked.py).
    out = run_script(script, timeout=60)
    assert out.strip().splitlines()[-1] == "['tuitrain-interrupt']", out
