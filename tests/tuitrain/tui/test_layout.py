"""Panels by priority for the terminal's size: all on a large one, the rest a key away on a
small one; the header keeps the step, the pace and the state at every width."""

from __future__ import annotations

import pytest
from textual.widgets._footer import FooterKey

from tests.tuitrain.fakeworker import GiB, fake_run
from tuitrain.settings import Settings
from tuitrain.tui.fitting import Item, fit_line
from tuitrain.tui.header import HeaderInfo, RunHeader, header_items, model_label
from tuitrain.tui.help_screen import HelpScreen
from tuitrain.tui.layout import PANELS, VIEWS, closest_view, next_view, size_class
from tuitrain.tui.trials_table import TrialsTable

from .helpers import make_app, palette_offers, settle

pytestmark = pytest.mark.anyio

SMALL, MEDIUM, LARGE = (80, 24), (120, 40), (200, 60)
FOLDER = "/home/someone/models/huggingface/HuggingFaceTB/smollm2-135m/"


def shown(app) -> set[str]:
    return {panel for panel in PANELS if app.query_one(f"#{panel}").display}


# --- which panels, at which size -----------------------------------------------------------


def test_each_size_has_its_class():
    assert size_class(*SMALL) == "compact"
    assert size_class(*MEDIUM) == "standard"
    assert size_class(*LARGE) == "full"
    assert size_class(200, 30) == "compact"  # wide but short: what fits is what counts


def test_every_panel_is_on_screen_or_a_view_away_at_every_size():
    for views in VIEWS.values():
        assert set().union(*(v.panels for v in views)) == set(PANELS)
    assert VIEWS["full"][0].panels == set(PANELS)
    run = VIEWS["compact"][0]
    assert run.panels == {"memory", "step", "controls"}  # what matters most, first


def test_a_resize_keeps_the_view_closest_to_what_was_shown():
    trials = next(v for v in VIEWS["compact"] if v.name == "trials")
    assert closest_view("standard", trials).name == "tuning"
    assert closest_view("compact", VIEWS["full"][0]).name == "run"
    assert next_view("compact", VIEWS["compact"][-1]) == VIEWS["compact"][0]


async def test_80x24_shows_memory_step_and_controls_and_v_brings_the_others():
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        assert shown(app) == {"memory", "step", "controls"}
        seen = []
        for _ in VIEWS["compact"]:
            await pilot.press("v")
            await settle(app, pilot)
            seen.append((app.view.name, shown(app)))
        assert seen == [
            ("trials", {"trials", "controls"}),
            ("step", {"timeline", "step"}),
            ("placement", {"states", "chunks"}),
            ("log", {"log"}),
            ("run", {"memory", "step", "controls"}),
        ]


async def test_the_trials_view_of_a_small_screen_puts_the_keys_on_its_rows():
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        await pilot.press("v")
        assert app.focused is app.query_one(TrialsTable)
        await pilot.press("v")  # on to the step view: the table lets go of the keys
        assert app.focused is None


async def test_200x60_shows_every_panel_and_v_says_so():
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=LARGE) as pilot:
        await settle(app, pilot)
        assert shown(app) == set(PANELS)
        await pilot.press("v")
        await pilot.pause()
        assert shown(app) == set(PANELS)


async def test_120x40_has_a_run_view_and_a_tuning_view():
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=MEDIUM) as pilot:
        await settle(app, pilot)
        assert shown(app) == {"memory", "states", "chunks", "step", "controls", "log"}
        await pilot.press("v")
        assert shown(app) == {"trials", "timeline", "controls", "log"}


async def test_a_resize_picks_the_views_of_the_new_size():
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        await pilot.press("v")  # trials
        await pilot.resize_terminal(*MEDIUM)
        await pilot.pause()
        assert app.view.name == "tuning"
        await pilot.resize_terminal(*LARGE)
        await pilot.pause()
        assert shown(app) == set(PANELS)


