"""The disk as a third tier on screen: under a host budget that sends chunks to disk, the
memory chart, the states table, the chunk map and the step panel show it; a run without a
disk shows none of it."""

from __future__ import annotations

import pytest

from tests.tuitrain.fakeworker import GiB, fake_run, fake_stats
from tuitrain.formatting import format_seconds, format_size
from tuitrain.settings import Settings
from tuitrain.tui.chunk_map import DISK, ChunkMap
from tuitrain.tui.memory_chart import MemoryChart
from tuitrain.tui.states_table import StatesTable
from tuitrain.tui.step_panel import StepPanel

from .helpers import SIZE, make_app, settle

pytestmark = pytest.mark.anyio

# opt-1.3b under cpu on a 3 GiB device: its chunks and optimizer state take ~19 GiB of
# host memory; a 2 GiB host budget sends every chunk's state and the last payloads to disk.
RUN = dict(parameters=1_315_758_080, n_chunks=72, device_budget=3 * GiB, policy="cpu")
HOST_BUDGET = 2 * GiB


def settings() -> Settings:
    settings = Settings(model="opt-1.3b")
    settings.engine.policy = "cpu"
    settings.engine.device_budget = "3GiB"
    return settings


async def test_a_run_with_chunks_on_disk_shows_the_disk_in_every_panel():
    app, _ = make_app(fake_run(5, host_budget=HOST_BUDGET, **RUN), settings=settings())
    last = fake_stats(5, host_budget=HOST_BUDGET, **RUN)
    on_disk = [c for c in last.memory.chunks if c.location == "disk"]
    assert on_disk  # the script has payloads on disk to show
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        states = app.query_one(StatesTable)
        assert states.locations == ("device", "host", "disk")
        for state, count in last.memory.states["disk"].items():
            assert states.cell(state, "disk") == f"{count:,}"
        assert states.cell("param bytes", "disk") == format_size(sum(c.nbytes for c in on_disk))

        chunk_map = app.query_one(ChunkMap)
        assert chunk_map.cells_text.count(DISK[0]) == len(on_disk)
        assert chunk_map.cell_count == 72
        legend = chunk_map.query_one("#chunk-legend").content.plain
        assert f"disk {len(on_disk)}" in legend
        assert len(legend) <= chunk_map.scrollable_content_region.width

        times = app.query_one(StepPanel).times_text
        assert f"disk read {format_size(last.bytes_disk_read)}" in times
        assert f"write {format_size(last.bytes_disk_written)}" in times
        rate = (last.bytes_disk_read + last.bytes_disk_written) / last.seconds
        assert f"disk wait {format_seconds(last.disk_wait)}" in times
        assert f"at {format_size(int(rate))}/s" in times
        # Against the disk's bandwidth measured at start: the share of the step its reads
        # and writes would keep it busy at full speed.
        memory_ = last.memory
        busy = (last.bytes_disk_read / memory_.disk_read_bandwidth
                + last.bytes_disk_written / memory_.disk_write_bandwidth) / last.seconds
        assert f"disk busy {busy:.0%} at full speed" in times

        memory = app.query_one(MemoryChart)
        assert memory.uses_disk and memory.samples[-1].disk_model == last.memory.disk_model
        assert f"disk {format_size(last.memory.disk_model)}" in memory.host_caption().plain
        # The engine's share of the host counts the disk tier's I/O buffers.
        engine = last.memory.host_model + last.memory.host_io_buffers + last.memory.device_model
        assert memory.engine_host_bytes(memory.samples[-1]) == engine


async def test_a_run_without_a_disk_shows_no_trace_of_one():
    app, _ = make_app(fake_run(5, **RUN), settings=settings())
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.query_one(StatesTable).locations == ("device", "host")
        chunk_map = app.query_one(ChunkMap)
        assert DISK[0] not in chunk_map.cells_text
        assert "disk" not in chunk_map.query_one("#chunk-legend").content.plain
        assert "disk" not in app.query_one(StepPanel).times_text
        memory = app.query_one(MemoryChart)
        assert not memory.uses_disk and "disk" not in memory.host_caption().plain


async def test_state_on_disk_alone_shows_the_disk_but_no_chunk_located_there():
    """Optimizer state on disk, every payload on the host: a disk column and the disk's
    bytes, and a chunk map without disk cells."""
    whole = fake_stats(1, **RUN).memory.host_model
    budget = whole * 3 // 4
    app, _ = make_app(fake_run(3, host_budget=budget, **RUN), settings=settings())
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        states = app.query_one(StatesTable)
        assert states.locations == ("device", "host", "disk")
        assert states.cell("param bytes", "disk") == "0 B"
        chunk_map = app.query_one(ChunkMap)
        assert DISK[0] not in chunk_map.cells_text
        assert "disk" not in chunk_map.query_one("#chunk-legend").content.plain
        assert "disk read" in app.query_one(StepPanel).times_text
        assert app.query_one(MemoryChart).uses_disk
