"""A plan's recording of a step is kept for its model and shape: a tune or a fit that plans
one shape under many budgets records it once, and gets what a fresh recording gives."""

from __future__ import annotations

import torch

from engine.models.lora import Lora
from engine.models.zoo import model_config
from engine.planning import recording
from engine.planning.planner import TRACE_LAYERS, plan
from engine.planning.recording import record_step


def test_the_same_shape_is_recorded_once_and_a_changed_list_changes_nothing(monkeypatch):
    recorded = []
    fresh = recording._record_step
    monkeypatch.setattr(recording, "_recorded", recording.OrderedDict())
    monkeypatch.setattr(recording, "_record_step",
                        lambda *a, **k: recorded.append(a) or fresh(*a, **k))
    config = model_config("tiny")
    args = (config, torch.float32, 2, 32, False)
    first = record_step(*args, trace_layers=TRACE_LAYERS)
    first.append(("backward",))  # a caller's list is its own
    again = record_step(*args, trace_layers=TRACE_LAYERS)
    assert len(recorded) == 1 and again == first[:-1]
    assert again == fresh(*args, trace_layers=TRACE_LAYERS, lora=None)
    # Another batch, checkpointing, other adapters, another model, a scaled loss (micro-
    # batches, fp16): recorded anew; the scale's value changes no byte.
    record_step(config, torch.float32, 4, 32, False, trace_layers=TRACE_LAYERS)
    record_step(config, torch.float32, 2, 32, True, trace_layers=TRACE_LAYERS)
    record_step(*args, trace_layers=TRACE_LAYERS, lora=Lora(rank=4))
    deeper = model_config("tiny")
    deeper.num_hidden_layers += 1
    record_step(deeper, torch.float32, 2, 32, False, trace_layers=TRACE_LAYERS)
    scaled = record_step(*args, trace_layers=TRACE_LAYERS, loss_scale=0.5)
    assert record_step(*args, trace_layers=TRACE_LAYERS, loss_scale=2.0**16 / 4) == scaled
    assert len(recorded) == 6


def test_only_the_last_shapes_are_kept(monkeypatch):
    monkeypatch.setattr(recording, "_recorded", recording.OrderedDict())
    monkeypatch.setattr(recording, "RECORDINGS_KEPT", 2)
    config = model_config("tiny")
    for batch in (1, 2, 1, 3):  # 1 used again: 2 is the oldest when 3 comes
        record_step(config, torch.float32, batch, 16, False, trace_layers=TRACE_LAYERS)
    assert [key[3] for key in recording._recorded] == [1, 3]


def test_plans_under_other_budgets_read_the_kept_recording_and_agree_with_fresh_ones(
        monkeypatch):
    shape = {"host_mem": "64GiB", "precision": "fp32", "batch_size": 2, "seq_len": 32,
             "simulated": True}
    monkeypatch.setattr(recording, "_recorded", recording.OrderedDict())
    kept = [plan("tiny", device_mem=budget, margin_ratio=margin, **shape)
            for budget, margin in (("64MiB", 0.0), ("20MiB", 0.5))]
    assert len(recording._recorded) == 1
    for p, (budget, margin) in zip(kept, (("64MiB", 0.0), ("20MiB", 0.5)), strict=True):
        recording._recorded.clear()
        assert plan("tiny", device_mem=budget, margin_ratio=margin, **shape) == p
