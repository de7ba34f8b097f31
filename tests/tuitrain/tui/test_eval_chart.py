"""Held-out losses in the app: an Eval event becomes the loss chart's second line, and the
step panel shows the learning rate each step ran with."""

from __future__ import annotations

import math

import pytest

from tests.tuitrain.fakeworker import fake_run
from tuitrain.events import Eval
from tuitrain.tui.step_panel import StepPanel

from .helpers import SIZE, make_app, settle

pytestmark = pytest.mark.anyio


def evaluated(step: int, loss: float) -> Eval:
    return Eval(step=step, loss=loss, perplexity=math.exp(loss), tokens=4096, seconds=0.5)


async def test_held_out_losses_are_drawn_beside_the_training_loss():
    script = fake_run(6)
    script.insert(4, evaluated(3, 2.75))
    script.append(evaluated(6, 2.5))
    app, _ = make_app(script)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        panel = app.query_one(StepPanel)
        assert list(panel.evals) == [(3, 2.75), (6, 2.5)]
        assert "lr 3.0e-04" in panel.times_text
        assert "held-out" in app.export_screenshot()  # the second line in the legend
        panel.reset()  # a restart forgets them
        assert not panel.evals


async def test_a_run_without_evaluations_draws_the_training_loss_alone():
    app, _ = make_app(fake_run(6))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert not app.query_one(StepPanel).evals
        assert "held-out" not in app.export_screenshot()
