"""`tuitrain plan`: a table or JSON per policy, the machine's memory by default, one line for
a mistake."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from engine.config import format_size
from engine.devices import device
from engine.placement import disk_rules
from engine.planning.planner import plan
from tuitrain.cli import main
from tuitrain.errors import UsageError
from tuitrain.plan import plan_main
from tuitrain.settings import Settings

SCRIPT = Path(sys.executable).parent / "tuitrain"
SMALL = ["--batch-size", "2", "--seq-len", "64", "--precision", "bf16"]


def namespace(**overrides: object) -> argparse.Namespace:
    fields = {
        "model": "tiny",
        "device_budget": 6 * 2**30,
        "host_budget": 64 * 2**30,
        "precision": "bf16",
        "batch_size": 2,
        "seq_len": 64,
        "checkpointing": False,
        "disk_dir": None,
        "nproc": 1,
        "json": False,
    }
    return argparse.Namespace(**{**fields, **overrides})


def test_the_table_has_a_row_per_policy_and_the_recommendation(capsys):
    assert main(["plan", "tiny", "--device-mem", "20MiB", "--host-mem", "64GiB", *SMALL]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    # One term for the chunks' bytes, as the FITS column says it (`model data ... with its
    # gradients`), with what the figure counts.
    assert re.search(r"; model data \d+\.\d [KMG]iB when on the host;", lines[2]), lines[2]
    assert "model state" not in out
    header = next(i for i, line in enumerate(lines) if line.startswith("POLICY"))
    assert lines[header].split() == [
        "POLICY",
        "DEVICE",
        "PEAK",
        "HOST",
        "PEAK",
        "COPIED/STEP",
        "FITS",
    ]
    rows = {line.split()[0]: line for line in lines[header + 1 : header + 4]}
    assert list(rows) == ["cuda", "cpu", "auto"]
    assert "no: needs" in rows["cuda"] and "20.0 MiB" in rows["cuda"]
    assert rows["cpu"].endswith("yes") and rows["auto"].endswith("yes")
    assert lines[-1].startswith("recommended: --policy auto --margin ")
    assert "simulated" in out


def test_json_carries_the_figures_of_the_plan(capsys):
    argv = ["plan", "tiny", "--device-mem", "20MiB", "--host-mem", "64GiB", "--json", *SMALL]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    expected = plan(
        "tiny", device_mem="20MiB", host_mem="64GiB", precision="bf16", batch_size=2, seq_len=64
    )
    for name in ("cuda", "cpu", "auto"):
        row = expected.policies[name]
        assert data[name]["device_peak"] == row.device_peak
        assert data[name]["host_peak"] == row.host_peak
        assert data[name]["fits"] is row.fits
    assert data["cuda"]["fits"] is False and data["auto"]["fits"] is True
    assert data["recommended"] == {
        "policy": "auto",
        "margin_ratio": expected.recommended.margin_ratio,
        "why": expected.recommended.why,
    }


def test_memory_defaults_to_this_machine(capsys):
    assert plan_main(namespace(device_budget=None, host_budget=None, json=True)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host_mem"] == psutil.virtual_memory().total
    assert data["host_budget"] is None and data["disk_needed"] == 0
    if data["simulated"]:
        assert data["device_mem"] == Settings().device_budget_for(simulated=True)


def test_host_mem_is_a_host_budget_checked_against_this_machines_memory(capsys):
    assert plan_main(namespace(host_budget=2**30, json=True)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["host_budget"] == 2**30  # tiny's chunks fit in it: nothing goes to disk
    assert data["host_mem"] == psutil.virtual_memory().total
    assert data["disk_needed"] == 0 and data["cpu"]["disk_bytes"] == 0


def test_unspecified_precision_is_the_one_a_run_would_use(capsys):
    assert plan_main(namespace(precision=None, json=True)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["precision"] == Settings().precision_for(simulated=data["simulated"])


def test_a_mistake_the_planner_finds_is_a_usage_error():
    with pytest.raises(UsageError, match="not a size"):
        plan_main(namespace(host_budget="lots"))
    with pytest.raises(UsageError, match="unknown model 'opt-9b'"):
        plan_main(namespace(model="opt-9b"))


def test_a_folder_that_is_not_a_language_model_is_one_line_and_status_2(tmp_path, capsys):
    folder = tmp_path / "vit"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "vit"}))
    (folder / "model.safetensors").write_bytes(b"")
    assert main(["plan", str(folder), "--device-mem", "6GiB", "--host-mem", "8GiB"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "Traceback" not in captured.err
    assert len(captured.err.splitlines()) == 1
    assert captured.err.startswith("tuitrain: error: ")


# Runs the command and reports its peak resident memory: a process of its own, so that no
# other child of the test session counts towards it.
MEASURED = """
import json, resource, subprocess, sys
done = subprocess.run(sys.argv[1:], capture_output=True, text=True)
peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps({"status": done.returncode, "out": done.stdout, "err": done.stderr,
                  "peak_rss": peak}))
