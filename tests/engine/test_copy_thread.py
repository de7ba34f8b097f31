"""The simulated device's copy thread: a fetch ahead of use whose source stays put runs
beside the host, as a GPU's copy engine runs beside its kernels, and the host meets it only
where it would wait on CUDA (engine.devices.streams.CopyingHostStreams)."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.devices import streams
from engine.devices.simulated import SimulatedDevice


@pytest.fixture
def device(monkeypatch):
    monkeypatch.setattr(streams, "spare_core", lambda: True)  # whatever this machine has
    device = SimulatedDevice(2**30)
    yield device
    device.close()


def hold_the_copy_thread(device: SimulatedDevice) -> threading.Event:
    """Keep the copy thread busy until the returned event is set."""
    gate = threading.Event()
    device.streams.side().submit(gate.wait, 30)
    return gate


def test_a_fetch_ahead_runs_beside_the_host_and_is_there_once_waited_for(device):
    src = torch.arange(1000, dtype=torch.float32)
    dst = device.empty(1000, torch.float32).zero_()
    gate = hold_the_copy_thread(device)
    pending, _ = device.copy_ahead(dst, src, src_kept=True)
    assert torch.count_nonzero(dst) == 0  # queued behind the held thread, not copied yet
    gate.set()
    device.wait(pending)
    assert torch.equal(dst, src)


def test_a_fetch_whose_source_the_host_writes_again_is_copied_before_it_returns(device):
    src = torch.arange(1000, dtype=torch.float32)
    expected = src.clone()
    dst = device.empty(1000, torch.float32).zero_()
    gate = hold_the_copy_thread(device)
    pending, _ = device.copy_ahead(dst, src)  # a disk piece's I/O buffer, say
    src.fill_(-1.0)
    assert torch.equal(dst, expected)
    gate.set()
    device.wait(pending)


def test_a_buffer_given_back_waits_for_the_copy_still_writing_it(device):
    src = torch.arange(4096, dtype=torch.float32)
    dst = device.buffer(4096, torch.float32)
    gate = hold_the_copy_thread(device)
    device.copy_ahead(dst, src, src_kept=True)
    threading.Timer(0.2, gate.set).start()
    storage = dst.untyped_storage()
    device.drain(storage)  # waits for the copy, then takes the memory
    assert storage.nbytes() == 0
    again = device.buffer(4096, torch.float32)  # the kept memory, with what the copy wrote
    assert torch.equal(again, src)


def test_settling_the_host_waits_for_every_copy_on_the_thread(device):
    src = torch.arange(1000, dtype=torch.float32)
    dst = device.empty(1000, torch.float32).zero_()
    gate = hold_the_copy_thread(device)
    device.copy_ahead(dst, src, src_kept=True)
    threading.Timer(0.2, gate.set).start()
    device.settle_host()
    assert torch.equal(dst, src)


def test_a_copy_that_fails_on_the_thread_raises_where_the_host_waits(device):
    src = torch.arange(10, dtype=torch.float32)
    dst = device.empty(7, torch.float32)
    pending, _ = device.copy_ahead(dst, src, src_kept=True)
    with pytest.raises(RuntimeError):
        device.wait(pending)


def test_a_failure_behind_a_later_copy_is_not_lost(device):
    src = torch.arange(10, dtype=torch.float32)
    device.copy_ahead(device.empty(7, torch.float32), src, src_kept=True)  # fails
    dst = device.empty(10, torch.float32)
    pending, _ = device.copy_ahead(dst, src, src_kept=True)  # runs after it, and succeeds
    with pytest.raises(RuntimeError):
        device.wait(pending)
    device.wait(pending)  # told once
    assert torch.equal(dst, src)


def test_giving_a_buffer_back_waits_for_no_copy_that_does_not_use_it(device):
    src = torch.arange(4096, dtype=torch.float32)
    other = device.empty(4096, torch.float32).zero_()
    gate = hold_the_copy_thread(device)
    pending, _ = device.copy_ahead(other, src, src_kept=True)
    done = device.buffer(4096, torch.float32)
    device.drain(done.untyped_storage())  # returns at once: the copy uses other memory
    assert not pending.done()
    gate.set()
    device.wait(pending)
    assert torch.equal(other, src)


def test_without_a_core_to_spare_a_fetch_ahead_is_done_when_it_returns(device, monkeypatch):
    """Where torch's threads take every core, a copy thread would take one from them."""
    monkeypatch.setattr(streams, "spare_core", lambda: False)
    src = torch.arange(1000, dtype=torch.float32)
    dst = device.empty(1000, torch.float32).zero_()
    pending, _ = device.copy_ahead(dst, src, src_kept=True)
    assert torch.equal(dst, src)  # copied in line
    assert device.streams.side()._executor is None  # no thread started for it
    device.wait(pending)


def test_a_core_is_spare_only_beside_fewer_threads_than_cores(monkeypatch):
    monkeypatch.setattr(streams, "_cores", lambda: 4)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    assert not streams.spare_core()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    assert streams.spare_core()
