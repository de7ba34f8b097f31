"""`tuitrain plan` forecasts seconds per step; `--hardware` plans for a GPU from its specs;
`tuitrain calibrate` shows and refreshes the machine's measured speeds.

The calibration is the fixed one tests/conftest.py caches (tests/calibrations.py)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest

from engine.devices import device
from engine.planning import calibration as calibration_module
from engine.planning.calibration import fingerprint, learn, load_calibration, save_calibration
from engine.planning.hardware import HARDWARE
from tests.calibrations import fixed_calibration
from tuitrain.cli import main

SMALL = ["--batch-size", "2", "--seq-len", "64", "--precision", "fp32"]
PARTS = {"total", "forward", "backward", "recompute", "copy_h2d", "copy_d2h", "optimizer_host",
         "optimizer_device", "disk", "collectives", "overlap"}


def test_json_rows_carry_step_seconds_with_their_parts_and_the_settings_they_assume(capsys):
    argv = ["plan", "tiny", "--device-mem", "20MiB", "--host-mem", "64GiB", "--json", *SMALL]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    for policy in ("cuda", "cpu", "auto"):
        seconds = data[policy]["step_seconds"]
        assert set(seconds) == PARTS
        assert seconds["total"] > 0 and seconds["forward"] > 0
        settings = data[policy]["settings"]
        assert settings["engine"]["policy"] == policy
        assert settings["engine"]["device_budget"] == 20 * 2**20
        assert settings["training"] == {"batch_size": 2, "seq_len": 64, "grad_accum": 1,
                                        "activation_checkpointing": False}
    cpu, cuda = data["cpu"]["step_seconds"], data["cuda"]["step_seconds"]
    assert cpu["copy_h2d"] > 0 and cuda["copy_h2d"] == 0
    assert cpu["optimizer_host"] > 0 and cuda["optimizer_device"] > 0
    assert data["step_seconds_source"] == "this machine's calibration"


def test_the_table_gives_each_row_its_time_per_step(capsys):
    assert main(["plan", "tiny", "--device-mem", "20MiB", "--host-mem", "64GiB", *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index("time per step, forecast from this machine's calibration:")
    rows = {line.split()[0]: line for line in lines[start + 1:start + 4]}
    assert list(rows) == ["cuda", "cpu", "auto"]
    assert rows["cuda"].endswith("(does not fit)")  # 20 MiB is too small for it
    assert "forward" in rows["cpu"] and "copies in" in rows["cpu"]
    assert "update on host" in rows["cpu"]
    assert lines[-1].startswith("recommended: ")


def test_hardware_plans_the_profiles_gpu_and_labels_time_an_estimate_from_specs(
        capsys, monkeypatch):
    monkeypatch.setattr(device, "host_has_bf16", lambda: False)  # this CPU's default: fp32
    assert main(["plan", "opt-125m", "--hardware", "a100-80gb", "--host-mem", "64GiB"]) == 0
    out = capsys.readouterr().out
    assert "device 80.0 GiB" in out and "simulated" not in out.split("\n")[1]
    assert "opt-125m, bf16" in out  # a GPU's precision, not the simulated device's fp32
    assert "forecast from the published specs of A100 80 GB (SXM), an estimate" in out
    assert main(["plan", "opt-125m", "--hardware", "laptop-6gb", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["device_mem"] == HARDWARE["laptop-6gb"].memory and data["simulated"] is False
    assert data["cuda"]["fits"] is True
    assert "RTX 3060 Laptop" in data["step_seconds_source"]
    # A device that runs beside its copies: the cpu row hides some of them.
    assert data["cpu"]["step_seconds"]["overlap"] > 0


def test_unknown_hardware_is_one_line_and_status_2(capsys):
    assert main(["plan", "tiny", "--hardware", "tpu-v9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--hardware: unknown hardware 'tpu-v9'" in err
    assert "a100-80gb" in err


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    """No calibration cached, and a measurement that takes no time."""
    monkeypatch.setenv("TUITRAIN_CACHE", str(tmp_path))
    measured = []

    def fake_measure():
        measured.append(1)
        return fixed_calibration(*fingerprint())

    monkeypatch.setattr(calibration_module, "measure", fake_measure)
    return measured


def test_calibrate_measures_once_says_so_and_refresh_measures_again(empty_cache, capsys):
    assert main(["calibrate"]) == 0
    first = capsys.readouterr()
    assert "calibrating this machine's speeds (at most 30 s" in first.err
    assert "matmul fp32: 10.0 GFLOPS at width 768" in first.out
    assert "AdamW:       100 M parameters/s on the host" in first.out
    assert "new memory:  238.4 MiB/s beyond writing it" in first.out
    assert "decoder:     x1.00 the rates' forecast" in first.out
    # fp16's figures on a CPU are bf16's, not a measurement of their own: said so.
    assert "matmul fp16: as bf16 (not measured apart on a CPU)" in first.out
    assert "engine:      10 µs per op (hooks and byte counting)" in first.out
    assert "busy" not in first.out  # the fixed figures record no load
    assert "learned:     nothing yet" in first.out
    assert "activations" not in first.out  # no kept heap measured them: the probe's rate
    save_calibration(dataclasses.replace(load_calibration(), activation_pages=5e8))
    learn(load_calibration(), 2.0)  # a tune's steps took twice their forecast
    assert main(["calibrate"]) == 0
    cached = capsys.readouterr()
    assert cached.err == ""  # cached: nothing measured
    assert "beyond writing it (each page faulted in, zeroed, unmapped); a step's activations " \
           "476.8 MiB/s" in cached.out
    assert "learned:     forecasts in fp32 x2.00, from the steps of 1 tune on this machine" in (
        cached.out)
    assert main(["calibrate", "--refresh", "--json"]) == 0
    again = capsys.readouterr()
    assert "calibrating" in again.err and json.loads(again.out)["h2d"] == 1e9
    assert json.loads(again.out)["correction"] == 1.0  # measured again: taught again
    assert empty_cache == [1, 1]


def test_a_command_measures_in_a_runs_heap_and_leaves_its_own_heap_when_cached(
        empty_cache, capsys, monkeypatch):
    """The decoder's new memory is what forecasts price apart only in the heap runs keep
    (engine.devices.host_memory.steady_heap): a command that measures takes it first; one
    that reads the cache (the app's process, when it tunes) keeps its own."""
    from engine.devices import host_memory

    heaps = []
    monkeypatch.setattr(host_memory, "steady_heap", lambda: heaps.append(1) or True)
    assert main(["calibrate"]) == 0
    assert empty_cache == [1] and heaps == [1]
    assert main(["calibrate"]) == 0
    assert empty_cache == [1] and heaps == [1]
    capsys.readouterr()


def test_calibrate_says_what_an_engine_cost_of_nothing_per_op_means(empty_cache, capsys):
    cal = fixed_calibration(*fingerprint())
    cal.op_overhead = 0.0  # tiny's steps took no longer than the decoder's factor forecast
    calibration_module.save_calibration(cal)
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert "engine:      nothing per op beyond the decoder's factor" in out
    assert "0 s per op" not in out


def test_calibrate_says_the_decoders_offset_beside_its_factor(empty_cache, capsys):
    cal = fixed_calibration(*fingerprint())
    cal.compute_factor, cal.compute_offset = 1.3, -0.0234
    cal.half_factor, cal.half_offset = 1.6, 0.012
    calibration_module.save_calibration(cal)
    assert main(["calibrate"]) == 0
    assert ("decoder:     x1.30 - 23.4 ms the rates' forecast for a real decoder's forward "
            "and backward in fp32, x1.60 + 12.0 ms in bf16 (per micro-batch") in (
        capsys.readouterr().out)


def test_calibrate_says_when_the_figures_were_measured_on_busy_cores(empty_cache, capsys,
                                                                     monkeypatch):
    cal = fixed_calibration(*fingerprint())
    cal.extra["load"] = 9.5
    calibration_module.save_calibration(cal)
    monkeypatch.setattr(calibration_module, "load_average", lambda: 9.0)  # busy still
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert main(["calibrate"]) == 0
    out = capsys.readouterr().out
    assert ", at a load of 9.5 on 2 cores" in out
    assert "(the cores were busy: every figure may be slow; measured again once" in out
    assert empty_cache == []  # kept: the cores are busy still


def test_the_first_plan_on_a_machine_measures_it_and_says_so(empty_cache, capsys):
    assert main(["plan", "tiny", "--device-mem", "1GiB", "--json", *SMALL]) == 0
    assert "calibrating" in capsys.readouterr().err and empty_cache == [1]


def test_the_help_names_every_shipped_profile():
    from tuitrain.cli import build_parser

    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    hardware = next(a for a in plan._actions if "--hardware" in a.option_strings)
    assert [n.strip() for n in hardware.help.split(":", 1)[1].split(",")] == list(HARDWARE)


def test_a_preset_names_its_hardware_and_the_plan_forecasts_for_it(capsys):
    argv = ["plan", "tiny", "--preset", "laptop-6gb", "--seq-len", "64", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["simulated"] is False and data["precision"] == "bf16"
    assert data["device_mem"] == int(5.5 * 2**30)  # the preset's budget within the 6 GB card
    assert "RTX 3060 Laptop" in data["step_seconds_source"]
    assert data["auto"]["settings"]["training"]["grad_accum"] == 8  # the preset's
    argv = ["plan", "tiny", "--preset", "laptop-6gb", "--seq-len", "64", "--hardware",
            "h100-80gb", "--json"]
    assert main(argv) == 0
    assert "H100" in json.loads(capsys.readouterr().out)["step_seconds_source"]


def test_a_preset_naming_unknown_hardware_is_one_line_and_status_2(tmp_path, capsys):
    preset = tmp_path / "mine.yaml"
    preset.write_text("version: 1\nhardware: tpu-v9\n")
    assert main(["plan", "tiny", "--preset", str(preset)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "hardware: must be 'laptop-6gb'" in err
