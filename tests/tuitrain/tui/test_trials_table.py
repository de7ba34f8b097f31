"""The trials table on a scripted run: three settings tried, the best marked, any row saved."""

from __future__ import annotations

import pytest

from tests.tuitrain.fakeworker import FakeWorker, GiB, fake_run, fake_stats, follow_settings
from tuitrain import tune
from tuitrain.events import Failed, Step
from tuitrain.formatting import format_seconds, format_size
from tuitrain.preset_folders import saved_dir
from tuitrain.presets import load_preset
from tuitrain.settings import Settings
from tuitrain.trials import BEST_MIN_SETTLED, Setting
from tuitrain.tui.app import TuitrainApp
from tuitrain.tui.save_dialog import SaveDialog
from tuitrain.tui.trials_table import TrialsTable

from .helpers import SIZE, settle

pytestmark = pytest.mark.anyio

# opt-1.3b on a 3 GiB budget: cuda is fastest but cannot fit, auto beats cpu.
RUN = dict(
    parameters=1_315_758_080,
    device_budget=3 * GiB,
    n_chunks=72,
    policy="auto",
    margin_ratio=0.3,
)
AUTO = Setting("auto", 0.3, 3 * GiB)
CUDA = Setting("cuda", 0.3, 3 * GiB)
CPU = Setting("cpu", 0.3, 3 * GiB)
PER = 3  # steps each setting runs: 2 settled, too few for a star (BEST_MIN_SETTLED)


def tuning_app(per: int = PER) -> tuple[TuitrainApp, FakeWorker]:
    settings = Settings(model="opt-1.3b")
    settings.engine.device_budget = "3GiB"
    settings.engine.margin_ratio = 0.3
    fake = FakeWorker(
        fake_run(per, model="opt-1.3b", **RUN),
        steps_per_poll=10_000,
        restep=follow_settings(**RUN),
    )
    return TuitrainApp(settings, worker_factory=lambda _: fake), fake


async def try_three_settings(
    app: TuitrainApp, fake: FakeWorker, pilot, per: int = PER
) -> TrialsTable:
    """auto for steps 1-3, then c: cuda for 4-6, then c: cpu for 7-9 (`per` steps each)."""
    await settle(app, pilot)
    for first in (per + 1, 2 * per + 1):
        await pilot.press("c")
        fake.emit(*(Step(fake_stats(n, **RUN)) for n in range(first, first + per)))
        await settle(app, pilot)
    return app.query_one(TrialsTable)


async def test_each_setting_tried_is_a_row_with_its_spread_and_no_star_on_two_steps():
    app, fake = tuning_app()
    async with app.run_test(size=(200, 60)) as pilot:
        table = await try_three_settings(app, fake, pilot)
        assert [t.setting for t in table.trials] == [AUTO, CUDA, CPU]
        assert [table.cell_text(s, "mark") for s in (AUTO, CUDA, CPU)] == ["", "!", ""]
        assert table.cell_text(AUTO, "spread") == "±0%"
        assert str(BEST_MIN_SETTLED) in table.border_subtitle
        assert table.cell_text(CUDA, "note").startswith(" peak 20.8 GiB, RSS ")
        assert table.cell_text(CPU, "note").endswith(", 7.4 GiB copied")


async def test_each_setting_tried_is_a_row_and_the_fastest_within_budget_is_marked():
    app, fake = tuning_app(BEST_MIN_SETTLED + 1)
    async with app.run_test(size=(200, 60)) as pilot:
        table = await try_three_settings(app, fake, pilot, BEST_MIN_SETTLED + 1)
        assert [t.setting for t in table.trials] == [AUTO, CUDA, CPU]
        assert table.cell_text(AUTO, "mark") == "★"
        assert table.cell_text(CUDA, "mark") == "!"  # fastest, but over its budget
        assert table.cell_text(CPU, "mark") == ""
        assert table.cell_text(CPU, "policy") == "cpu ●"  # in force
        auto, cuda, cpu = table.trials
        assert cuda.step_seconds < auto.step_seconds < cpu.step_seconds
        assert not cuda.within_budget and auto.within_budget and cpu.within_budget
        assert (auto.steps, auto.settled_steps) == (BEST_MIN_SETTLED + 1, BEST_MIN_SETTLED)


