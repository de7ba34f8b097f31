"""Copies between host and device: stream-ordered, through a fixed ring of staging buffers.

`LazyStreams` stands in for a GPU that runs nothing until someone waits: a copy that is
read before the code waited for it, or a staging buffer overwritten while a queued copy
still reads it, comes out with wrong bytes here, as it would on a GPU only sometimes.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build, make_batches

from engine import Engine, EngineConfig
from engine.devices.simulated import SimulatedDevice
from engine.devices.transfers import Staging, Transfers


class LazyStreams:
    """Two queues that run only when the host waits for an event, or drains them."""

    def __init__(self) -> None:
        self.queues: dict[str, list] = {"compute": [], "side": []}
        self.ran = {"compute": 0, "side": 0}
        self.host_waits = 0

    def compute(self) -> object:
        return "compute"

    def side(self) -> object:
        return "side"

    def pinned(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0xAB, dtype=torch.uint8)  # garbage, never zeros

    def dma(self, dst, src, stream) -> None:
        self.queues[stream].append(lambda: dst.copy_(src))

    def record(self, stream) -> object:
        return stream, len(self.queues[stream])

    def host_wait(self, event) -> None:
        self.host_waits += 1
        self._run(*event)

    def stream_wait(self, stream, event) -> None:
        self.queues[stream].append(lambda: self._run(*event))

    def keep_alive(self, tensor, stream) -> None:
        pass

    def _run(self, stream: str, upto: int) -> None:
        queue = self.queues[stream]
        while self.ran[stream] < upto:
            op = queue[self.ran[stream]]
            self.ran[stream] += 1
            op()

    def drain(self) -> None:
        """The device catches up with everything queued (what kernels would see)."""
        for stream in ("side", "compute", "side"):
            self._run(stream, len(self.queues[stream]))


STAGING = Staging(buffers=2, buffer_bytes=24)  # 6 fp32 or 12 bf16 elements a piece


def values(n: int, dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("n", [1, 5, 6, 7, 12, 13, 100])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copies_through_small_staging_buffers_are_byte_identical(n, dtype):
    streams = LazyStreams()
    transfers = Transfers(streams, STAGING)
    host = values(n, dtype)
    device = torch.zeros(n, dtype=dtype)
    transfers.to_device(device, host)
    back = torch.zeros(n, dtype=dtype)
    transfers.to_host(back, device, host_reads=True)
    streams.drain()
    assert torch.equal(device.view(torch.uint8), host.view(torch.uint8))
    assert torch.equal(back.view(torch.uint8), host.view(torch.uint8))


def test_a_copy_that_casts_goes_through_staging_in_the_device_dtype():
    """A frozen layer's weights come from the fp32 master into a bf16 device copy."""
    streams = LazyStreams()
    transfers = Transfers(streams, STAGING)
    master = values(29)
    device = torch.zeros(29, dtype=torch.bfloat16)
    transfers.to_device(device, master)
    streams.drain()
    assert torch.equal(device, master.to(torch.bfloat16))


def test_the_host_may_write_the_source_as_soon_as_a_copy_to_the_device_returns():
    streams = LazyStreams()
    transfers = Transfers(streams, Staging(buffers=4, buffer_bytes=64))
    host = values(10)
    expected = host.clone()
    device = torch.zeros(10)
    transfers.to_device(device, host)
    host.fill_(7.0)  # the optimizer's next update, say
    streams.drain()
    assert torch.equal(device, expected)
    assert streams.host_waits == 0  # the ring had room: nothing waited


def test_copies_to_the_device_wait_only_for_the_buffer_they_reuse():
    """Two buffers, five pieces: the host waits for a buffer's earlier piece before it
    refills it (three times), never for anything else."""
    streams = LazyStreams()
    transfers = Transfers(streams, STAGING)
    transfers.to_device(torch.zeros(30), values(30))
    assert streams.host_waits == 3


def test_a_prefetch_is_ordered_by_its_event_on_the_compute_stream():
    streams = LazyStreams()
    transfers = Transfers(streams, STAGING)
    host, device = values(20), torch.zeros(20)
    pending = transfers.to_device_ahead(device, host)
    assert streams.queues["compute"] == [] and streams.host_waits <= 3
    transfers.wait(pending)
    # The compute stream's next kernel runs after the wait: everything has arrived.
    streams._run("compute", len(streams.queues["compute"]))
    assert torch.equal(device, host)


def test_a_prefetch_waits_for_what_the_compute_stream_queued_before_it():
    """The block a prefetch fills may have been freed on the compute stream a moment ago,
    with a kernel still queued that writes it."""
    streams = LazyStreams()
    transfers = Transfers(streams, STAGING)
    host, device = values(20), torch.zeros(20)
    streams.queues["compute"].append(lambda: device.fill_(-1.0))  # the block's last owner
    transfers.wait(transfers.to_device_ahead(device, host))
    streams.drain()
    assert torch.equal(device, host)


