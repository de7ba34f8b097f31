"""The disk tier's space and host memory: the scratch folder holds what the plan, the
start-up check and the steps say it holds; a small model can use the tier; a disk too full
is one clear error; gradient accumulation keeps the host budget; a run's last update is
written before it ends.
"""

from __future__ import annotations

import copy
import errno
import os
from functools import cache
from pathlib import Path

import pytest
import torch
from conftest import build, make_batches, sample_host_peak

from engine import Engine, EngineConfig, format_size
from engine.chunks.spill import ScratchTooSmall
from engine.devices.disk import files, scratch
from engine.devices.disk.tier import BANDWIDTH_PROBE
from engine.models.zoo import build_model
from engine.planning.planner import plan

MODEL = build("opt", layers=8, hidden=128)
DEVICE = "64MiB"
MiB = 2**20


@cache  # asked for again by most tests, of the same model, which nothing changes
def host_state(model: torch.nn.Module, precision: str = "fp32") -> int:
    eng = Engine(copy.deepcopy(model), EngineConfig(policy="cpu", device_budget=DEVICE,
                                                    precision=precision))
    nbytes = eng.manager.host_bytes
    eng.close()
    return nbytes


def on_disk(folder: Path) -> int:
    """Bytes the files under `folder` take on the disk, as `du` counts them."""
    return sum(p.stat().st_blocks * 512 for p in folder.rglob("*") if p.is_file())


def host_peak_during(eng: Engine, batches: list[dict]) -> tuple[int, list[float]]:
    """The most chunk bytes and I/O buffers the host held at any allocation or free."""
    peak = sample_host_peak(eng)
    losses = [eng.step(b).loss for b in batches]
    return peak[0], losses


# --- gradient accumulation --------------------------------------------------------------------


# Host budgets, as a share of the chunks' host bytes, that send payloads to disk.
@pytest.mark.parametrize(("precision", "share", "accum"), [("fp32", 0.3, 2), ("bf16", 0.15, 3)])
def test_accumulation_with_payloads_on_disk_holds_the_host_budget_and_the_bits(
        tmp_path, precision, share, accum):
    """Later micro-batches' gradients are added to those on disk a piece at a time: no
    payload comes home for them (it did, 1.6-1.7x over the budget), and the sums are
    those of the engine without a disk."""
    batches = make_batches(2, batch_size=2 * accum, seed=7)
    budget = int(share * host_state(MODEL, precision))
    config = dict(policy="cpu", device_budget=DEVICE, precision=precision, grad_accum=accum)
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(host_budget=budget,
                                                    disk_dir=tmp_path, **config))
    assert any(c.payload_on_disk for c in eng.chunks)
    plain = Engine(copy.deepcopy(MODEL), EngineConfig(**config))
    peak, losses = host_peak_during(eng, batches)
    assert 0 < peak <= budget
    assert losses == [plain.step(b).loss for b in batches]
    ours, theirs = eng.model_state_dict(), plain.model_state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    eng.close()
    plain.close()


# --- what the folder holds --------------------------------------------------------------------


@pytest.mark.parametrize("share", [0.8, 0.3])  # state on disk; payloads too
def test_the_plan_the_check_the_steps_and_du_agree_on_the_disk(tmp_path, share):
    folder = tmp_path / "model"
    MODEL.save_pretrained(folder)  # what the planner reads: its config
    budget = int(share * host_state(MODEL))
    disk = tmp_path / "scratch"
    forecast = plan(str(folder), device_mem="6GiB", host_mem="64GiB", precision="fp32",
                    simulated=True, batch_size=2, seq_len=16, host_budget=budget,
                    disk_dir=disk)
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy="cpu", device_budget=DEVICE,
                                                    host_budget=budget, disk_dir=disk))
    assert any(c.state_on_disk for c in eng.chunks)
    stats = eng.step(make_batches(1)[0])
    eng.manager.flight.wait()
    du = on_disk(disk)
    assert stats.memory.disk_model == eng.manager.disk_bytes
    for said in (stats.memory.disk_model, forecast.cpu.disk_bytes, forecast.disk_needed):
        assert abs(said - du) <= 0.01 * du, (said, du)
    eng.close()
    assert on_disk(disk) == 0


