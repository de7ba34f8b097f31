"""Where the engine's memory is, as telemetry reports it (engine.telemetry.MemorySnapshot)."""

from __future__ import annotations

from engine.chunks.chunk import Chunk
from engine.chunks.manager import ChunkManager
from engine.chunks.state import TensorState
from engine.devices.device import ComputeDevice
from engine.telemetry import ChunkInfo, MemorySnapshot

__all__ = ["memory_snapshot"]


def memory_snapshot(chunks: list[Chunk], manager: ChunkManager, device: ComputeDevice, *,
                    non_model_peak: int, peak: int, rss: int, rss_exact: bool
                    ) -> MemorySnapshot:
    """The chunks' bytes and states by location now, beside the peaks the engine gives
    (the last step's device peaks and the process's resident bytes)."""
    locations = ("device", "host", "disk") if manager.spill else ("device", "host")
    states = {loc: {s.value: 0 for s in TensorState} for loc in locations}
    infos = []
    for c in chunks:
        for slot in c.slots:
            states[c.location][slot.state.value] += 1
        infos.append(ChunkInfo(c.index, c.location, c.most_active().value, c.nbytes,
                               c.frozen))
    spill = manager.spill
    bandwidth = spill.tier.bandwidth if spill is not None else (0.0, 0.0)
    return MemorySnapshot(
        device_capacity=device.capacity(), device_model=manager.device_bytes,
        device_non_model_peak=non_model_peak, device_peak=peak,
        host_model=manager.host_bytes, process_rss=rss, process_rss_exact=rss_exact,
        states=states, chunks=infos, disk_model=manager.disk_bytes,
        host_io_buffers=manager.io_buffer_bytes,
        disk_write_bandwidth=bandwidth[0], disk_read_bandwidth=bandwidth[1])
