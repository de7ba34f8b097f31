"""The warning a run prints at its start when the planner says it will not fit: why, and
what would."""

from __future__ import annotations

from tuitrain.fit import warn_if_unfit
from tuitrain.settings import Settings


def test_warn_if_unfit_says_why_and_what_would_fit():
    tight = Settings.model_validate(
        {
            "model": "tiny",
            "engine": {"policy": "cuda", "device_budget": "12MiB", "precision": "bf16"},
            "training": {"batch_size": 2, "seq_len": 64},
        }
    )
    line = warn_if_unfit(tight)
    assert line is not None and "\n" not in line
    assert "policy cuda will not fit" in line and "12.0 MiB" in line
    assert "policy auto would" in line


def test_warn_if_unfit_is_silent_when_the_run_fits():
    roomy = Settings.model_validate(
        {
            "model": "tiny",
            "engine": {"policy": "auto", "device_budget": "1GiB", "precision": "bf16"},
            "training": {"batch_size": 2, "seq_len": 64},
        }
    )
    assert warn_if_unfit(roomy) is None

