"""Evaluation through the engine: the loss on held-out batches with no gradient, whatever the
policy and budget, and without disturbing training."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import Engine, EngineConfig
from tests.engine.conftest import build, make_batches

MODEL = build("opt", layers=4, hidden=64)
TRAIN = make_batches(4)
HELD_OUT = make_batches(2, seed=99)


def tight_budget() -> int:
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(device_budget="64MiB", simulate=True))
    eng.step(TRAIN[0])
    return int(1.05 * eng.min_working_set())


@pytest.mark.parametrize(("policy", "budget"), [("cuda", "64MiB"), ("cpu", "tight"),
                                                ("auto", "tight"), ("auto", "64MiB")])
def test_the_loss_is_the_models_own_and_training_goes_on_as_if_nothing_happened(policy, budget):
    budget = tight_budget() if budget == "tight" else budget
    plain = Engine(copy.deepcopy(MODEL), EngineConfig(policy=policy, device_budget=budget,
                                                      simulate=True))
    plain_losses = [plain.step(b).loss for b in TRAIN]

    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy=policy, device_budget=budget,
                                                    simulate=True))
    losses, evals = [], []
    for batch in TRAIN:
        losses.append(eng.step(batch).loss)
        device_bytes = eng.manager.device_bytes
        evals.append([eng.evaluate(b) for b in HELD_OUT])
        assert eng.manager.device_bytes == device_bytes  # non-resident copies went home
    assert losses == plain_losses

    # The same numbers a plain copy of the model with the engine's weights gives.
    reference = copy.deepcopy(MODEL)
    reference.load_state_dict(eng.model_state_dict())
    reference.eval()
    with torch.no_grad():
        expected = [float(reference(**b).loss) for b in HELD_OUT]
    assert evals[-1] == pytest.approx(expected, rel=1e-6)
    assert [eng.evaluate(b) for b in HELD_OUT] == evals[-1]  # the same every time
    assert eng.model.training


def test_no_gradient_is_left_behind():
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy="cpu", device_budget="64MiB",
                                                    simulate=True))
    eng.step(TRAIN[0])
    eng.evaluate(HELD_OUT[0])
    assert all(p.grad is None for p in eng.model.parameters())
    assert all(c.grad is None for c in eng.chunks)