async def test_the_cursor_follows_the_setting_in_force_until_the_user_picks_a_row():
    app, fake = tuning_app()
    async with app.run_test(size=(200, 60)) as pilot:
        await settle(app, pilot)
        table = app.query_one(TrialsTable)
        await pilot.press("c")
        fake.emit(Step(fake_stats(4, **RUN)))
        await settle(app, pilot)
        assert table.selected.setting == CUDA  # followed the change
        table.focus()
        await pilot.press("up")
        await settle(app, pilot)
        assert table.selected.setting == AUTO
        app.set_focus(None)
        await pilot.press("c")  # cpu
        fake.emit(Step(fake_stats(5, **RUN)))
        await settle(app, pilot)
        assert table.selected.setting == AUTO  # the user's pick stays
        table.follow_in_force()
        assert table.selected.setting == CPU


async def test_s_saves_the_selected_row_with_what_was_measured_for_it():
    app, fake = tuning_app()
    async with app.run_test(size=(200, 60)) as pilot:
        table = await try_three_settings(app, fake, pilot)
        auto = table.trials[0]
        table.focus()
        await pilot.press("up", "up")  # from cpu, in force, to auto
        app.set_focus(None)
        await pilot.press("s")
        await pilot.pause()
        dialog = app.screen
        assert isinstance(dialog, SaveDialog)
        assert dialog.path == str(saved_dir() / "opt-1.3b-auto-margin0.3-3GiB.yaml")
        assert "policy auto · margin 0.30 · budget 3GiB (tried at steps 1-3)" in dialog.summary
        assert "3 steps, 1.70 s/step, 151 tok/s (median of 2 settled steps, ±0%)" in (
            dialog.summary
        )
        await pilot.press("enter")
        await pilot.pause()
    path = saved_dir() / "opt-1.3b-auto-margin0.3-3GiB.yaml"
    saved = load_preset(path)
    assert (saved.engine.policy, saved.engine.margin_ratio) == ("auto", 0.3)
    assert saved.engine.device_budget.nbytes == 3 * GiB
    assert app.settings.engine.policy == "cpu"  # what runs is not what was saved
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    assert "# reproduce: tuitrain run --preset opt-1.3b-auto-margin0.3-3GiB" in header
    (measured,) = [line for line in header if line.startswith("# measured")]
    assert measured.startswith("# measured over steps 1-3 (median of 2 settled steps): ")
    assert f"{format_seconds(auto.step_seconds)}/step" in measured
    assert f"device peak {format_size(auto.device_peak)}," in measured
    assert f"host RSS {format_size(auto.process_rss)}" in measured
    assert "copied" in measured and "over the budget" not in measured


async def test_enter_on_a_row_saves_that_row_and_says_it_went_over_its_budget():
    app, fake = tuning_app()
    async with app.run_test(size=(200, 60)) as pilot:
        table = await try_three_settings(app, fake, pilot)
        table.focus()
        await pilot.press("up", "enter")  # the cuda row
        await pilot.pause()
        dialog = app.screen
        assert isinstance(dialog, SaveDialog)
        assert dialog.path.endswith("opt-1.3b-cuda-margin0.3-3GiB.yaml")
        assert "(over budget)" in dialog.summary
        await pilot.press("enter")
        await pilot.pause()
    text = (saved_dir() / "opt-1.3b-cuda-margin0.3-3GiB.yaml").read_text()
    assert "(over budget)" in text


async def test_a_save_before_the_first_step_writes_the_settings_in_force():
    app, fake = tuning_app()
    fake._source = []  # no step comes
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("s")
        await pilot.pause()
        assert "nothing measured" in app.screen.summary
        await pilot.press("enter")
        await pilot.pause()
    saved = load_preset(saved_dir() / "opt-1.3b-auto-margin0.3-3GiB.yaml")
    assert saved.engine.margin_ratio == 0.3


async def test_a_restart_starts_the_trials_over():
    app, fake = tuning_app()
    async with app.run_test(size=(200, 60)) as pilot:
        table = await try_three_settings(app, fake, pilot)
        fake.emit(Failed("boom"))
        await settle(app, pilot)
        await pilot.press("r")
        await pilot.pause()
        assert table.trials == [] and table.row_count == 0