def test_a_small_model_can_use_the_tier(tmp_path):
    """tiny (10 MiB of state): the I/O buffers are sized to the model, not 24 MiB."""
    budget = 8 * MiB
    eng = Engine(build_model("tiny"), EngineConfig(policy="cpu", device_budget=DEVICE,
                                                   host_budget=budget, disk_dir=tmp_path))
    assert any(c.disk_level for c in eng.chunks)
    assert eng.manager.host_bytes + eng.manager.io_buffer_bytes <= budget
    ids = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    eng.step({"input_ids": ids, "labels": ids})
    assert eng.manager.host_bytes + eng.manager.io_buffer_bytes <= budget
    eng.close()


# --- a disk too full --------------------------------------------------------------------------


def fake_disk(monkeypatch, free: int, *, refuse: str = "") -> None:
    """A filesystem with `free` bytes free, whose reservations beyond it fail with ENOSPC
    (all of those whose file name starts with `refuse`, if given)."""
    monkeypatch.setattr(scratch.ScratchFolder, "free_bytes", lambda self: free)
    real = os.posix_fallocate

    def fallocate(fd: int, offset: int, size: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}").rsplit("/", 1)[-1]
        if size > free or (refuse and name.startswith(refuse)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, offset, size)

    monkeypatch.setattr(files.os, "posix_fallocate", fallocate)


def state_on_disk(folder: Path) -> Engine:
    return Engine(copy.deepcopy(MODEL), EngineConfig(
        policy="cpu", device_budget=DEVICE, host_budget=int(0.8 * host_state(MODEL)),
        disk_dir=folder))


def test_the_bandwidth_probe_fits_where_the_regions_fit(tmp_path, monkeypatch):
    """It wrote 16 MiB that the check did not count: a disk with room for a small tier's
    regions failed with a bare ENOSPC. It writes no more than the regions will take."""
    eng = state_on_disk(tmp_path / "sized")
    need = eng.manager.disk_bytes
    eng.close()
    assert need < BANDWIDTH_PROBE
    fake_disk(monkeypatch, need)
    eng = state_on_disk(tmp_path / "just")
    assert eng.manager.spill.tier.bandwidth[0] > 0
    eng.step(make_batches(1)[0])
    eng.close()
    fake_disk(monkeypatch, need - 1)
    with pytest.raises(ScratchTooSmall) as caught:
        state_on_disk(tmp_path / "short")
    said = str(caught.value)
    assert "\n" not in said and str(tmp_path / "short") in said
    assert f"needs {format_size(need)} on disk" in said
    assert f"has {format_size(need - 1)} free" in said
    assert not list((tmp_path / "short").iterdir())


def test_a_disk_that_fills_up_while_the_engine_starts_is_one_clear_value_error(
        tmp_path, monkeypatch):
    fake_disk(monkeypatch, 2**40, refuse="chunk-")
    with pytest.raises(ScratchTooSmall, match=rf"^the host budget needs .* on disk, but the "
                                              rf"scratch folder {tmp_path} has .* free"):
        state_on_disk(tmp_path)
    assert not list(tmp_path.iterdir())


# --- the end of a run -------------------------------------------------------------------------


def test_the_last_updates_writes_are_waited_for_and_counted(tmp_path):
    """State on disk: the last step's update still runs when the step returns; that step
    counts its writes, and nothing is left for the end to report."""
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(
        policy="cpu", device_budget=DEVICE, host_budget=int(0.8 * host_state(MODEL)),
        disk_dir=tmp_path))
    assert eng.manager.overlap_update()
    tier = eng.manager.spill.tier
    start = tier.bytes_written
    reported = sum(eng.step(b).bytes_disk_written for b in make_batches(2))
    read, written, _ = eng.finish_update()
    assert written == 0 and reported == tier.bytes_written - start > 0
    assert not eng.manager.flight.active and not tier._writes
    assert eng.finish_update()[:2] == (0, 0)
    eng.close(keep_weights=False)
    assert not any(tmp_path.iterdir())