"""


def test_opt_30b_answers_quickly_with_plausible_figures_and_little_memory(tmp_path):
    command = [
        str(SCRIPT),
        "plan",
        "opt-30b",
        "--device-mem",
        "24GiB",
        "--host-mem",
        "64GiB",
        "--precision",
        "bf16",
        "--json",
    ]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", MEASURED, *command],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=240,
        check=True,
    )
    elapsed = time.perf_counter() - start
    result = json.loads(done.stdout)
    assert result["status"] == 0, result["err"]
    data = json.loads(result["out"])
    n = data["parameters"]
    assert 29e9 < n < 31e9
    assert not data["cuda"]["fits"] and not data["cpu"]["fits"] and not data["auto"]["fits"]
    # The host budget (--host-mem) sends the state to disk, and the model is built a chunk
    # at a time, never whole (its fp32 weights alone are 4 B/param, ~120 GB): the peak is
    # the budget beside the simulated device, building included.
    budget = data["host_budget"]
    assert budget <= data["cpu"]["host_peak"] < 1.25 * budget < 4 * n
    assert data["build_peak"] <= budget
    assert data["recommended"]["policy"] is None
    # The whole command, interpreter and imports included; the planning itself is timed
    # apart (under 10 s) in tests/engine/test_planner.py.
    assert elapsed < 60, f"{elapsed:.1f} s"
    assert result["peak_rss"] < 2 * 2**30  # meta tensors only: no 60 GB of weights



# --- the disk tier ---------------------------------------------------------------------------


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of disk I/O small enough that tiny's I/O buffers leave room for a host budget
    below its chunks."""
    monkeypatch.setattr(disk_rules, "DISK_PIECE", 2**14)


def tiny_state() -> int:
    return plan("tiny", device_mem="6GiB", host_mem="64GiB", precision="bf16", batch_size=2,
                seq_len=64).model_bytes


def test_a_host_budget_that_needs_the_disk_says_how_much_and_where(small_pieces, tmp_path,
                                                                   capsys):
    budget = tiny_state() // 4
    argv = ["plan", "tiny", "--device-mem", "20MiB", "--host-mem", str(budget),
            "--disk", str(tmp_path), *SMALL]
    assert main(argv) == 0
    out = capsys.readouterr().out
    expected = plan("tiny", device_mem="20MiB", host_mem=psutil.virtual_memory().total,
                    precision="bf16", batch_size=2, seq_len=64, host_budget=budget,
                    disk_dir=tmp_path)
    assert expected.uses_disk and expected.cpu.disk_bytes > 0
    lines = out.splitlines()
    budget_line = next(line for line in lines if line.startswith("host budget"))
    assert format_size(expected.disk_needed) in budget_line and str(tmp_path) in budget_line
    assert format_size(expected.disk_free) in budget_line
    assert budget_line.endswith("free there, enough")
    header = next(i for i, line in enumerate(lines) if line.startswith("POLICY"))
    assert "ON DISK" in lines[header] and "DISK READ" in lines[header]
    cpu = next(line for line in lines[header:] if line.startswith("cpu"))
    for size in (expected.cpu.disk_bytes, expected.cpu.disk_read, expected.cpu.disk_written,
                 expected.cpu.io_buffers):
        assert format_size(size) in cpu
    assert cpu.endswith("yes")
    assert not any(line.startswith("tuitrain") for line in lines)


