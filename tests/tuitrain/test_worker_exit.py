"""A worker process ends with os._exit (a library thread must not keep it alive), so what
the interpreter's exit would clean is cleaned first: its scratch folders and the rank
folders they are in, with nothing private of multiprocessing's."""

from __future__ import annotations

import multiprocessing.util

from engine.devices.disk import ScratchFolder
from tuitrain import worker_main


def test_a_worker_about_to_exit_removes_its_folders_with_public_means_only(
        tmp_path, monkeypatch):
    monkeypatch.delattr(multiprocessing.util, "_run_finalizers")  # a Python without it
    ScratchFolder(tmp_path / "rank-0")  # an engine that failed while being built
    worker_main._leave_nothing()
    assert list(tmp_path.iterdir()) == []