async def test_the_views_are_in_the_palette_and_the_help_screen():
    app, _ = make_app(fake_run(1))
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        titles = [command.title for command in app.get_system_commands(app.screen)]
        assert "Next view" in titles
        assert {f"Show view: {v.name}" for v in VIEWS["compact"]} <= set(titles)
        await pilot.press("question_mark")
        help_text = app.screen.query_one("#help-keys").content
        assert isinstance(app.screen, HelpScreen)
    rows = [str(cell) for column in help_text.columns for cell in column._cells]
    assert "v" in rows and any("trials: one row per setting" in row for row in rows)


async def test_show_view_from_the_palette():
    app, _ = make_app(fake_run(1))
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"show view: placement")
        await palette_offers(app, pilot, "placement")
        await pilot.press("enter")
        await settle(app, pilot)
        assert shown(app) == {"states", "chunks"}


@pytest.mark.parametrize("size", [SMALL, MEDIUM])
async def test_the_footer_keeps_help_and_quit_on_screen(size):
    app, _ = make_app(fake_run(1))
    async with app.run_test(size=size) as pilot:
        await settle(app, pilot)
        keys = {key.action: key for key in app.query(FooterKey)}
        palette = next(key for key in keys.values() if key.has_class("-command-palette"))
        for action in ("help", "quit", "cycle_policy", "margin_up", "margin_down", "save_preset"):
            region = keys[action].region
            assert region.width > 0 and region.right <= palette.region.x, action


# --- the header ---------------------------------------------------------------------------


def test_a_model_folder_reads_by_its_last_name():
    assert model_label(FOLDER) == "smollm2-135m"
    assert model_label("opt-1.3b") == "opt-1.3b"
    assert model_label("models/opt-local") == "opt-local"


def test_the_least_important_items_go_first_and_the_essentials_never():
    info = HeaderInfo(
        model=FOLDER,
        parameters=134_515_008,
        device="simulated, 700.0 MiB",
        state="running",
        step=1234,
        total_steps=5000,
        tokens_per_s=1234.5,
        device_budget=700 * 1024**2,
    )
    first, second = header_items(info)
    wide = fit_line(first, 118).plain
    assert wide.startswith("tuitrain  │  smollm2-135m  │  134.5M params")
    narrow = fit_line(first, 50).plain
    assert "tuitrain" not in narrow and "params" not in narrow
    assert "● running" in narrow and "step 1234/5000" in narrow and "1,234 tok/s" in narrow
    tiny = fit_line(first, 44).plain
    assert "smollm" in tiny and "…" in tiny and "step 1234/5000" in tiny and "tok/s" in tiny
    assert "device" not in fit_line(second, 44).plain  # the settings stay
    assert "budget 700.0 MiB" in fit_line(second, 44).plain


def test_a_cut_item_keeps_its_label():
    item = Item((("device ", ""), ("NVIDIA GeForce RTX 3060 Laptop GPU, 6.0 GiB", "")), shrink=True)
    line = fit_line([Item((("policy auto", ""),), rank=100), item], 40).plain
    assert line.startswith("policy auto") and "device NVIDIA" in line and line.endswith("…")
    assert len(line) <= 40


@pytest.mark.parametrize("size", [SMALL, MEDIUM, LARGE])
async def test_the_header_never_cuts_the_step_the_pace_or_the_state(size):
    settings = Settings(model=FOLDER)
    settings.training.steps = 5000
    script = fake_run(12, model=FOLDER, parameters=134_515_008, device_budget=700 * 1024**2)
    app, _ = make_app(script, settings=settings)
    async with app.run_test(size=size) as pilot:
        await settle(app, pilot)
        header = app.query_one(RunHeader)
        first, second = header.plain.splitlines()
        assert "smollm2-135m" in first and "/home" not in first
        assert "● running" in first and "step 12/5000" in first and "tok/s" in first
        assert "policy auto" in second and "budget 700.0 MiB" in second
        for line in (first, second):
            assert len(line) <= header.content_region.width
        if size != SMALL:
            assert "134.5M params" in first and "device simulated, 700.0 MiB" in second


def test_a_budget_shown_before_the_first_step_is_in_gib():
    info = HeaderInfo(model="opt-125m", device_budget=6 * GiB)
    assert "budget 6.0 GiB" in fit_line(header_items(info)[1], 80).plain
