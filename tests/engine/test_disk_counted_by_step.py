"""Each step reports the disk tier's bytes it moved: its reads ahead and its own update's
reads and writes, also when that update still runs beside the next step's forward (the
optimizer state on disk, the payloads on the host). So every step of a steady run reports
the same, what the plan forecasts for a step, and the steps' figures add up to every byte
the tier moved: nothing is left for the run's end to report."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig
from engine.models.zoo import build_model
from engine.placement import disk_rules
from engine.planning.planner import plan

SHAPE = {"batch_size": 2, "seq_len": 64}
STEPS = 5


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pieces of disk I/O small enough that tiny's I/O buffers leave a host budget room
    for every payload beside them."""
    monkeypatch.setattr(disk_rules, "DISK_PIECE", 2**14)


def state_on_disk_budget(precision: str) -> int:
    """A host budget that sends optimizer state to disk and keeps every payload on the host
    (8 of fp32's 16 B/param are its moments, 12 of bf16's 14 its master and moments)."""
    host = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision=precision,
                simulated=True, **SHAPE).model_bytes
    return int(0.8 * host)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_step_reports_its_own_updates_disk_bytes(tmp_path, precision):
    host_budget = state_on_disk_budget(precision)
    forecast = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision=precision,
                    simulated=True, host_budget=host_budget, disk_dir=tmp_path, **SHAPE).cpu
    eng = Engine(build_model("tiny"), EngineConfig(
        policy="cpu", device_budget="6GiB", precision=precision, host_budget=host_budget,
        disk_dir=tmp_path, simulate=True))
    assert eng.manager.overlap_update()  # each update runs into the next step's forward
    tier = eng.manager.spill.tier
    start = (tier.bytes_read, tier.bytes_written)
    g = torch.Generator().manual_seed(0)
    steps = []
    for _ in range(STEPS):
        ids = torch.randint(0, 512, (SHAPE["batch_size"], SHAPE["seq_len"]), generator=g)
        steps.append(eng.step({"input_ids": ids, "labels": ids}))
    left = eng.finish_update()[:2]  # waits for the last update and its writes
    moved = (tier.bytes_read - start[0], tier.bytes_written - start[1])
    eng.close()

    assert forecast.disk_read > 0 and forecast.disk_written > 0
    assert [(s.bytes_disk_read, s.bytes_disk_written) for s in steps] == (
        [(forecast.disk_read, forecast.disk_written)] * STEPS)
    assert left == (0, 0)
    assert (sum(s.bytes_disk_read for s in steps),
            sum(s.bytes_disk_written for s in steps)) == moved
