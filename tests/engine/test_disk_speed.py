"""The disk's speed where a run's scratch goes, probed when a plan that uses the disk is
forecast (engine.planning.disk_speed): the rates it finds, how long one probe stands for,
and a folder it cannot write, which leaves the calibration's rates."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.devices.disk import default_disk_dir
from engine.devices.disk.scratch import CACHE_ENV
from engine.planning import disk_speed
from engine.planning.disk_speed import disk_now
from engine.planning.disk_speed import probe as real_probe  # the tests' own is a stand-in
from tests.calibrations import fixed_calibration


@pytest.fixture
def measured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real probe, of a few blocks."""
    from engine.devices.disk.files import ALIGN

    monkeypatch.setattr(disk_speed, "probe", real_probe)
    monkeypatch.setattr(disk_speed, "DISK_PROBE", 64 * ALIGN)
    monkeypatch.setattr(disk_speed, "_probed", {})


def test_measuring_the_disk_leaves_no_folder(measured, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    write, read, both = disk_speed.probe()
    assert write > 0 and read > 0 and both > 0
    assert not default_disk_dir().exists()


def test_a_plan_on_the_disk_is_forecast_at_its_folders_speed_now(measured, tmp_path):
    said = []
    cal = fixed_calibration()
    scratch = tmp_path / "scratch"  # not there yet: made for the probe, removed after
    now = disk_now(cal, scratch, say=said.append)
    assert len(said) == 1 and str(scratch) in said[0]
    assert now.disk_write > 0 and now.disk_read > 0 and now.disk_duplex > 0
    assert (now.disk_write, now.disk_read, now.disk_duplex) != (cal.disk_write, cal.disk_read,
                                                                cal.disk_duplex)
    assert now.source == f"{cal.source}, the disk measured now"
    assert now.matmul == cal.matmul and now.h2d == cal.h2d  # the rest is the calibration's
    assert not scratch.exists()


def test_a_folder_the_user_made_stays_as_it_was(measured, tmp_path):
    disk_now(fixed_calibration(), tmp_path)
    assert tmp_path.exists() and not any(tmp_path.iterdir())


def test_one_probe_stands_for_a_while_in_a_process(tmp_path, monkeypatch):
    probes = []

    def probe(scale: float = 1.0, base: Path | None = None) -> tuple[float, float, float]:
        probes.append(base)
        return 2e9, 3e9, 1e9 + len(probes)

    monkeypatch.setattr(disk_speed, "probe", probe)
    monkeypatch.setattr(disk_speed, "_probed", {})
    clock = [100.0]
    cal = fixed_calibration()

    def now(folder: Path, **how: float) -> float:
        return disk_now(cal, folder, clock=lambda: clock[0], **how).disk_duplex

    assert now(tmp_path) == 1e9 + 1
    clock[0] += disk_speed.DISK_NOW_SECONDS - 1.0
    assert now(tmp_path) == 1e9 + 1 and len(probes) == 1  # still standing
    assert now(tmp_path / "other") == 1e9 + 2  # another folder, maybe another disk
    clock[0] += 1.0
    assert now(tmp_path) == 1e9 + 3  # as old as it may be: probed again
    assert now(tmp_path, max_age=0.0) == 1e9 + 4
    assert probes == [tmp_path, tmp_path / "other", tmp_path, tmp_path]


def test_a_folder_that_cannot_be_written_keeps_the_calibrations_rates(measured, tmp_path):
    blocked = tmp_path / "a file"
    blocked.write_text("not a folder")
    cal = fixed_calibration()
    assert disk_now(cal, blocked / "scratch") is cal
    assert blocked.read_text() == "not a folder"
