"""The default scratch folder (under the user's cache folder) is made on the user's behalf:
it goes with the last thing in it, and never takes anything of anyone else's with it. A
folder the user named stays (tests/engine/distributed/test_rank_scratch.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.devices.disk import ScratchFolder, default_disk_dir, rank_folder
from engine.devices.disk.scratch import CACHE_ENV


@pytest.fixture
def default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    folder = default_disk_dir()
    assert folder == tmp_path / "cache" / "scratch" and not folder.exists()
    return folder


def test_the_default_folder_goes_with_the_last_run_in_it(default):
    first, second = ScratchFolder(default), ScratchFolder(default)
    first.remove()
    assert [p.name for p in default.iterdir()] == [second.path.name]
    second.remove()
    assert not default.exists()
    assert default.parent.exists()  # the cache folder, with the user's other caches


def test_a_rank_folder_under_the_default_folder_takes_it_along(default):
    ScratchFolder(rank_folder(default, 0)).remove()
    assert not default.exists()


def test_what_anyone_else_put_in_the_default_folder_keeps_it(default):
    default.mkdir(parents=True)
    (default / "notes.txt").write_text("mine")
    ScratchFolder(default).remove()
    assert [p.name for p in default.iterdir()] == ["notes.txt"]


def test_the_disk_probe_computes_beside_both_ways_at_once_and_leaves_no_file(tmp_path):
    """The update computes each piece while the tier reads the next and writes the last:
    the probe of both ways at once runs what it is given beside them until both are done."""
    from engine.devices.disk.files import ALIGN, direct_io_supported, steady_bandwidth

    ran = []
    rates = steady_bandwidth(tmp_path, nbytes=64 * ALIGN, piece=8 * ALIGN,
                             direct=direct_io_supported(tmp_path),
                             beside=lambda: ran.append(1))
    assert all(rate > 0 for rate in rates) and ran
    assert not any(tmp_path.iterdir())