def test_json_carries_the_disk_figures(small_pieces, tmp_path, capsys):
    budget = tiny_state() // 4
    argv = ["plan", "tiny", "--device-mem", "20MiB", "--host-mem", str(budget),
            "--disk", str(tmp_path), "--json", *SMALL]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    expected = plan("tiny", device_mem="20MiB", host_mem=psutil.virtual_memory().total,
                    precision="bf16", batch_size=2, seq_len=64, host_budget=budget,
                    disk_dir=tmp_path)
    assert data["host_budget"] == budget and data["disk_dir"] == str(tmp_path)
    assert data["disk_needed"] == expected.disk_needed > 0
    for name, row in expected.policies.items():
        for key in ("host_model", "io_buffers", "disk_bytes", "disk_read", "disk_written"):
            assert data[name][key] == getattr(row, key)


def test_the_plan_takes_the_run_flags_that_change_memory_or_traffic(small_pieces, tmp_path,
                                                                     capsys):
    budget = tiny_state() // 4
    argv = ["plan", "tiny", "--device-mem", "20MiB", "--host-mem", str(budget),
            "--disk", str(tmp_path), "--grad-accum", "3", "--margin", "0.5", "--json", *SMALL]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    common = dict(device_mem="20MiB", host_mem=psutil.virtual_memory().total,
                  precision="bf16", batch_size=2, seq_len=64, host_budget=budget,
                  disk_dir=tmp_path)
    expected = plan("tiny", grad_accum=3, margin_ratio=0.5, **common)
    assert data["grad_accum"] == 3
    for name, row in expected.policies.items():
        for key in ("device_peak", "host_model", "disk_read", "disk_written"):
            assert data[name][key] == getattr(row, key)
    # Later micro-batches read and write again; the host holds the same.
    once = plan("tiny", margin_ratio=0.5, **common)
    assert data["cpu"]["disk_read"] > once.cpu.disk_read
    assert data["cpu"]["host_model"] == once.cpu.host_model


