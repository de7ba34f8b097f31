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
