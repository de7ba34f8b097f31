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
    plain_losses, plain_bytes = [], []
    for b in TRAIN:
        plain_losses.append(plain.step(b).loss)
        plain_bytes.append(plain.manager.device_bytes)

    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy=policy, device_budget=budget,
                                                    simulate=True))
    losses, evals = [], []
    for batch, device_bytes in zip(TRAIN, plain_bytes, strict=True):
        losses.append(eng.step(batch).loss)
        # Copies kept by the evaluation before this step went, as its placement says.
        assert eng.manager.device_bytes == device_bytes
        evals.append([eng.evaluate(b) for b in HELD_OUT])
        assert eng.manager.device_bytes <= eng.device.capacity()
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


@pytest.mark.parametrize("policy", ["auto", "cpu"])
def test_with_every_chunk_fitting_evaluation_copies_each_once_then_nothing(policy):
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy=policy, device_budget="64MiB",
                                                    simulate=True))
    eng.step(TRAIN[0])
    payload = sum(c.nbytes for c in eng.chunks)
    m = eng.manager
    before = m.bytes_h2d
    first = [eng.evaluate(b) for b in HELD_OUT]
    assert m.bytes_h2d - before == payload
    before = m.bytes_h2d
    assert [eng.evaluate(b) for b in HELD_OUT] == first
    assert m.bytes_h2d == before


def test_under_a_tight_budget_evaluation_moves_only_what_does_not_fit():
    budget = tight_budget()
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy="auto", device_budget=budget,
                                                    simulate=True))
    eng.step(TRAIN[0])
    payload = sum(c.nbytes for c in eng.chunks)
    m = eng.manager
    eng.evaluate(HELD_OUT[0])
    before = m.bytes_h2d
    eng.evaluate(HELD_OUT[1])
    assert 0 < m.bytes_h2d - before < payload  # some copies stayed, not all fit
    assert m.device_bytes <= eng.device.capacity()
