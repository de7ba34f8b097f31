"""The user's own presets: saved in their configuration folder, listed apart from the
shipped ones, found by name before them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tuitrain.test_presets import SHIPPED  # the hardware stories, one file each
from tuitrain.preset_folders import (
    CONFIG_ENV,
    SHIPPED_DIR,
    config_dir,
    default_preset_name,
    find_preset,
    list_presets,
    list_saved_presets,
    preset_listing,
    saved_dir,
)
from tuitrain.presets import PresetError, dump_preset, save_preset
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
    assert not any(line.startswith("saved, in") or not line for line in preset_listing())
    save_mine("fast-laptop", policy="cpu", margin_ratio=0.25)
    assert set(dict(list_presets())) == SHIPPED  # a saved one is never among the shipped
    ((name, description),) = list_saved_presets()
    assert name == "fast-laptop"
    assert description.startswith("tiny: cpu, margin 0.25, budget default; 500.0 ms/step, "
                                  "device peak 2.0 GiB; saved ")
    lines = preset_listing()
    apart = lines.index("")
    assert lines[apart + 1] == f"saved, in {saved_dir()} (a name finds these first):"
    assert lines[-1].startswith("fast-laptop   tiny: cpu")


def test_a_name_finds_a_saved_preset_first_then_a_shipped_one():
    assert find_preset("cpu-only") == SHIPPED_DIR / "cpu-only.yaml"
    mine = save_mine("mine")
    assert find_preset("mine") == mine and find_preset("mine.yaml") == mine
    own = save_mine("cpu-only")
    assert find_preset("cpu-only") == own
    listing = preset_listing()
    saved = listing[listing.index("") + 2 :]
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
        "# measured over steps 4-9 (median of 5 settled steps): 2.00 s/step, device peak "
        "7.0 GiB (over budget), copied 3.0 MiB/step, host RSS 12.0 GiB"
    ) in text.splitlines()


def test_a_saved_presets_line_fits_100_columns_cut_between_its_figures():
    """A trial's header names seven figures: the listing keeps what fits, whole."""
    settings = Settings(model="opt-350m")
    settings.engine.policy, settings.engine.margin_ratio = "auto", 0.35
    saved_dir().mkdir(parents=True, exist_ok=True)
    measured = {"first_step": 12, "step": 180, "settled_steps": 167, "step_seconds": 1.234,
                "tokens_per_second": 8295.4, "device_peak": 5 * 1024**3,
                "bytes_copied_per_step": 3 * 1024**3, "process_rss": 14 * 1024**3,
                "within_budget": True}
    save_preset(settings, saved_dir() / "opt-350m-auto-margin0.35.yaml", measured=measured)
    line = preset_listing()[-1]
    assert len(line) <= 100, line
    assert line.startswith("opt-350m-auto-margin0.35  opt-350m: auto, margin 0.35, budget "
                           "default; 1.23 s/step, 8,295 tok/s")
    assert line.endswith(" ..."), "what did not fit is said to be left out"


def test_the_default_name_of_a_saved_preset_tells_its_settings_apart():
    assert default_preset_name("opt-1.3b", "auto", 0.0) == "opt-1.3b-auto.yaml"
    assert default_preset_name("opt-1.3b", "auto", 0.1) == "opt-1.3b-auto-margin0.1.yaml"
    assert default_preset_name("/models/my-opt/", "cpu", 0.25, "3GiB") == (
        "my-opt-cpu-margin0.25-3GiB.yaml")
    assert default_preset_name("tiny", "auto", 0.5, "2GiB", batch_size=4, grad_accum=2,
                               checkpointing=True) == (
        "tiny-auto-margin0.5-2GiB-4x2-checkpointing.yaml")
    assert default_preset_name("tiny", "auto", 0.5, "2GiB", batch_size=8) == (
        "tiny-auto-margin0.5-2GiB.yaml")  # one micro-batch a step: nothing to tell apart
