"""StepStats counts every byte the step copied between host and device, including the copies
made when a pending change of policy, margin or budget is applied at the step's start."""

from __future__ import annotations

import copy

import pytest

from engine import Engine, EngineConfig
from tests.engine.conftest import build, make_batches

MODEL = build("opt", layers=3, hidden=64)
BATCHES = make_batches(8)


def spy_on_copies(eng: Engine) -> list[int]:
    """Wrap the device's copies; returns a list whose last item counts the bytes copied
    since it was last appended to. A copy made inside another (a prefetch that is a plain
    copy on this device) counts once."""
    copied = [0]
    depth = [0]
    device = eng.device

    def counting(copy_fn):
        def wrapped(dst, src, *args, **kwargs):
            if depth[0] == 0:
                copied[-1] += src.nbytes
            depth[0] += 1
            try:
                return copy_fn(dst, src, *args, **kwargs)
            finally:
                depth[0] -= 1
        return wrapped

    device.copy, device.copy_ahead = counting(device.copy), counting(device.copy_ahead)
    return copied


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_each_step_reports_exactly_the_bytes_its_copies_moved_across_live_changes(precision):
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy="auto", device_budget="64MiB",
                                                    precision=precision, simulate=True))
    copied = spy_on_copies(eng)
    changes = {
        2: lambda: eng.set_margin(1.0),
        3: lambda: eng.set_policy("cpu"),
        4: lambda: eng.set_policy("cuda"),
        5: lambda: eng.set_policy("auto"),
        6: lambda: eng.set_margin(0.0),
    }
    for i, batch in enumerate(BATCHES):
        if i in changes:
            changes[i]()
        copied.append(0)
        stats = eng.step(batch)
        assert stats.bytes_h2d + stats.bytes_d2h == copied[-1], (i, stats.applied)
    # The step that applied the margin moved optimizer state to the device: more than a
    # plain auto step copies, and all of it reported.
    assert copied[3] > copied[2]


@pytest.mark.parametrize("policy", ["cpu", "auto", "cuda"])
def test_the_timeline_adds_up_to_the_step_it_describes(policy):
    """StepStats.timeline is the step interval by interval: forward then backward, named by
    module; its copies add up to the step's (every copy under cpu happens inside an
    interval), and its peaks are the step's."""
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy=policy, device_budget="64MiB",
                                                    simulate=True))
    names = {name for name, _ in eng.model.named_modules()}
    for batch in BATCHES[:3]:
        stats = eng.step(batch)
        timeline = stats.timeline
        phases = [p.phase for p in timeline]
        assert phases[0] == "forward" and phases[-1] == "backward"
        assert phases == sorted(phases, key=lambda phase: phase == "backward")
        assert all(p.module in names for p in timeline)
        assert "model.decoder.layers.2.fc2" in {p.module for p in timeline}
        # Each interval's bars stop at its peak: the highest is the step's.
        assert max(p.model_bytes + p.non_model_bytes for p in timeline) == stats.memory.device_peak
        assert max(p.non_model_bytes for p in timeline) <= stats.memory.device_non_model_peak
        if policy == "cpu":
            assert sum(p.bytes_h2d for p in timeline) == stats.bytes_h2d > 0
            assert sum(p.bytes_d2h for p in timeline) == stats.bytes_d2h
            # Chunks are copied in within the intervals of the modules that use them.
            assert sum(p.bytes_h2d for p in timeline if p.phase == "forward") > 0
        else:
            assert sum(p.bytes_h2d for p in timeline) <= stats.bytes_h2d
