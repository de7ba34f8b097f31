"""On a GPU the plan counts the page-locked staging ring the device holds, a fixed 256 MiB
whatever the model, in the host figures."""

from __future__ import annotations

from engine.devices.cuda import DEFAULT_STAGING
from engine.planning import host_memory as planner
from engine.planning.planner import plan


def test_the_pinned_staging_ring_is_in_the_host_peak_on_a_gpu(monkeypatch):
    assert planner.PINNED_STAGING == DEFAULT_STAGING.buffers * DEFAULT_STAGING.buffer_bytes
    assert planner.PINNED_STAGING == 256 * 2**20
    args = dict(device_mem="6GiB", host_mem="64GiB", precision="bf16", batch_size=2,
                seq_len=64, simulated=False)
    with_ring = plan("tiny", **args)
    monkeypatch.setattr(planner, "PINNED_STAGING", 0)
    without = plan("tiny", **args)
    for name, row in with_ring.policies.items():
        assert row.host_peak - without.policies[name].host_peak == 256 * 2**20, name
