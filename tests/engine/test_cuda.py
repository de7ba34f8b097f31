"""The engine on a real GPU (skipped without CUDA): the same math as plain AdamW on the GPU,
the budget held by the caching allocator's own count, copies that never wait for the whole
device, and prefetches on the side stream that move no byte more than fetching on demand.

Marked `cuda`: these tests leave the choice of device to make_device (the rest of the suite
asks for the simulated device), and compare with references computed on the GPU.
"""

from __future__ import annotations

import copy
import gc
import time

import pytest
import torch
from conftest import build, make_batches, whole_model_relative_difference

from engine import Engine, EngineConfig
from engine.devices.cuda import MIN_HARD_CAP
from engine.devices.device import CudaDevice
from engine.devices.transfers import Staging
from engine.step.engine import StepInterrupted

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

STEPS = 5
# Not bit-identical as on the CPU: the GPU's embedding backward accumulates with atomics.
TOL = 1e-4
# bf16 keeps 8 bits of mantissa: two runs whose kernels accumulate in a different order
# agree on the loss to about 2^-8 per rounding, a few roundings deep.
BF16_TOL = 2e-2


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
    """What is guaranteed: the same bytes moved, bf16 losses within bf16's tolerance, and
    fp32 weights equal up to the GPU's own nondeterminism. Not bit-identical bf16 losses:
    prefetching changes when kernels run, not which, and atomics reorder the sums."""
    payload = sum(p.numel() * 2 for p in MODEL.parameters())
    budget = int(working_set() + payload / 4)
    batches = make_batches(3)
    runs = {}
    for precision in ("bf16", "fp32"):
        for prefetch in (True, False):
            eng = engine(MODEL, policy, budget, precision=precision)
            if not prefetch:
                monkeypatch.setattr(eng.manager, "prefetch", lambda pos: None)
            stats = [eng.step(b) for b in batches]
            assert all(c.pending is None for c in eng.chunks)  # every prefetch was waited for
            runs[precision, prefetch] = ([s.loss for s in stats], [s.bytes_h2d for s in stats],
                                         {k: v.cpu() for k, v in eng.model_state_dict().items()})
    for precision in ("bf16", "fp32"):
        (loss_a, moved_a, _), (loss_b, moved_b, _) = runs[precision, True], runs[precision, False]
        assert moved_a == moved_b
        assert loss_a == pytest.approx(loss_b, rel=BF16_TOL if precision == "bf16" else TOL)
    assert whole_model_relative_difference(runs["fp32", True][2], runs["fp32", False][2]) < TOL


def test_the_budget_caps_what_the_allocator_reserves():
    """The caching allocator's reserved bytes, cache included, stay within the budget, with
    the auto policy filling it: a model whose training state (~400 MB in bf16) is larger
    than the budget, which is above MIN_HARD_CAP so that the cap is the budget itself."""
    gc.collect()  # earlier tests' devices give their share of the process-wide cap back
    torch.cuda.empty_cache()
    budget = MIN_HARD_CAP + 64 * 2**20
    # 0.9: the most of the spare memory the planner recommends on a GPU.
    eng = engine(build("opt", layers=8, hidden=512), "auto", budget, precision="bf16")
    torch.cuda.reset_peak_memory_stats()
    batches = make_batches(3, seq_len=64, batch_size=4)
    eng.step(batches[0])
    eng.set_margin(0.9)
    for batch in batches[1:]:
        eng.step(batch)
    # The engine resets the allocator's peaks at each of its readings and keeps the highest.
    assert max(torch.cuda.max_memory_reserved(), eng.device.reserved_peak) <= budget
    eng.close()
    eng.device.close()


def test_pinned_memory_is_the_staging_ring_not_the_chunks():
    eng = engine(MODEL, "cpu", 2**30, precision="bf16")
    eng.step(make_batches(1)[0])
    assert eng.device.pinned_bytes() == Staging().buffers * Staging().buffer_bytes
    assert not any(c.payload.is_pinned() or c.master.is_pinned() for c in eng.chunks)


@pytest.mark.parametrize("numel", [1, 1000, 1024 * 1024 + 3])
def test_copies_through_small_staging_buffers_are_exact_on_the_gpu(numel):
    device = CudaDevice(2**30, staging=Staging(buffers=2, buffer_bytes=4096))
    host = torch.randn(numel).to(torch.bfloat16)
    on_gpu = device.empty(numel, torch.bfloat16)
    device.copy(on_gpu, host)
    back = torch.empty(numel, dtype=torch.bfloat16)
    device.copy(back, on_gpu, host_reads=False)
    device.settle_host()
    assert torch.equal(back, host)
    device.close()


def test_copies_do_not_wait_for_kernels_the_host_does_not_need():
    """A fetch and a gradient copy-out return while a long kernel is still running; a copy
    whose bytes the host reads waits for it (and only then)."""
    device = CudaDevice(2**30)
    host = torch.randn(1 << 20)
    on_gpu = device.empty(1 << 20, torch.float32)
    device.copy(on_gpu, host)
    torch.cuda.synchronize()
    back = torch.empty(1 << 20)
    torch.cuda._sleep(1 << 30)  # a kernel that spins for ~0.5 s
    t0 = time.perf_counter()
    device.copy(on_gpu, host)
    device.copy(back, on_gpu, host_reads=False)
    queued = time.perf_counter() - t0
    device.copy(back, on_gpu, host_reads=True)
    waited = time.perf_counter() - t0
    assert queued < 0.05 < waited
    assert torch.equal(back, host)
    device.close()


def test_a_step_measures_from_its_own_start():
    """Bytes allocated before the step that are not the engine's (another model, a
    baseline) are not counted as this step's activations."""
    device = CudaDevice(2**30)
    foreign = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    device.begin_step(model_bytes=0)
    assert device.allocator_bytes() == 0
    mine = torch.empty(2**20, dtype=torch.uint8, device="cuda")
    assert device.allocator_bytes() == 2**20
    del mine
    assert device.allocator_peak() == 2**20
    del foreign
    device.close()


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
