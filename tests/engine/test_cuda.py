"""The engine on a real GPU (skipped without CUDA): the same math as plain AdamW on the GPU,
the budget held by the caching allocator's own count, and prefetches on the side stream that
move no byte more than fetching on demand."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import build, make_batches, whole_model_relative_difference

from engine import Engine, EngineConfig
from engine.step.engine import StepInterrupted

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

STEPS = 5
# Not bit-identical as on the CPU: the GPU's embedding backward accumulates with atomics.
TOL = 1e-4


def reference(model, batches) -> tuple[list[float], dict]:
    model = copy.deepcopy(model).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses = []
    for batch in batches:
        loss = model(**{k: v.cuda() for k, v in batch.items()}).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def engine(model, policy: str, budget: int, **kw) -> Engine:
    return Engine(copy.deepcopy(model), EngineConfig(policy=policy, device_budget=budget,
                                                     simulate=False, **kw))


MODEL = build("opt", layers=8, hidden=128) if torch.cuda.is_available() else None


def working_set() -> int:
    eng = engine(MODEL, "auto", 2**30)
    eng.step(make_batches(1)[0])
    return eng.trace.working_set


@pytest.mark.parametrize("policy,tight", [("cuda", False), ("auto", False), ("auto", True),
                                          ("cpu", True)])
def test_losses_and_weights_match_adamw_on_the_gpu(policy, tight):
    batches = make_batches(STEPS)
    ref_losses, ref_weights = reference(MODEL, batches)
    budget = int(working_set() * 1.1) if tight else 2**30
    eng = engine(MODEL, policy, budget, margin_ratio=0.5 if policy == "auto" else 0.0)
    losses = []
    for batch in batches:
        stats = eng.step(batch)
        losses.append(stats.loss)
        assert stats.memory.device_peak <= budget
    assert losses == pytest.approx(ref_losses, rel=TOL)
    weights = {k: v.cpu() for k, v in eng.model_state_dict().items()}
    assert whole_model_relative_difference(weights, ref_weights) < TOL


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_prefetching_on_the_side_stream_moves_no_byte_more(policy, monkeypatch):
    payload = sum(p.numel() * 2 for p in MODEL.parameters())
    budget = int(working_set() + payload / 4)
    batches = make_batches(3)
    runs = {}
    for prefetch in (True, False):
        eng = engine(MODEL, policy, budget, precision="bf16")
        if not prefetch:
            monkeypatch.setattr(eng.manager, "prefetch", lambda pos, phase: None)
        runs[prefetch] = [(s.loss, s.bytes_h2d) for s in map(eng.step, batches)]
        assert all(c.pending is None for c in eng.chunks)  # every prefetch was waited for
    assert runs[True] == runs[False]


def test_an_interrupted_step_leaves_nothing_on_the_gpu():
    eng = engine(MODEL, "cpu", 2**30, precision="bf16")
    batches = make_batches(2)
    eng.step(batches[0])
    before = torch.cuda.memory_allocated()
    # Mid-forward: chunks fetched, activations saved, prefetches in flight.
    hook = eng.model.model.decoder.layers[3].register_forward_pre_hook(
        lambda *_: eng.interrupt())
    try:
        eng.step(batches[1])
    except StepInterrupted:
        pass  # not kept: a held traceback would keep the step's tensors alive
    else:
        pytest.fail("the step was not interrupted")
    hook.remove()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    assert eng.step(batches[1]).step == 2