def test_a_copy_to_the_host_follows_the_kernels_that_produce_its_source():
    streams = LazyStreams()
    transfers = Transfers(streams, STAGING)
    grads, device, host = values(20), torch.zeros(20), torch.zeros(20)
    streams.queues["compute"].append(lambda: device.copy_(grads))  # backward, still queued
    transfers.to_host(host, device, host_reads=False)
    transfers.settle_host()
    assert torch.equal(host, grads)


def test_a_copy_to_the_host_the_host_does_not_read_yet_lands_by_settle_host():
    streams = LazyStreams()
    transfers = Transfers(streams, Staging(buffers=4, buffer_bytes=64))
    device = values(10)
    host = torch.zeros(10)
    transfers.to_host(host, device, host_reads=False)
    assert streams.host_waits == 0
    assert torch.equal(host, torch.zeros(10))  # still in flight
    transfers.settle_host()
    assert torch.equal(host, device)


def test_a_copy_that_reads_host_memory_lands_what_is_still_on_its_way_there():
    """Gradients go home without waiting; a later fetch of that same host tensor sends
    the gradients, not what was there before."""
    streams = LazyStreams()
    transfers = Transfers(streams, Staging(buffers=4, buffer_bytes=64))
    grads, home, device = values(10, seed=1), torch.zeros(10), torch.zeros(10)
    transfers.to_host(home, grads, host_reads=False)
    transfers.to_device(device, home)
    streams.drain()
    assert torch.equal(device, grads)


def test_two_copies_to_the_same_host_memory_land_in_the_order_issued():
    streams = LazyStreams()
    transfers = Transfers(streams, Staging(buffers=4, buffer_bytes=64))
    home = torch.zeros(10)
    transfers.to_host(home, values(10, seed=1), host_reads=False)
    newer = values(10, seed=2)
    transfers.to_host(home, newer, host_reads=False)
    transfers.settle_host()
    assert torch.equal(home, newer)


def test_copies_to_the_host_larger_than_the_ring_stay_exact():
    streams = LazyStreams()
    transfers = Transfers(streams, STAGING)
    device = values(50)
    host = torch.zeros(50)
    transfers.to_host(host, device, host_reads=False)
    transfers.settle_host()
    assert torch.equal(host, device)


def test_host_reads_waits_for_this_copy_and_lands_it_at_once():
    streams = LazyStreams()
    transfers = Transfers(streams, Staging(buffers=4, buffer_bytes=64))
    device, host = values(10), torch.zeros(10)
    transfers.to_host(host, device, host_reads=True)
    assert torch.equal(host, device)
    assert streams.host_waits == 1  # one piece, one event


def test_pinned_bytes_are_the_ring_however_many_chunks_there_are():
    model = build("opt", layers=2)
    counts = {}
    for chunk_size in (2**12, 2**16):
        device = SimulatedDevice(2**30, staging=Staging(buffers=3, buffer_bytes=4096))
        eng = Engine(copy.deepcopy(model), EngineConfig(policy="cpu", chunk_size=chunk_size),
                     device=device)
        eng.step(make_batches(1)[0])
        counts[len(eng.chunks)] = device.pinned_bytes()
    assert len(counts) == 2  # two different chunk counts...
    assert set(counts.values()) == {3 * 4096}  # ...the same pinned bytes
    assert SimulatedDevice(2**30).pinned_bytes() == 0


@pytest.mark.parametrize("policy", ["cpu", "auto"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_through_staging_buffers_gives_the_same_losses_and_weights(policy, precision):
    """Buffers of 1000 bytes: every chunk crosses in many pieces, none a whole multiple;
    cpu fetches every chunk and sends every gradient home, auto with a margin also moves
    optimizer state to the device and back."""
    model = build("opt", layers=3)
    batches = make_batches(3)
    runs = []
    for staging in (None, Staging(buffers=2, buffer_bytes=1000)):
        device = SimulatedDevice(2**30, staging=staging)
        eng = Engine(copy.deepcopy(model), EngineConfig(policy=policy, precision=precision),
                     device=device)
        losses = [eng.step(batches[0]).loss]
        if policy == "auto":
            eng.set_margin(0.5)
        losses += [eng.step(b).loss for b in batches[1:]]
        if policy == "auto":
            eng.set_margin(0.0)
            losses.append(eng.step(batches[0]).loss)
        runs.append((losses, eng.model_state_dict()))
    (losses_a, weights_a), (losses_b, weights_b) = runs
    assert losses_a == losses_b
    assert all(torch.equal(weights_a[k], weights_b[k]) for k in weights_a)
