"""A rank's scratch folder lives in `disk_dir/rank-<rank>`, a folder the engine makes for it:
when the run ends, that goes too, and nothing is left but the folder the user gave."""

from __future__ import annotations

import copy
import os

import pytest
from dp_harness import build, make_batches
from twin_rank import TwinCollectives

from engine import Engine, EngineConfig
from engine.devices.disk import ScratchFolder, rank_folder, remove_all


@pytest.fixture
def twin(monkeypatch):
    monkeypatch.setattr("engine.step.engine.join", lambda *a, **k: TwinCollectives())


def _spilling(model, disk_dir) -> Engine:
    """Rank 0's engine with a host budget that sends part of its shards' state to disk."""
    whole = Engine(copy.deepcopy(model), EngineConfig(policy="cpu", device_budget="64MiB"))
    host = whole.snapshot().host_model
    whole.close()
    eng = Engine(copy.deepcopy(model), EngineConfig(
        policy="cpu", device_budget="64MiB", host_budget=int(0.7 * host), disk_dir=disk_dir))
    assert eng.manager.spill is not None
    return eng


def test_a_rank_that_spilled_to_disk_leaves_only_the_folder_the_user_gave(twin, tmp_path):
    eng = _spilling(build(), tmp_path)
    folder = eng.manager.spill.tier.folder.path
    assert folder.parent == rank_folder(tmp_path, 0) == tmp_path / "rank-0"
    eng.step(make_batches(1)[0])
    eng.close()
    assert list(tmp_path.iterdir()) == []


def test_a_rank_folder_another_run_still_uses_stays(tmp_path):
    ours, theirs = ScratchFolder(tmp_path / "rank-1"), ScratchFolder(tmp_path / "rank-1")
    ours.remove()
    assert [p.name for p in (tmp_path / "rank-1").iterdir()] == [theirs.path.name]
    theirs.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_process_that_ends_without_closing_its_engine_leaves_no_rank_folder(tmp_path):
    ScratchFolder(tmp_path / "rank-2")
    remove_all()  # what a worker does before os._exit
    assert list(tmp_path.iterdir()) == []


def test_only_the_ranks_folder_goes_never_one_the_user_named(tmp_path):
    ScratchFolder(tmp_path / "mine").remove()
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]


def test_a_rank_folder_removed_by_a_run_ending_meanwhile_is_made_again(tmp_path, monkeypatch):
    from engine.devices.disk import scratch

    parent = tmp_path / "rank-0"
    real = scratch.remove_stale

    def other_run_ends(folder):  # between making the rank folder and a folder in it
        parent.rmdir()
        return real(folder)

    monkeypatch.setattr(scratch, "remove_stale", other_run_ends)
    folder = ScratchFolder(parent)
    assert folder.path.parent == parent and folder.path.is_dir()
    folder.remove()


def test_after_a_kill_9_of_ranks_the_next_start_on_any_ranks_removes_their_folders(tmp_path):
    for rank in (0, 1):  # what two killed ranks left: their folders, locks released
        dead = ScratchFolder(tmp_path / f"rank-{rank}")
        _, _, (_, lock_fd, _), _ = dead._finalizer.detach()
        os.close(lock_fd)
    alone = ScratchFolder(tmp_path)  # then one process, on the same disk_dir
    assert [p.name for p in tmp_path.iterdir()] == [alone.path.name]
    alone.remove()
    rank0 = ScratchFolder(tmp_path / "rank-0")  # or rank 0 of a new pair
    rank0.remove()
    assert list(tmp_path.iterdir()) == []


def test_a_folder_a_live_process_is_setting_up_is_left_alone(tmp_path):
    """Ranks start at once, and each start cleans every rank's folder: one that another
    process has made, and not locked yet, is not stale."""
    staging = tmp_path / "rank-1" / f".new-{os.getpid()}-0123abcd"
    staging.mkdir(parents=True)
    (staging / "lock").touch()  # made, not locked yet
    ScratchFolder(tmp_path / "rank-1").remove()
    assert staging.is_dir()
