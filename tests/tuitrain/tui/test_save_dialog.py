"""Saving a preset from the app: into the user's presets folder, what is written, and never a
silent overwrite."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from textual.widgets import Static

from tests.tuitrain.fakeworker import fake_run, fake_stats
from tuitrain.events import Step
from tuitrain.preset_folders import find_preset, list_saved_presets, saved_dir
from tuitrain.presets import load_preset
from tuitrain.tui.app import TuitrainApp
from tuitrain.tui.controls import Controls
from tuitrain.tui.save_dialog import (
    ConfirmOverwrite,
    SaveDialog,
    default_preset_path,
    reproducing_command,
    shown_path,
)

from .helpers import SIZE, make_app, settle

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def preset() -> Path:
    """Where `s`, Enter saves opt-125m under auto: the user's folder (tests/conftest.py
    gives each test an empty one)."""
    return saved_dir() / "opt-125m-auto.yaml"


async def open_dialog(app: TuitrainApp, pilot) -> SaveDialog:
    await settle(app, pilot)
    await pilot.press("s")
    await pilot.pause()
    assert isinstance(app.screen, SaveDialog)
    return app.screen


def test_the_default_path_is_model_and_policy_in_the_users_presets_folder(user_config):
    assert default_preset_path("opt-1.3b", "cpu") == str(user_config / "presets/opt-1.3b-cpu.yaml")
    assert default_preset_path("/models/my-opt/", "auto").endswith("/presets/my-opt-auto.yaml")


def test_a_path_under_the_home_folder_reads_with_a_tilde():
    assert shown_path(Path.home() / ".config/tuitrain/presets/x.yaml") == (
        "~/.config/tuitrain/presets/x.yaml"
    )
    assert shown_path(Path("/srv/presets/x.yaml")) == "/srv/presets/x.yaml"


def test_a_saved_preset_is_reproduced_by_its_name_any_other_by_its_path(user_config):
    assert reproducing_command(str(saved_dir() / "opt-125m-auto.yaml")) == (
        "tuitrain run --preset opt-125m-auto"
    )
    assert reproducing_command("elsewhere/x.yaml") == "tuitrain run --preset elsewhere/x.yaml"
    # A data-parallel run is run again on as many ranks.
    assert reproducing_command("elsewhere/x.yaml", 2) == (
        "tuitrain run --preset elsewhere/x.yaml --nproc 2")


async def test_enter_saves_the_settings_with_the_command_and_the_measurements(preset):
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await open_dialog(app, pilot)
        assert dialog.query_one("#preset-path").value == str(preset)
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, SaveDialog)
    text = preset.read_text()
    assert "# reproduce: tuitrain run --preset opt-125m-auto\n" in text
    assert "measured over steps 1-3 (median of 2 settled steps)" in text
    assert "device peak" in text and "host RSS" in text
    saved = load_preset(preset)
    assert saved == app.settings
    assert saved.model == "opt-125m" and saved.engine.policy == "auto"
    assert find_preset("opt-125m-auto") == preset  # `--preset opt-125m-auto` finds it
    assert not Path("presets").exists()  # nothing lands in the working folder


async def test_a_preset_saved_from_a_data_parallel_run_runs_again_on_as_many_ranks(preset):
    app, _ = make_app(fake_run(3, ranks=2))
    async with app.run_test(size=SIZE) as pilot:
        await open_dialog(app, pilot)
        await pilot.press("enter")
        await pilot.pause()
    assert "# reproduce: tuitrain run --preset opt-125m-auto --nproc 2\n" in preset.read_text()


async def test_the_preset_holds_the_changes_the_worker_applied_and_not_the_pending_ones():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        await pilot.press("c")  # auto -> cuda
        fake.emit(Step(fake_stats(4)))
        await settle(app, pilot)
        await pilot.press("plus")  # still pending when saved
        dialog = await open_dialog(app, pilot)
        assert dialog.query_one("#preset-path").value == str(saved_dir() / "opt-125m-cuda.yaml")
        await pilot.press("enter")
        await pilot.pause()
    saved = load_preset(saved_dir() / "opt-125m-cuda.yaml")
    assert saved.engine.policy == "cuda"
    assert saved.engine.margin_ratio == 0.0


async def test_an_existing_file_is_kept_unless_the_user_says_yes(preset):
    preset.parent.mkdir(parents=True)
    preset.write_text("# mine\n")
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await open_dialog(app, pilot)
        await pilot.press("enter")
        await pilot.pause()
        assert isinstance(app.screen, ConfirmOverwrite)
        assert preset.read_text() == "# mine\n"
        await pilot.press("n")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmOverwrite)
        assert preset.read_text() == "# mine\n"

        await open_dialog(app, pilot)
        await pilot.press("enter")
        await pilot.pause()
        assert preset.read_text() == "# mine\n"
        await pilot.press("y")
        await pilot.pause()
    assert load_preset(preset).model == "opt-125m"


async def test_escape_cancels_without_writing(preset):
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await open_dialog(app, pilot)
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, SaveDialog)
    assert not preset.exists()


async def test_typing_in_the_path_field_does_not_trigger_the_app_keys():
    app, fake = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await open_dialog(app, pilot)
        await pilot.press("ctrl+a", "ctrl+k", *"my cpu+run.yaml", "enter")
        await pilot.pause()
    assert fake.commands == []
    # A name alone: a saved preset's (test_a_name_alone_is_a_saved_preset_...).
    assert load_preset(saved_dir() / "my cpu+run.yaml").engine.policy == "auto"


async def test_a_path_that_cannot_be_written_is_reported_and_the_app_stays_open(in_tmp_path):
    (in_tmp_path / "blocker").write_text("a file, not a folder")
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        await open_dialog(app, pilot)
        await pilot.press("ctrl+a", "ctrl+k", *"blocker/x.yaml", "enter")
        await pilot.pause()
        assert "could not save blocker/x.yaml" in app.query_one(Controls).message
        assert app.is_running


async def test_rows_that_differ_in_checkpointing_or_split_are_offered_different_names():
    split = [Step(dataclasses.replace(fake_stats(n), micro_batches=2)) for n in (4, 5, 6)]
    checkpointed = [Step(dataclasses.replace(fake_stats(n), activation_checkpointing=True))
                    for n in (7, 8, 9)]
    app, _ = make_app([*fake_run(3), *split, *checkpointed])
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        rows = app.trial_book.rows()
        assert len(rows) == 3
        offered = []
        for row in rows:
            app.save_trial(row)
            await pilot.pause()
            assert isinstance(app.screen, SaveDialog)
            offered.append(Path(app.screen.query_one("#preset-path").value).name)
            await pilot.press("escape")
            await pilot.pause()
    assert len(set(offered)) == 3, offered
    assert offered[0] == "opt-125m-auto.yaml"
    assert "checkpointing" in offered[2] and "checkpointing" not in offered[1]


async def test_a_path_in_a_folder_that_does_not_exist_is_refused_in_the_dialog(in_tmp_path):
    """As `--save-preset` refuses it: nothing is made, the dialog stays open to fix it."""
    missing = in_tmp_path / "no" / "such"
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await open_dialog(app, pilot)
        dialog.query_one("#preset-path").value = str(missing / "x.yaml")
        await pilot.press("enter")
        await pilot.pause()
        assert app.screen is dialog
        error = dialog.query_one("#preset-error", Static)
        assert error.display and str(error.render()) == f"folder not found: {missing}"
        assert not (in_tmp_path / "no").exists()
        dialog.query_one("#preset-path").value = str(in_tmp_path / "x.yaml")
        await pilot.pause()
        assert not error.display  # the message goes as the path is changed
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, SaveDialog)
    assert load_preset(in_tmp_path / "x.yaml").model == "opt-125m"
    assert not (in_tmp_path / "no").exists()


@pytest.mark.parametrize("typed", ["mine", "mine.yaml", "{saved}/mine"])
async def test_a_name_alone_is_a_saved_preset_that_the_listing_and_preset_name_find(typed):
    """A name with no folder part saves `<name>.yaml` among the user's presets, as the path
    the dialog offers does; so does a name without `.yaml` in that folder."""
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await open_dialog(app, pilot)
        dialog.query_one("#preset-path").value = typed.format(saved=saved_dir())
        await pilot.press("enter")
        await pilot.pause()
        assert not isinstance(app.screen, SaveDialog)
        said = app.query_one(Controls).message.replace("\n", "")  # wrapped to its width
        assert said == f"saved preset {saved_dir() / 'mine.yaml'}"
    assert sorted(p.name for p in saved_dir().iterdir()) == ["mine.yaml"]
    assert not Path("mine").exists() and not Path("mine.yaml").exists()
    assert find_preset("mine") == saved_dir() / "mine.yaml"  # `--preset mine`
    assert [name for name, _ in list_saved_presets()] == ["mine"]  # `tuitrain presets`
    assert "# reproduce: tuitrain run --preset mine\n" in (saved_dir() / "mine.yaml").read_text()


async def test_a_path_with_a_folder_part_is_saved_where_it_says(in_tmp_path):
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SIZE) as pilot:
        dialog = await open_dialog(app, pilot)
        dialog.query_one("#preset-path").value = "./here.yaml"
        await pilot.press("enter")
        await pilot.pause()
    assert load_preset(in_tmp_path / "here.yaml").model == "opt-125m"
    assert "# reproduce: tuitrain run --preset ./here.yaml\n" in (
        in_tmp_path / "here.yaml").read_text()
    assert not saved_dir().exists()
