"""This machine's speeds, measured once and kept: what the time model turns work into seconds
with (engine.planning.time_model).

    cal = calibration(say=print)           # the cached one, or measured now (at most ~30 s)
    cal.matmul_rate("fp32", hidden=768), cal.h2d, cal.adamw_host, cal.disk_read

Three parts, each a module of its own: the figures' record, `Calibration`
(engine.planning.speeds); their measurement, `measure` (engine.planning.measurement, with
the probes of engine.planning.probes, engine.planning.disk_speed and a real decoder's,
engine.planning.reference_decoder); and, here, where they are kept and what runs teach
them. `Calibration` and `measure` are imported from here too.

The figures are cached under the user cache folder, one file per machine fingerprint: the
CPU model, vector instructions and cores, the torch version and the GPU's name, driver and
memory (engine.planning.machine). A different machine, or a new torch, measures again; so
does a quiet machine whose figures were measured while its cores were busy.

Runs teach it: beside the figures, a correction (measured / forecast step time, learned from
the steps a tune measured: `learn`) that every later forecast on this machine in the same
precision is multiplied by: the median of what the last LEARNED_RUNS runs measured, within
CORRECTION_BOUNDS, so that one run on a loaded machine moves it little and no run moves it
far. Each precision learns apart: the model's error is not the same in each (on this
project's machine, with bf16 units, bf16 steps took 1.37x their forecast where fp32's took
about their forecast). A new measurement starts them over.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path

from engine.data.tokenizer import atomic_write, cache_dir
from engine.planning.machine import busy, fingerprint, load_average, quiet
from engine.planning.measurement import TIME_LIMIT, measure
from engine.planning.speeds import DTYPES, FORMAT, Calibration

__all__ = [
    "DTYPES",
    "Calibration",
    "calibration",
    "calibration_path",
    "fingerprint",
    "learn",
    "learned_path",
    "load_calibration",
    "measure",
    "save_calibration",
]

# The correction is the median of the last runs' measured / uncorrected forecast, so that a
# run whose steps waited for cores (a shared machine) is one voice among several; and it
# stays within bounds: a run 2x or more off its forecast was disturbed (seen: x12 at a load
# of 30 on 2 cores), and would rank the next tune's candidates by that moment's load.
LEARNED_RUNS = 9
CORRECTION_BOUNDS = (0.5, 2.0)
CORRECTION_RANGE = (1e-3, 1e3)  # beyond these a run measured nonsense: it teaches nothing


def calibration_path(key: str | None = None) -> Path:
    """The cache file of the machine with fingerprint `key` (default: this one)."""
    return cache_dir() / "calibration" / f"{key or fingerprint()[0]}.json"


def learned_path(key: str | None = None) -> Path:
    """The file of what runs taught the calibration of machine `key` (default: this one)."""
    return calibration_path(key).with_suffix(".learned.json")


def load_calibration(key: str | None = None, precision: str = "fp32") -> Calibration | None:
    """The cached calibration of this machine, with what runs in `precision` taught it, or
    None (none, unreadable, or outdated)."""
    try:
        data = json.loads(calibration_path(key).read_text(encoding="utf-8"))
        if data.get("format") != FORMAT:
            return None
        cal = Calibration.from_dict(data)
    except (OSError, ValueError, TypeError, KeyError):
        return None
    cal.taught_for = precision
    taught = _learned(cal).get(precision)
    if taught is not None:
        try:
            ratios = [float(r) for r in taught["ratios"]]
            cal.learned = ratios[-LEARNED_RUNS:]
            cal.correction = _correction(cal.learned)
            cal.learned_from = int(taught["runs"])
        except (ValueError, TypeError, KeyError):
            pass
    return cal


def _learned(cal: Calibration) -> dict[str, dict]:
    """What runs taught `cal`'s measurement, by precision (empty: nothing, or what they
    taught an older measurement)."""
    try:
        learned = json.loads(learned_path(cal.fingerprint).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(learned, dict) or learned.get("measured_at") != cal.measured_at:
        return {}
    taught = learned.get("precisions")
    return taught if isinstance(taught, dict) else {}


def _correction(ratios: list[float]) -> float:
    low, high = CORRECTION_BOUNDS
    return min(high, max(low, statistics.median(ratios))) if ratios else 1.0


def learn(cal: Calibration, ratio: float) -> Calibration:
    """What a run measured teaches the calibration: `ratio` is its step times over their
    forecasts (made with `cal`, its correction included, in `cal.taught_for`). The new
    correction is the median of the last LEARNED_RUNS runs' ratios, within
    CORRECTION_BOUNDS; kept beside the calibration for the next forecast in that precision,
    and returned. A ratio beyond CORRECTION_RANGE teaches nothing.

    Raises OSError when the file cannot be written."""
    low, high = CORRECTION_RANGE
    if not low <= ratio <= high:
        return cal
    # Against the model alone, so that every run's voice is comparable whatever the
    # correction its forecast carried.
    ratios = [*cal.learned, ratio * cal.correction][-LEARNED_RUNS:]
    taught = dataclasses.replace(cal, correction=_correction(ratios), learned=ratios,
                                 learned_from=cal.learned_from + 1)
    path = learned_path(cal.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    precisions = {**_learned(cal), cal.taught_for: {
        "correction": taught.correction, "ratios": ratios, "runs": taught.learned_from}}
    text = json.dumps({"measured_at": cal.measured_at, "precisions": precisions},
                      indent=2) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return taught


def save_calibration(cal: Calibration) -> Path:
    path = calibration_path(cal.fingerprint)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(cal.to_dict(), indent=2) + "\n",
                                                  encoding="utf-8"))
    return path


def calibration(*, refresh: bool = False, say: Callable[[str], None] | None = None,
                measure_fn: Callable[..., Calibration] | None = None,
                precision: str = "fp32") -> Calibration:
    """This machine's calibration, with what runs in `precision` taught it: the cached one,
    or measured now and cached (`refresh`: measured now whatever the cache holds). `say`
    hears one line before a measurement."""
    cached = None if refresh else load_calibration(precision=precision)
    if cached is not None and not (busy(cached.extra.get("load")) and quiet(load_average())):
        return cached
    if say is not None:
        why = ("" if cached is None else f"the cached one was measured while the machine was "
               f"busy (load {cached.extra['load']:.1f}); now it is quiet: ")
        say(f"{why}calibrating this machine's speeds (at most {TIME_LIMIT:.0f} s, once per "
            f"machine; `tuitrain calibrate` shows them)...")
    cal = (measure_fn or measure)()
    cal.taught_for = precision
    try:
        save_calibration(cal)
        learned_path(cal.fingerprint).unlink(missing_ok=True)  # taught the old figures
    except OSError as error:  # a read-only cache: forecast anyway, and measure next time
        if say is not None:
            say(f"calibration not cached ({error.strerror or error}): "
                f"{calibration_path(cal.fingerprint)}")
    return cal
