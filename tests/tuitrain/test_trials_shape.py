"""A run's steps change shape live (micro-batches, activation checkpointing): each shape is
a trial of its own, and a preset saved from a trial records the shape it ran with."""

from __future__ import annotations

import dataclasses
import json

from tests.tuitrain.fakeworker import GiB, fake_stats
from tuitrain.replay import ReplayClient
from tuitrain.settings import Settings
from tuitrain.trials import Setting, trials
from tuitrain.tui.trial_preset import settings_line, trial_settings
from tuitrain.tui.trials_table import candidate_setting, row_key
from tuitrain.tune import Candidate


def step(n: int, micro_batches: int = 1, checkpointing: bool = False):
    return dataclasses.replace(fake_stats(n, policy="cpu"), micro_batches=micro_batches,
                               activation_checkpointing=checkpointing)


def test_steps_of_another_shape_are_a_trial_of_their_own():
    rows = trials([step(1), step(2), step(3, 4), step(4, 4), step(5, 4, True), step(6)])
    assert [(r.micro_batches, r.activation_checkpointing, r.steps) for r in rows] == [
        (1, False, 3), (4, False, 2), (4, True, 1)]
    assert rows[2].describe().startswith("cpu, margin 0.00, budget 6.0 GiB, 4 micro-batches, "
                                         "checkpointing: ")
    assert rows[0].describe().startswith("cpu, margin 0.00, budget 6.0 GiB: ")


def test_a_candidate_of_another_shape_has_a_row_of_its_own():
    one = Candidate("cpu", 0.0, 8, 1, False, 6 * GiB)
    other = Candidate("cpu", 0.0, 2, 4, True, 6 * GiB)
    assert candidate_setting(other) == Setting("cpu", 0.0, 6 * GiB, 4, True)
    assert row_key(candidate_setting(one)) != row_key(candidate_setting(other))


def test_a_saved_trial_records_its_shape_at_the_runs_global_batch():
    settings = Settings(model="tiny", training={"batch_size": 8, "grad_accum": 1})
    (trial,) = trials([step(1, 4, True), step(2, 4, True)])
    saved = trial_settings(settings, trial, default_budget=6 * GiB)
    t = saved.training
    assert (t.batch_size, t.grad_accum, t.activation_checkpointing) == (2, 4, True)
    assert settings_line(saved, default_budget=None).endswith(
        " · micro-batches 2 x 4 · checkpointing")


def test_a_finished_runs_replay_has_the_shape_its_last_step_ran_with(tmp_path):
    """So that a preset saved from the replay holds it, as it holds the last policy."""
    settings = Settings(model="tiny", training={"batch_size": 2, "grad_accum": 2})
    lines = [{"settings": settings.model_dump(mode="json")},
             *(dataclasses.asdict(s) for s in (step(1, 2), step(2, 4, True)))]
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    training = ReplayClient(metrics).settings["training"]
    assert (training["batch_size"], training["grad_accum"]) == (1, 4)
    assert training["activation_checkpointing"] is True
