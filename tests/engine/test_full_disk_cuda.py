"""A policy that puts nothing on disk needs no room there: under cuda every chunk lives on
the device, so a host budget sends nothing to the scratch folder, and a disk without room
for what cpu or auto would send it does not stop the run. The plan says so in its cuda row;
the engine builds each chunk straight onto the device, makes no scratch folder, and opens
the disk tier only when a change of policy needs it, refusing that change, before anything
moves, where the disk lacks the room."""

from __future__ import annotations

import shutil

import pytest
import torch
from conftest import sample_host_peak

from engine import Engine, EngineConfig, format_size
from engine.chunks.spill import ScratchTooSmall
from engine.models.zoo import build_model
from engine.placement import disk_rules
from engine.planning.planner import plan

SHAPE = {"batch_size": 2, "seq_len": 64}
MiB = 2**20
FREE = 2 * MiB  # below what tiny's chunks need on disk under the budgets here


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of disk I/O small enough that tiny's I/O buffers leave room for a host budget
    below its chunks."""
    monkeypatch.setattr(disk_rules, "DISK_PIECE", 2**14)


def full_disk(monkeypatch: pytest.MonkeyPatch, free: int = FREE) -> None:
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda path: real(path)._replace(free=free))


def host_budget() -> int:
    """A third of tiny's chunk bytes in bf16: cpu and auto send the rest to disk."""
    return plan("tiny", device_mem="6GiB", host_mem="64GiB", precision="bf16",
                simulated=True, **SHAPE).model_bytes // 3


def batches(n: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 512, (SHAPE["batch_size"], SHAPE["seq_len"]), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def test_the_plans_cuda_row_fits_on_a_disk_without_room_for_the_others(tmp_path,
                                                                       monkeypatch):
    full_disk(monkeypatch)
    forecast = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision="bf16",
                    simulated=True, host_budget=host_budget(), disk_dir=tmp_path, **SHAPE)
    assert forecast.disk_free == FREE < forecast.disk_needed
    assert forecast.cuda.fits, forecast.cuda.reason
    assert forecast.cuda.disk_bytes == forecast.cuda.disk_read == 0
    for row in (forecast.cpu, forecast.auto):
        assert not row.fits
        assert format_size(forecast.disk_needed) in row.reason
        assert f"{format_size(FREE)} free" in row.reason
    assert forecast.recommended.policy == "cuda"


def test_cuda_trains_under_a_host_budget_on_a_disk_without_room(tmp_path, monkeypatch):
    full_disk(monkeypatch)
    budget = host_budget()
    eng = Engine(build_model("tiny"), EngineConfig(
        policy="cuda", device_budget="6GiB", precision="bf16", host_budget=budget,
        disk_dir=tmp_path, simulate=True))
    assert eng.manager.spill is None and not any(tmp_path.iterdir())
    assert eng.manager.host_bytes == 0  # every chunk went to the device as it was made
    first, second = batches(2)
    stats = eng.step(first)
    assert stats.policy == "cuda" and torch.isfinite(torch.tensor(stats.loss))
    assert (stats.bytes_disk_read, stats.bytes_disk_written, stats.memory.disk_model) == (
        0, 0, 0)
    # cpu would send parts to disk: refused when asked, naming what it needs and has.
    with pytest.raises(ScratchTooSmall, match=rf"needs .* on disk, but the scratch folder "
                                              rf"{tmp_path} has {format_size(FREE)} free"):
        eng.set_policy("cpu")
    assert not any(tmp_path.iterdir())
    assert eng.step(second).policy == "cuda"  # the run goes on as it was
    eng.close()


def test_a_change_from_cuda_opens_the_disk_tier_within_the_host_budget(tmp_path):
    budget = host_budget()
    eng = Engine(build_model("tiny"), EngineConfig(
        policy="cuda", device_budget="6GiB", precision="bf16", host_budget=budget,
        disk_dir=tmp_path, simulate=True))
    assert eng.manager.spill is None
    peak = sample_host_peak(eng)
    first, second = batches(2)
    eng.step(first)
    eng.set_policy("cpu")
    assert eng.manager.spill is not None
    stats = eng.step(second)
    assert stats.policy == "cpu" and stats.memory.disk_model > 0
    # One chunk at a time came home and went on to disk: the budget and one chunk's
    # payload, master and moments at most (ChunkManager.apply_residency).
    largest = max(c.numel for c in eng.chunks) * (2 + 4 + 8)
    assert 0 < peak[0] <= budget + largest
    eng.close()
    assert not any(tmp_path.iterdir())


def test_a_killed_runs_scratch_folder_goes_at_the_next_start_under_cuda_too(tmp_path):
    """A cuda run makes no scratch folder of its own, but what a killed run left in the
    disk folder still goes as it starts, as with any other policy."""
    import subprocess
    import sys

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True).stdout.strip()
    stale = tmp_path / f"run-{dead}-0123abcd"
    stale.mkdir()
    (stale / "lock").touch()
    (stale / "chunk-00000").write_bytes(b"x" * 100)
    eng = Engine(build_model("tiny"), EngineConfig(
        policy="cuda", device_budget="6GiB", precision="bf16", host_budget=host_budget(),
        disk_dir=tmp_path, simulate=True))
    assert eng.manager.spill is None
    assert not stale.exists()
    eng.close()


def test_on_a_gpu_cuda_builds_onto_the_device_so_the_host_need_not_hold_the_budget(tmp_path):
    """Under cuda each chunk goes to the device as it is filled: the host holds one chunk
    being filled, not the host budget's worth that cpu and auto keep as they build. A host
    that cpu's build would not fit still runs cuda."""
    shape = dict(device_mem="6GiB", precision="bf16", simulated=False,
                 host_budget=host_budget(), disk_dir=tmp_path, **SHAPE)
    roomy = plan("tiny", host_mem="64GiB", **shape)
    assert roomy.cuda.host_peak < roomy.cpu.host_peak
    tight = plan("tiny", host_mem=roomy.cuda.host_peak, **shape)
    assert tight.cuda.fits, tight.cuda.reason
    assert not tight.cpu.fits and "host memory" in tight.cpu.reason
