"""`tuitrain run --preset` of a tuned preset: tuned on another machine, or steps far from
the pace the tune measured here, is said once."""

from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest

import tuitrain.headless
from engine.planning.calibration import fingerprint
from tests.tuitrain.fakeworker import fake_stats
from tuitrain.cli import main
from tuitrain.events import Step
from tuitrain.headless import _Report
from tuitrain.presets import save_preset
from tuitrain.run_preset import PresetPace, tuned_origin
from tuitrain.settings import Settings
from tuitrain.trials import BEST_MIN_SETTLED


def tuned_preset(tmp_path: Path, machine: str, seconds: float = 0.25) -> Path:
    """A preset as `tuitrain tune --save-preset` writes it (tuitrain.tune_main._save)."""
    path = tmp_path / "tuned.yaml"
    settings = Settings(model="tiny", engine={"policy": "auto", "precision": "fp32"},
                        training={"batch_size": 2, "seq_len": 16, "steps": 2})
    save_preset(settings, path, command=f"tuitrain run --preset {path} --headless",
                measured={"step_seconds": seconds, "tokens_per_second": 32 / seconds,
                          "settled_steps": 3, "forecast": "240.0 ms/step",
                          "tuned on machine": machine, "search": "3 of 9 settings tried"})
    return path


def steps(seconds: float, n: int = BEST_MIN_SETTLED + 3) -> list:
    return [dataclasses.replace(fake_stats(i), seconds=seconds) for i in range(1, n + 1)]


def test_the_header_of_a_tuned_preset_says_where_and_how_fast(tmp_path: Path) -> None:
    origin = tuned_origin(tuned_preset(tmp_path, "abcdef0123456789", seconds=0.25))
    assert origin is not None
    assert origin.machine == "abcdef0123456789"
    assert origin.step_seconds == pytest.approx(0.25)
    plain = tmp_path / "plain.yaml"
    save_preset(Settings(model="tiny"), plain, measured={"step_seconds": 0.25})
    assert tuned_origin(plain) is None  # saved from a run, not a tune


def test_run_of_a_preset_tuned_elsewhere_says_so_once_and_how_to_tune_it_here(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    path = tuned_preset(tmp_path, "0000000000000000")
    given = []

    def headless(settings, *, out, err, pace=None, on_started=None) -> int:
        given.append(pace)
        return 0

    monkeypatch.setattr(tuitrain.headless, "run_headless", headless)
    assert main(["run", "--preset", str(path), "--headless"]) == 0
    err = capsys.readouterr().err
    assert err.count("tuned on another machine") == 1
    assert f"`tuitrain tune --preset {path}` tunes it here" in err
    assert given == [None]  # another machine's pace says nothing of this one's


def test_run_of_a_preset_tuned_here_checks_the_pace(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys) -> None:
    path = tuned_preset(tmp_path, fingerprint()[0], seconds=0.25)
    given = []
    monkeypatch.setattr(tuitrain.headless, "run_headless",
                        lambda settings, *, out, err, pace=None, on_started=None:
                        given.append(pace) or 0)
    assert main(["run", "--preset", str(path), "--headless"]) == 0
    assert "another machine" not in capsys.readouterr().err
    (pace,) = given
    assert isinstance(pace, PresetPace) and pace.step_seconds == pytest.approx(0.25)


def test_a_pace_more_than_15_percent_off_is_said_once_after_enough_settled_steps() -> None:
    pace = PresetPace("tuned.yaml", 0.25)
    lines = [pace.record(stats) for stats in steps(0.325)]
    said = [line for line in lines if line]
    assert len(said) == 1
    # The first step is not settled: the line comes with the BEST_MIN_SETTLED-th settled one.
    assert lines.index(said[0]) == BEST_MIN_SETTLED
    assert "30% slower than the 250.0 ms the preset tuned.yaml measured" in said[0]
    assert "`tuitrain tune --preset tuned.yaml`" in said[0]
    quick = PresetPace("tuned.yaml", 0.25)
    assert "faster" in next(line for s in steps(0.2) if (line := quick.record(s)))
    close = PresetPace("tuned.yaml", 0.25)
    assert not any(close.record(stats) for stats in steps(0.27))  # 8% off: as tuned


def test_the_headless_run_says_the_pace_once_on_stderr() -> None:
    out, err = io.StringIO(), io.StringIO()
    report = _Report(settings=Settings(model="tiny"), out=out, err=err, log_path="w.log")
    report.pace = PresetPace("tuned.yaml", 0.25)
    for stats in steps(0.5):
        report.handle(Step(stats))
    assert err.getvalue().count("warning: steps take 500.0 ms") == 1