def candidate(setting: Setting, status: str, *, seconds: float = 1.0, over: str = "",
              slower: float | None = None, reason: str = "") -> tune.Trial:
    fits = status != tune.DOES_NOT_FIT
    trial = tune.Trial(
        tune.Candidate(setting.policy, setting.margin_ratio, 2, 1, False, setting.device_budget),
        tune.Forecast(fits, seconds if fits else 0.0, reason, over=over),
        status=status, reason=reason)
    trial.slower = slower
    return trial


def columns_fit(table: TrialsTable) -> bool:
    """Every column inside the table's width: none scrolled off to the right."""
    used = sum(column.get_render_width(table) for column in table.columns.values())
    return used <= table.scrollable_content_region.width and table.max_scroll_x == 0


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24 trials", "120x40 tuning"])
async def test_the_tuners_candidates_are_rows_that_fit_the_small_screens(size):
    app, fake = tuning_app()
    async with app.run_test(size=size) as pilot:
        table = await try_three_settings(app, fake, pilot)
        await pilot.press("v")  # the trials view (80x24), the tuning view (120x40)
        await settle(app, pilot)
        assert table.display and columns_fit(table)
        slow = Setting("auto", 0.5, 3 * GiB)
        wide = Setting("cuda", 0.0, 3 * GiB)
        table.show_candidate(candidate(CPU, tune.MEASURING, seconds=2.0), tokens=256)
        table.show_candidate(candidate(slow, tune.SLOWER, seconds=2.5, slower=0.12), 256)
        table.show_candidate(candidate(wide, tune.DOES_NOT_FIT, over="device +17.8 GiB",
                                       reason="needs 20.8 GiB on the device"), 256)
        await pilot.pause()
        assert columns_fit(table)
        # The one in trial is marked, with its forecast beside what it measured.
        assert table.cell_text(CPU, "mark") == "▶"
        assert table.cell_text(CPU, "forecast") == "2.00 s"
        assert table.cell_text(CPU, "seconds") == format_seconds(table.trials[2].step_seconds)
        assert table.cell_text(CPU, "note").startswith(" measuring: ")
        # Those not tried say why, and what they were forecast to do.
        assert table.cell_text(slow, "forecast") == "2.50 s"
        assert table.cell_text(slow, "rate") == "102"  # 256 tokens / 2.5 s, forecast
        assert table.cell_text(slow, "note") == " fcst +12% slower"
        assert table.cell_text(wide, "note") == " device +17.8 GiB"
        assert table.cell_text(wide, "mark") == "✗"  # does not fit
        assert table.cell_text(wide, "forecast") == ""
        # What a row says is on the screen, not cut: the least note fits "fcst +12% slower".
        assert table.columns["note"].width >= len(" fcst +12% slower")
        # The longest step time (300.8 ms) keeps a space from the column before it.
        assert all(table.columns[c].width > len("300.8 ms") for c in ("forecast", "seconds"))
        # A new search forgets the last one's candidates, not the settings the run used.
        table.forget_candidates()
        table.show([*table.trials], table.in_force)
        assert table.row_count == 3 and table.cell_text(CPU, "mark") == ""


async def test_a_tried_rows_note_names_the_figure_the_search_decided_by():
    app, fake = tuning_app()
    async with app.run_test(size=(200, 60)) as pilot:
        table = await try_three_settings(app, fake, pilot)
        best = candidate(AUTO, tune.MEASURED)
        best.steps, best.measured = [0.0325, 0.0330, 0.0320], 0.0325
        stopped = candidate(CPU, tune.STOPPED_EARLY, slower=1.08)
        stopped.steps, stopped.measured = [0.0676], 0.0676
        table.show_candidate(best, tokens=256)
        table.show_candidate(stopped, tokens=256)
        await pilot.pause()
        # The s/step column is the median of every settled step the run made with the
        # setting; the note says what the search measured, and over which steps.
        assert table.cell_text(AUTO, "note").startswith(
            " tune: 32.5 ms, median of its 3 trial steps; peak ")
        assert table.cell_text(CPU, "note").startswith(
            " stopped: +108%, fastest of its 1 trial step 67.6 ms; peak ")
