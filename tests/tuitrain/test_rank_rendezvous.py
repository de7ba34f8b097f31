"""The app's data-parallel ranks meet at a rendezvous port held from the start: the store
listens before any rank is told its port, and every rank connects to it (none binds it), so
no other program can take the port between its choice and its use."""

from __future__ import annotations

import socket

import pytest

from tuitrain import rank_worker
from tuitrain.rank_worker import DataParallelWorker
from tuitrain.settings import Settings


class Recorded:
    """A ProcessWorker that only records the environment it would start its rank with."""

    started: list[dict[str, str]] = []

    def __init__(self, *, settings, log_path, environment, own_log=False) -> None:
        self.environment = environment
        self.alive, self.result = False, None

    def start(self) -> None:
        Recorded.started.append(self.environment)

    def stop(self, timeout: float) -> None:
        pass


def test_the_ranks_port_is_held_by_a_store_from_before_they_start(tmp_path, monkeypatch):
    monkeypatch.setattr(rank_worker, "ProcessWorker", Recorded)
    Recorded.started = []
    worker = DataParallelWorker(settings=Settings(model="tiny"), nproc=2, log_dir=tmp_path)
    worker.start()
    ports = {env["MASTER_PORT"] for env in Recorded.started}
    assert len(Recorded.started) == 2 and len(ports) == 1
    assert all(env["TORCHELASTIC_USE_AGENT_STORE"] == "True" for env in Recorded.started)
    port = int(ports.pop())
    with socket.socket() as other, pytest.raises(OSError):
        other.bind((rank_worker.MASTER_ADDR, port))  # taken: nobody else can have it
    worker.stop()
    with socket.socket() as other:
        other.bind((rank_worker.MASTER_ADDR, port))  # released once the ranks have ended