def test_a_host_budget_below_the_minimum_is_one_line_and_status_2(capsys):
    # Below even the smallest I/O buffers (rules.MIN_DISK_PIECE) with every part on disk.
    assert main(["plan", "tiny", "--device-mem", "6GiB", "--host-mem", "512KiB", *SMALL]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1
    assert captured.err.startswith("tuitrain: error: host budget 512.0 KiB is below the ")


def test_a_host_budget_that_holds_everything_says_so_and_keeps_the_plain_table(capsys):
    assert main(["plan", "tiny", "--device-mem", "20MiB", "--host-mem", "1GiB", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "host budget 1.0 GiB: holds every chunk, nothing goes to disk" in out
    header = next(line for line in out.splitlines() if line.startswith("POLICY"))
    assert "DISK" not in header


def test_without_a_host_budget_the_plan_says_what_a_run_here_would_choose(capsys,
                                                                           monkeypatch):
    """opt-125m in fp32 (1.9 GiB of state) on a machine with 2.25 GiB to spare: no policy
    fits the host without the disk (cuda's simulated device alone needs 2.5 GiB with the
    runtime), and the plan says the budget a run would choose."""
    from tuitrain import fit

    monkeypatch.setattr(fit, "host_room", lambda: 9 * 2**30 // 4)
    monkeypatch.setattr("tuitrain.plan.default_host_budget", lambda: 9 * 2**30 // 4)
    args = namespace(model="opt-125m", precision="fp32", batch_size=1, host_budget=None)
    assert plan_main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    heading, chosen = lines[-2:]
    # Said once, and the table above is the run's as it would start: the policy it runs
    # fits there, with the host budget it would choose, rather than `no: needs ... host`.
    assert heading == "a run here, with these flags, would start with (the plan above is its):"
    assert sum("a run here" in line for line in lines) == 1
    assert chosen.startswith("  host budget ")
    assert "of training state goes to disk under" in chosen
    budget = chosen.split(":")[0].strip()
    assert any(line.startswith(f"{budget} (chunks and disk I/O buffers") for line in lines)
    header = next(i for i, line in enumerate(lines) if line.startswith("POLICY"))
    assert "ON DISK" in lines[header]
    auto = next(line for line in lines[header:] if line.startswith("auto "))
    assert auto.endswith("  yes") and "host memory" not in auto
    # Where it fits, nothing more is said.
    monkeypatch.setattr("tuitrain.plan.default_host_budget", lambda: 64 * 2**30)
    assert plan_main(namespace(model="tiny", host_budget=None)) == 0
    assert "a run here" not in capsys.readouterr().out


# --- data parallel: --nproc -----------------------------------------------------------------

RANKS = ["plan", "tiny", "--device-mem", "20MiB", "--batch-size", "4", "--seq-len", "64",
         "--precision", "bf16"]


def test_nproc_plans_one_rank_and_the_machine_for_all_of_them(capsys):
    assert main([*RANKS, "--nproc", "2"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert "batch 4 x 64 tokens (2 per rank on 2 data-parallel ranks)" in lines[0]
    assert "device 20.0 MiB per rank" in out and "shared by the 2 ranks" in out
    header = next(i for i, line in enumerate(lines) if line.startswith("POLICY"))
    assert [c.strip() for c in lines[header].split("  ") if c.strip()] == [
        "POLICY", "DEVICE PEAK", "HOST PEAK", "HOST, 2 RANKS", "COPIED/STEP", "GATHERED/STEP",
        "REDUCE-SCATTERED/STEP", "FITS"]
    expected = plan("tiny", device_mem="20MiB", host_mem=psutil.virtual_memory().total,
                    precision="bf16", batch_size=4, seq_len=64, nproc=2)
    for line in lines[header + 1:header + 4]:
        row = expected.policies[line.split()[0]]
        assert format_size(row.device_peak) in line and format_size(row.machine_host_peak) in line
        if row.fits:
            assert format_size(row.gathered) in line
            assert format_size(row.reduce_scattered) in line
    assert lines[-1].startswith("recommended: ")


def test_nproc_json_carries_each_ranks_bytes_communicated_and_the_machines_host_peak(capsys):
    assert main([*RANKS, "--nproc", "3", "--batch-size", "6", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    expected = plan("tiny", device_mem="20MiB", host_mem=psutil.virtual_memory().total,
                    precision="bf16", batch_size=6, seq_len=64, nproc=3)
    one = plan("tiny", device_mem="20MiB", host_mem=psutil.virtual_memory().total,
               precision="bf16", batch_size=2, seq_len=64)
    assert data["nproc"] == 3 and data["batch_size"] == 6
    for name in ("cuda", "cpu", "auto"):
        row = expected.policies[name]
        assert data[name]["device_peak"] == row.device_peak
        assert data[name]["host_peak"] == row.host_peak
        assert data[name]["machine_host_peak"] == 3 * row.host_peak
        assert data[name]["gathered"] == row.gathered > 0
        assert data[name]["reduce_scattered"] == row.reduce_scattered > 0
        # A rank holds a third of the chunks on the host, with padding to split them.
        assert one.policies[name].host_model / 3 <= row.host_model
        assert row.host_model < one.policies[name].host_model / 3 + 8 * 2**10
    # Every chunk's gradients are reduce-scattered once a step: a rank sends two thirds of
    # each (bf16, 2 bytes an element; 14 bytes of state an element; padding < 96 each).
    elements = one.model_bytes // 14
    sent = data["cpu"]["reduce_scattered"]
    assert 2 * elements * 2 // 3 <= sent <= 2 * (elements + 96 * one.chunks) * 2 // 3
    # cpu gathers every chunk for the forward and again for a backward that reads it: not
    # the embeddings' (engine.step.backward_reads).
    assert sent < data["cpu"]["gathered"] < 2 * sent


def test_nproc_with_a_host_budget_sends_each_ranks_shards_to_disk_and_counts_all_ranks(
        small_pieces, tmp_path, capsys):
    budget = tiny_state() // 8  # a rank holds half of tiny's state: a quarter of it fits
    argv = [*RANKS, "--nproc", "2", "--host-mem", str(budget), "--disk", str(tmp_path)]
    assert main(argv) == 0
    expected = plan("tiny", device_mem="20MiB", host_mem=psutil.virtual_memory().total,
                    precision="bf16", batch_size=4, seq_len=64, host_budget=budget,
                    disk_dir=tmp_path, nproc=2)
    assert expected.uses_disk
    budget_line = next(line for line in capsys.readouterr().out.splitlines()
                       if line.startswith("host budget"))
    assert budget_line.startswith(f"host budget {format_size(budget)} per rank ")
    # The two ranks' folders share this disk.
    assert f"up to {format_size(2 * expected.disk_needed)} for 2 ranks in {tmp_path}" in (
        budget_line)


def test_nproc_1_is_exactly_the_plan_without_it(capsys):
    assert main(RANKS) == 0
    without = capsys.readouterr().out
    assert main([*RANKS, "--nproc", "1"]) == 0
    assert capsys.readouterr().out == without
    assert main([*RANKS, "--json"]) == 0
    without = capsys.readouterr().out
    assert main([*RANKS, "--nproc", "1", "--json"]) == 0
    assert capsys.readouterr().out == without
    assert "nproc" not in json.loads(without)


@pytest.mark.parametrize(("nproc", "more", "expected"), [
    ("0", [], "--nproc: must be a whole number of ranks, at least 1 (got 0)"),
    ("-2", [], "--nproc: must be a whole number of ranks, at least 1 (got -2)"),
    ("two", [], "--nproc: must be a whole number of ranks, at least 1 (got two)"),
    ("1.5", [], "--nproc: must be a whole number of ranks, at least 1 (got 1.5)"),
    ("3", [], "batch_size 4 does not split evenly over 3 ranks; use a multiple of 3"),
    # Each rank's host budget, for its shards: below what one rank needs.
    ("2", ["--host-mem", "512KiB"], "host budget 512.0 KiB is below the 732.0 KiB the host "
     "needs with every non-resident chunk on disk (I/O buffers 732.0 KiB)"),
])
def test_a_bad_nproc_is_one_line_and_status_2(capsys, nproc, more, expected):
    assert main([*RANKS, "--nproc", nproc, *more]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"tuitrain: error: {expected}\n"


@pytest.mark.parametrize(("units", "expected"), [(True, "bf16"), (False, "fp32")])
def test_the_simulated_device_computes_in_bf16_where_the_cpu_has_bf16_units(
        monkeypatch, units, expected):
    """A CPU without bf16 units emulates it, several times slower than fp32; one with them
    (AVX512-BF16, AMX) runs it faster. A GPU's default does not depend on the CPU."""
    monkeypatch.setattr(device, "host_has_bf16", lambda: units)
    assert Settings().precision_for(simulated=True) == expected
    assert Settings(engine={"precision": "fp32"}).precision_for(simulated=True) == "fp32"


def test_a_plan_that_uses_the_disk_is_forecast_at_the_disks_speed_now(small_pieces, tmp_path,
                                                                      monkeypatch, capsys):
    """The calibration probed the default folder once; the disk the scratch goes to is
    probed when the plan is forecast (engine.planning.disk_speed), and a plan that does not
    use the disk never waits for that."""
    from engine.planning import disk_speed

    probed = []

    def half_as_fast(scale: float = 1.0, base: Path | None = None) -> tuple[float, ...]:
        probed.append(base)
        return 0.5e9, 0.5e9, 0.5e9  # the tests' calibration: 1 GB/s each way, one by one

    # fp32: the update's reads and writes of the master are what the step waits for.
    budget = plan("tiny", device_mem="6GiB", host_mem="64GiB", batch_size=2,
                  seq_len=64).model_bytes // 4
    argv = ["plan", "tiny", "--device-mem", "20MiB", "--host-mem", str(budget),
            "--disk", str(tmp_path), "--json", "--batch-size", "2", "--seq-len", "64",
            "--precision", "fp32"]
    assert main(argv) == 0
    at_calibration = json.loads(capsys.readouterr().out)
    monkeypatch.setattr(disk_speed, "probe", half_as_fast)
    monkeypatch.setattr(disk_speed, "_probed", {})
    assert main(argv) == 0
    captured = capsys.readouterr()
    now = json.loads(captured.out)
    assert probed == [tmp_path] and f"measuring the disk where the scratch goes ({tmp_path})" \
        in captured.err
    assert now["step_seconds_source"] == "this machine's calibration, the disk measured now"
    assert now["cpu"]["step_seconds"]["disk"] == pytest.approx(
        2 * at_calibration["cpu"]["step_seconds"]["disk"])
    assert now["cpu"]["step_seconds"]["total"] > at_calibration["cpu"]["step_seconds"]["total"]
    assert main(["plan", "tiny", "--device-mem", "20MiB", "--json", *SMALL]) == 0
    assert probed == [tmp_path]  # nothing on disk: no probe


def test_a_disk_too_full_for_cpu_and_auto_leaves_cuda_to_the_plan_and_the_run(
        small_pieces, tmp_path, capsys, monkeypatch):
    """cuda keeps every chunk on the device, so a host budget sends nothing to disk under
    it: a disk without the room cpu and auto need there does not refuse it, in the plan's
    table or in a run that asks for it (tuitrain.fit.settle)."""
    import shutil

    from tuitrain import fit

    budget, free = tiny_state() // 4, 2**20
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=free))
    assert main(["plan", "tiny", "--host-mem", str(budget), "--disk", str(tmp_path),
                 *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("POLICY"))
    rows = {line.split()[0]: line for line in lines[header + 1:header + 4]}
    assert rows["cuda"].endswith("yes")
    disk = next(line for line in lines if line.startswith("host budget"))
    assert disk.endswith(f"{format_size(free)} free there, NOT enough for cpu or auto "
                         f"(cuda puts nothing there)")
    for name in ("cpu", "auto"):
        assert f"on disk, but {tmp_path} has {format_size(free)} free" in rows[name]
    monkeypatch.setattr(fit, "host_room", lambda ranks=1: 16 * 2**30)

    def run(policy: str) -> Settings:
        return Settings.model_validate({
            "model": "tiny", "training": {"batch_size": 2, "seq_len": 64},
            "engine": {"policy": policy, "precision": "bf16", "host_budget": budget,
                       "disk_dir": str(tmp_path)}})

    said: list[str] = []
    assert fit.settle(run("cuda"), said.append) == run("cuda") and said == []
    with pytest.raises(ValueError, match=r"^policy cpu will not fit: .* free; policy cuda "
                                         r"would"):
        fit.settle(run("cpu"), said.append)


def test_the_table_copies_every_micro_batchs_bytes_and_the_header_counts_them(capsys):
    assert main(["plan", "tiny", "--grad-accum", "4", *SMALL]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "tiny, bf16, batch 2 x 64 tokens, 4 micro-batches a step"
    one, four = (plan("tiny", device_mem="6GiB", host_mem=psutil.virtual_memory().total,
                      precision="bf16", batch_size=2, seq_len=64, grad_accum=accum)
                 for accum in (1, 4))
    assert four.cpu.copied > 4 * one.cpu.copied  # later micro-batches fetch fp32 masters
    header = next(i for i, line in enumerate(lines) if line.startswith("POLICY"))
    cpu = next(line for line in lines[header:] if line.startswith("cpu"))
    assert cpu.split()[5:7] == format_size(four.cpu.copied).split()
