"""Each step reports its PEAK resident memory, not a sample at its end: a block allocated
and freed in the middle of a step shows in the step's process_rss (Linux: the kernel's
high-water mark, reset as each step starts)."""

from __future__ import annotations

import sys

import psutil
import pytest
import torch

from engine import Engine, EngineConfig
from engine.devices.host_memory import PeakResident
from tests.engine.conftest import VOCAB, build

BLOCK = 256 * 2**20  # far above what a step of this model holds, and than any sampling noise

linux = pytest.mark.skipif(sys.platform != "linux", reason="a resettable high-water mark")


def touch_and_free() -> None:
    block = torch.ones(BLOCK // 4)  # written: every page resident
    del block


@linux
def test_peak_resident_sees_a_freed_block_and_forgets_it_after_reset() -> None:
    peak = PeakResident()
    assert peak.exact
    peak.reset()
    before = psutil.Process().memory_info().rss
    touch_and_free()
    assert peak.read() >= before + BLOCK * 0.95
    peak.reset()
    assert peak.read() < before + BLOCK / 2


@linux
def test_a_step_reports_the_block_it_allocated_and_freed_midway() -> None:
    model = build("opt")
    spike = {"on": False}

    def allocate(module: torch.nn.Module, args: object) -> None:
        if spike["on"]:
            touch_and_free()

    model.model.decoder.layers[1].register_forward_pre_hook(allocate)
    eng = Engine(model, EngineConfig(policy="cpu", device_budget="1GiB", simulate=True))
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    quiet = eng.step(batch).memory
    spike["on"] = True
    spiky = eng.step(batch).memory
    spike["on"] = False
    after = eng.step(batch).memory  # the mark was reset: the block belongs to one step
    eng.close()
    assert spiky.process_rss_exact
    assert spiky.process_rss >= quiet.process_rss + BLOCK * 0.9
    assert after.process_rss < spiky.process_rss - BLOCK / 2
