"""The user's own presets: saved in their configuration folder, listed apart from the
shipped ones, found by name before them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tuitrain.test_presets import SHIPPED  # the hardware stories, one file each
from tuitrain.presets import (
    CONFIG_ENV,
    SHIPPED_DIR,
    PresetError,
    config_dir,
    dump_preset,
    find_preset,
    list_presets,
    list_saved_presets,
    preset_listing,
    save_preset,
    saved_dir,
)
from tuitrain.settings import Settings


def save_mine(name: str, model: str = "tiny", **engine) -> Path:
    settings = Settings(model=model)
    for key, value in engine.items():
        setattr(settings.engine, key, value)
    saved_dir().mkdir(parents=True, exist_ok=True)
    measured = {"device_peak": 2 * 1024**3, "step_seconds": 0.5, "step": 9, "first_step": 4}
    return save_preset(settings, saved_dir() / f"{name}.yaml", measured=measured)


def test_saved_presets_live_in_the_users_config_folder(user_config, monkeypatch):
    assert config_dir() == user_config  # every test has its own (tests/conftest.py)
    assert saved_dir() == user_config / "presets"
    monkeypatch.delenv(CONFIG_ENV)
    assert config_dir().name == "tuitrain" and config_dir() != user_config


def test_a_saved_preset_is_listed_apart_from_the_shipped_ones():
    assert list_saved_presets() == []
    assert preset_listing() == [f"{n:<12}  {d}" for n, d in list_presets()]  # nothing more
    save_mine("fast-laptop", policy="cpu", margin_ratio=0.25)
    assert set(dict(list_presets())) == SHIPPED  # a saved one is never among the shipped
    ((name, description),) = list_saved_presets()
    assert name == "fast-laptop"
    assert description.startswith("tiny: cpu, margin 0.25, budget default; saved ")
    assert description.endswith("measured over steps 4-9: device peak 2.0 GiB, step time 0.5 s")
    lines = preset_listing()
    assert lines[len(SHIPPED)] == ""
    assert lines[len(SHIPPED) + 1] == f"saved, in {saved_dir()} (a name finds these first):"
    assert lines[-1].startswith("fast-laptop   tiny: cpu")


def test_a_name_finds_a_saved_preset_first_then_a_shipped_one():
    assert find_preset("cpu-only") == SHIPPED_DIR / "cpu-only.yaml"
    mine = save_mine("mine")
    assert find_preset("mine") == mine and find_preset("mine.yaml") == mine
    own = save_mine("cpu-only")
    assert find_preset("cpu-only") == own
    saved = preset_listing()[len(SHIPPED) + 2 :]
    assert saved[0].startswith("cpu-only") and saved[0].endswith("[hides the shipped one]")
    assert not saved[1].endswith("[hides the shipped one]")


def test_an_unknown_preset_names_the_saved_ones_too():
    save_mine("mine")
    with pytest.raises(PresetError, match=r"shipped: .*cpu-only.*; saved: mine\)"):
        find_preset("gaming-rig")


def test_a_trials_measurements_in_the_header():
    text = dump_preset(
        Settings(model="tiny"),
        measured={
            "first_step": 4,
            "step": 9,
            "settled_steps": 5,
            "device_peak": 7 * 1024**3,
            "within_budget": False,
            "step_seconds": 2.0,
            "bytes_copied_per_step": 3 * 1024**2,
            "process_rss": 12 * 1024**3,
        },
    )
    assert (
        "# measured over steps 4-9 (median of 5 settled steps): device peak 7.0 GiB "
        "(over the budget), step time 2 s, copied 3.0 MiB/step, host RSS 12.0 GiB"
    ) in text.splitlines()
