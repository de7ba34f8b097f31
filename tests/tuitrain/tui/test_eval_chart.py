"""Held-out losses in the app: an Eval event becomes the loss chart's second line, and the
step panel shows the learning rate each step ran with."""

from __future__ import annotations

import math

import pytest

from tests.tuitrain.fakeworker import fake_run
from tuitrain.events import Eval
from tuitrain.tui import step_panel
from tuitrain.tui.downsample import downsample
from tuitrain.tui.layout import views_for
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


async def test_a_curve_drawn_before_its_view_is_laid_out_is_drawn_again_at_its_size(
    monkeypatch,
):
    """A view switch and a redraw that beat the layout drew the curve for the width the
    chart had before (or none: a single point), and nothing drew it again."""
    limits: list[int] = []

    def spy(steps, values, limit, **kwargs):
        limits.append(limit)
        return downsample(steps, values, limit, **kwargs)

    monkeypatch.setattr(step_panel, "downsample", spy)
    app, _ = make_app(fake_run(300))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        views = {view.name: view for view in views_for("compact")}
        for name in ("trials", "step"):  # the step panel hidden, then shown at another size
            app.panels.show_view(views[name])
            app.redraw()  # at once, before the screen has laid the view out
        await pilot.pause()
        await pilot.pause()
        plot = app.query_one("#loss-plot")
        assert plot.size.width > 0
        assert limits[-1] == 2 * plot.size.width


async def test_the_step_panel_shows_the_loss_once_whichever_redraw_came_last():
    """The numbers and the curve are redrawn on two timers: a loss in the curve's title was
    another step's than the one beside it."""
    app, fake = make_app(fake_run(6))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        panel = app.query_one(StepPanel)
        panel.redraw_loss()  # the curve drawn after the numbers, as its timer may
        await pilot.pause()
        assert app.export_screenshot().count(f"{panel.latest.loss:.4f}") == 1
