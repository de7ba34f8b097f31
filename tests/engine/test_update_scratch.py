"""A 16-bit update reads its gradients as fp32 into one buffer kept through the update
(engine.step.optimizer.fp32_grads), as large as the largest chunk: not a new tensor for
every gradient, which on the simulated device was new memory page by page each step."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import Engine, EngineConfig
from engine.step import optimizer
from tests.engine.conftest import build, make_batches


def test_16_bit_gradients_are_read_into_the_scratch_and_fp32_ones_left_as_they_are():
    half = [torch.randn(6).bfloat16(), torch.randn(2, 3).bfloat16()]
    full = torch.randn(4)
    scratch = torch.full((16,), float("nan"))
    a, b, c = optimizer.fp32_grads([half[0], full, half[1]], scratch)
    assert b is full
    assert torch.equal(a, half[0].float()) and torch.equal(c, half[1].float())
    assert c.shape == (2, 3)
    assert a.data_ptr() == scratch.data_ptr()  # one after another in the scratch
    assert c.data_ptr() == scratch.data_ptr() + 6 * 4
    fresh = optimizer.fp32_grads(half, None)  # no scratch: new tensors, as before
    assert all(torch.equal(f, h.float()) for f, h in zip(fresh, half, strict=True))
    assert optimizer.fp32_grads([full], scratch)[0] is full
    assert optimizer.update_scratch([], "bf16", torch.device("cpu")) is None


@pytest.mark.parametrize("policy", ["cuda", "cpu", "auto"])
def test_a_bf16_step_takes_one_scratch_a_side_and_trains_as_new_tensors_did(policy,
                                                                          monkeypatch):
    """Each side that updates (the device's resident chunks, the host's) takes one scratch
    a step, the size of its largest chunk, and the weights come out bit for bit as with a
    new fp32 tensor per gradient."""
    model = build("opt", layers=2)
    batches = make_batches(3)
    # auto: the margin makes some chunks resident, the others update on the host.
    budget = {"cuda": "64MiB", "cpu": "64MiB", "auto": "1500KiB"}[policy]
    weights = {}
    make = optimizer.update_scratch
    for scratch in (True, False):
        taken: list[int] = []

        def counted(chunks, precision, device, scratch=scratch, taken=taken):
            if not scratch:
                return None
            buffer = make(chunks, precision, device)
            if chunks:  # a side with nothing to update takes none
                taken.append(buffer.numel())
                assert buffer.numel() == max(c.home_numel for c in chunks)
            return buffer

        monkeypatch.setattr(optimizer, "update_scratch", counted)
        with Engine(copy.deepcopy(model), EngineConfig(
                policy=policy, device_budget=budget, precision="bf16",
                margin_ratio=1.0 if policy == "auto" else 0.0)) as eng:
            for batch in batches:
                eng.step(batch)
            weights[scratch] = eng.model_state_dict()
            sides = len({c.copy_is_home for c in eng.chunks if not c.frozen})
        assert sides == (2 if policy == "auto" else 1)
        if scratch:
            # auto's first step updates every chunk on the host: the margin places after it.
            assert len(taken) == len(batches) * sides - (policy == "auto")
    assert weights[True].keys() == weights[False].keys()
    assert all(torch.equal(weights[True][k], weights[False][k]) for k in weights[True])
