"""The text fields (margin, budget, the save dialog's path) and the footer beside them: what
the user types stays as typed, in order, and the footer offers only keys that act."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual import events
from textual.widgets import Input, Select

from tests.tuitrain.fakeworker import fake_run
from tuitrain.events import Pause, SetBudget
from tuitrain.tui.app import TuitrainApp
from tuitrain.tui.controls import FIELD_HINT, HINT, Controls
from tuitrain.tui.save_dialog import SaveDialog

from .helpers import SIZE, make_app, settle

pytestmark = pytest.mark.anyio


def burst(app: TuitrainApp, *keys: str) -> None:
    """Keys as a paste or fast typing brings them: all queued before the first is handled."""
    for key in keys:
        character = key if len(key) == 1 else None
        app.post_message(events.Key(key, character))


async def focused_field(app: TuitrainApp, pilot, name: str) -> Input:
    field = app.query_one(f"#{name}", Input)
    field.focus()
    await pilot.pause()
    return field


def offered(app: TuitrainApp) -> set[str]:
    """The keys the footer shows now."""
    return {key for key, active in app.screen.active_bindings.items()
            if active.binding.show and active.enabled}


async def test_keys_typed_fast_after_clearing_a_field_act_in_the_order_typed():
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        margin = await focused_field(app, pilot, "margin")
        burst(app, "end", *["backspace"] * 6, *"0.25")
        await pilot.pause()
        assert margin.value == "0.25"
        budget = await focused_field(app, pilot, "budget")
        burst(app, "end", *["backspace"] * 12, *"1234567")
        await pilot.pause()
        assert budget.value == "1234567"


async def test_a_path_typed_fast_after_ctrl_u_is_the_path_saved(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("s")
        await pilot.pause()
        assert isinstance(app.screen, SaveDialog)
        burst(app, "end", "ctrl+u", *"mine.yaml")
        await pilot.pause()
        assert app.screen.query_one("#preset-path", Input).value == "mine.yaml"


async def test_a_field_being_edited_is_not_rewritten_by_the_run():
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        margin = await focused_field(app, pilot, "margin")
        await pilot.press("ctrl+u", *"0.4")
        app.steering.show_targets()  # as an answer from the worker does
        await settle(app, pilot)
        assert margin.value == "0.4"


async def test_a_field_left_without_enter_reads_the_runs_value_again():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        margin = await focused_field(app, pilot, "margin")  # focus selects its text
        await pilot.press("plus")  # typed over it, not a margin step
        assert margin.value == "+"
        await pilot.press("escape")
        await pilot.pause()
        assert app.focused is None
        assert margin.value == "0.00"
        budget = await focused_field(app, pilot, "budget")
        await pilot.press(*"3GiB")
        await pilot.press("tab")
        await pilot.pause()
        assert budget.value == ""  # the default, which the placeholder names
        assert budget.placeholder == "6.0 GiB"
    assert fake.commands == []


async def test_an_empty_budget_field_names_the_budget_in_force():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        budget = await focused_field(app, pilot, "budget")
        await pilot.press(*"2GiB", "enter")
        await settle(app, pilot)
        assert [c.device_budget for c in fake.commands if isinstance(c, SetBudget)] == ["2GiB"]
        assert budget.value == "2GiB"
        await pilot.press("ctrl+u")
        assert budget.placeholder == "2GiB"  # the header's budget, not the default's
        await pilot.press("enter")  # nothing typed: nothing asked, the value shows again
        await settle(app, pilot)
        assert budget.value == "2GiB"
        assert len([c for c in fake.commands if isinstance(c, SetBudget)]) == 1


async def test_the_footer_offers_no_key_that_a_focused_field_types():
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert {"plus", "minus", "c", "space"} <= offered(app)
        for name in ("margin", "budget"):
            await focused_field(app, pilot, name)
            assert not {"plus", "minus", "c", "space"} & offered(app)
            assert app.query_one(Controls).query_one("#control-hint").content == FIELD_HINT
        await pilot.press("escape")
        await pilot.pause()
        assert {"plus", "minus"} <= offered(app)
        assert app.query_one(Controls).query_one("#control-hint").content == HINT


async def test_space_on_the_policy_dropdown_pauses_as_the_footer_says():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        select = app.query_one("#policy", Select)
        select.focus()
        await pilot.pause()
        assert app.screen.active_bindings["space"].binding.description == "Pause"
        await pilot.press("space")
        await settle(app, pilot)
        assert not select.expanded
        assert [type(c) for c in fake.commands] == [Pause]
