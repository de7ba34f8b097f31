"""The crown jewel: placement changes where bytes live, never the math.

In fp32, any policy, any budget that fits, any margin and any sequence of live changes
gives the losses and final weights of plain torch.optim.AdamW on the same batches.
"""

from __future__ import annotations

import copy
from functools import cache

import pytest
import torch
from conftest import (
    build,
    engine_run,
    make_batches,
    max_relative_difference,
    reference_run,
    whole_model_relative_difference,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import Engine, EngineConfig

STEPS = 5
TOL = 1e-5
BATCHES = make_batches(STEPS)
MODEL = build("opt", layers=8, hidden=128)
AMPLE = 64 * 2**20

# What the tests compare with is made when a test first asks for it, once (functools.cache),
# not when the module is imported: under pytest-xdist every worker imports every test module
# to collect it, and only one of them runs this one.


@cache
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch with fused AdamW over MODEL and BATCHES."""
    return reference_run(MODEL, BATCHES)


def working_set(model) -> int:
    eng = Engine(copy.deepcopy(model), EngineConfig(policy="auto", device_budget="1GiB"))
    eng.step(BATCHES[0])
    return eng.trace.working_set


@cache
def small(arch: str) -> tuple[torch.nn.Module, int]:
    """A 4-layer `arch` model and its working set, made once for the tests that train
    copies of it (nothing changes the model itself)."""
    model = build(arch, layers=4)
    return model, working_set(model)


@cache
def small_reference(arch: str, checkpointing: bool) -> tuple[list[float], dict]:
    """The reference run of small(arch), shared by the tests (of either policy) that
    compare against it."""
    return reference_run(small(arch)[0], BATCHES, checkpointing=checkpointing)


@cache
def tight() -> int:
    """A device budget just above MODEL's working set."""
    return int(working_set(MODEL) * 1.05)


def budget_of(name: str) -> int:
    """The budget named "ample" or "tight"."""
    return AMPLE if name == "ample" else tight()


PAYLOAD = sum(p.numel() * 4 for p in MODEL.parameters())


def run_engine(model, batches, *, policy, budget, margin, changes=(), **config):
    return engine_run(model, batches, changes=changes, policy=policy, device_budget=budget,
                      margin_ratio=margin, **config)


def assert_matches_reference(eng, losses, ref_losses=None, ref_weights=None):
    if ref_losses is None:
        ref_losses, ref_weights = reference()
    for ours, theirs in zip(losses, ref_losses, strict=True):
        assert abs(ours - theirs) <= TOL * abs(theirs)
    assert max_relative_difference(eng.model_state_dict(), ref_weights) <= TOL


def test_tight_budget_is_well_under_the_model():
    # Half the parameters alone exceed it, let alone the 16 bytes per parameter of training.
    assert tight() < PAYLOAD / 2


@pytest.mark.parametrize("policy", ["cuda", "cpu", "auto"])
@pytest.mark.parametrize("budget", ["ample", "tight"])
@pytest.mark.parametrize("margin", [0.0, 0.5, 1.0])
def test_every_policy_budget_and_margin_matches_adamw(policy, budget, margin):
    if policy == "cuda" and budget == "tight":
        with pytest.raises(ValueError, match="policy cuda needs"):
            run_engine(MODEL, BATCHES, policy=policy, budget=budget_of(budget), margin=margin)
        return
    eng, losses = run_engine(MODEL, BATCHES, policy=policy, budget=budget_of(budget),
                             margin=margin)
    assert_matches_reference(eng, losses)


change = st.one_of(
    st.tuples(st.just("policy"), st.sampled_from(["cpu", "auto"])),
    st.tuples(st.just("margin"), st.sampled_from([0.0, 0.25, 0.5, 1.0])),
    st.tuples(st.just("budget"), st.deferred(
        lambda: st.sampled_from([tight(), tight() * 2, AMPLE]))),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(policy=st.sampled_from(["cpu", "auto"]),
       budget=st.sampled_from(["ample", "tight"]),
       margin=st.sampled_from([0.0, 0.5, 1.0]),
       changes=st.lists(st.lists(change, max_size=3), min_size=STEPS, max_size=STEPS))
def test_any_sequence_of_live_changes_matches_adamw(policy, budget, margin, changes):
    eng, losses = run_engine(MODEL, BATCHES, policy=policy, budget=budget_of(budget),
                             margin=margin, changes=changes)
    assert_matches_reference(eng, losses)


def test_switching_to_cuda_and_back_mid_run_matches_adamw():
    changes = [(), [("policy", "cuda")], [("margin", 0.5)], [("policy", "cpu")], ()]
    eng, losses = run_engine(MODEL, BATCHES, policy="auto", budget=AMPLE,
                             margin=0.0, changes=changes)
    assert_matches_reference(eng, losses)


@pytest.mark.parametrize("arch", ["opt", "gpt2", "llama"])
@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_activation_checkpointing_matches_adamw(arch, policy):
    model, model_working_set = small(arch)
    ref_losses, ref_weights = small_reference(arch, checkpointing=True)
    ckpt = copy.deepcopy(model)
    ckpt.gradient_checkpointing_enable()
    budget = int(model_working_set * 1.1)
    eng, losses = run_engine(ckpt, BATCHES, policy=policy, budget=budget, margin=0.5)
    assert_matches_reference(eng, losses, ref_losses, ref_weights)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_other_architectures_match_adamw(arch):
    model, model_working_set = small(arch)
    ref_losses, ref_weights = small_reference(arch, checkpointing=False)
    budget = int(model_working_set * 1.05)
    eng, losses = run_engine(model, BATCHES, policy="auto", budget=budget, margin=0.0)
    assert_matches_reference(eng, losses, ref_losses, ref_weights)


def test_gradient_clipping_matches_clip_grad_norm():
    # The clip coefficient comes from per-chunk norms, torch's from per-tensor norms: equal
    # to float rounding, so the comparison is by relative norm (see conftest).
    ref_losses, ref_weights = reference_run(MODEL, BATCHES, max_grad_norm=0.5)
    eng, losses = run_engine(MODEL, BATCHES, policy="cpu", budget=AMPLE,
                             margin=0.0, max_grad_norm=0.5)
    for ours, theirs in zip(losses, ref_losses, strict=True):
        assert abs(ours - theirs) <= TOL * abs(theirs)
    assert whole_model_relative_difference(eng.model_state_dict(), ref_weights) <= TOL


def test_bf16_tracks_fp32():
    """bf16 keeps 8 mantissa bits: each product is off by up to 2^-9 relative, and the
    errors average out over a 64-wide dot product; fp32 master weights keep the updates
    exact. On a batch it can memorise, the loss must fall like fp32's and stay within 2%
    of it."""
    batches = make_batches(1) * 12
    fp32 = Engine(copy.deepcopy(MODEL), EngineConfig(policy="cpu", device_budget="64MiB"))
    bf16 = Engine(copy.deepcopy(MODEL), EngineConfig(policy="cpu", device_budget="64MiB",
                                                      precision="bf16"))
    a = [fp32.step(b).loss for b in batches]
    b = [bf16.step(b).loss for b in batches]
    for x, y in zip(a, b, strict=True):
        assert abs(x - y) <= 0.02 * x
    assert b[-1] < 0.9 * b[0]


def test_bf16_on_the_simulated_device_is_the_same_whatever_the_placement():
    """bf16 is the simulated device's default on a CPU with bf16 units (tuitrain.settings):
    there the host and the device run the same kernels, so every policy, budget and margin,
    and a change mid-run, give the same losses and weights bit for bit, as in fp32."""

    def run(policy, budget, margin, changes=()):
        eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy=policy, device_budget=budget,
                                                         margin_ratio=margin, precision="bf16"))
        losses = []
        for i, batch in enumerate(BATCHES):
            for kind, value in changes[i] if i < len(changes) else ():
                getattr(eng, f"set_{kind}")(value)
            losses.append(eng.step(batch).loss)
        return losses, eng.model_state_dict()

    first, weights = run("cuda", AMPLE, 0.0)
    for setting in (("cpu", AMPLE, 0.0), ("auto", tight(), 0.5),
                    ("cpu", AMPLE, 0.0, ((), (("policy", "auto"),), (("margin", 1.0),)))):
        losses, other = run(*setting)
        assert losses == first, setting
        assert all(torch.equal(other[name], weights[name]) for name in weights), setting


# --- gradient accumulation ------------------------------------------------------------------
# N micro-batches of b sequences give the weights of one batch of N x b. Not bit for bit:
# summing per-micro-batch gradients rounds differently from one backward over the whole
# batch, and AdamW turns that noise into full steps where the true gradient is zero (OPT's
# key bias; see whole_model_relative_difference), so the weights are compared as one vector.

WHOLE_BATCHES = make_batches(STEPS, batch_size=4, seed=7)


@cache
def whole_reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch over the whole batches of 4."""
    return reference_run(MODEL, WHOLE_BATCHES)


@cache
def working_set_of_4(grad_accum: int) -> int:
    """The working set of a step on batches of 4 sequences, in `grad_accum` micro-batches
    (a scaled loss makes backward a little different from an unscaled one)."""
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy="auto", device_budget="1GiB",
                                                    grad_accum=grad_accum))
    eng.step(WHOLE_BATCHES[0])
    return eng.trace.working_set


def accum_budget(name: str) -> int:
    """"ample", or just above the working set of 2 micro-batches of 2."""
    return AMPLE if name == "ample" else int(working_set_of_4(2) * 1.05)


@pytest.mark.parametrize("policy", ["cuda", "cpu", "auto"])
@pytest.mark.parametrize("budget", ["ample", "tight"])
def test_gradient_accumulation_equals_the_whole_batch(policy, budget):
    if policy == "cuda" and budget == "tight":
        pytest.skip("cuda keeps every chunk on the device: no tight budget")
    changes = [(), (("margin", 0.5),), (("policy", "cpu"),), (("policy", policy),)]
    assert accum_budget("tight") < working_set_of_4(1)  # a micro-batch's memory suffices
    eng, losses = run_engine(MODEL, WHOLE_BATCHES, policy=policy, budget=accum_budget(budget),
                             margin=0.0, changes=changes, grad_accum=2)
    whole_losses, whole_weights = whole_reference()
    assert losses == pytest.approx(whole_losses, rel=TOL)
    assert whole_model_relative_difference(eng.model_state_dict(), whole_weights) <= TOL


def test_accumulated_micro_batches_are_the_batch_in_order():
    first = Engine(copy.deepcopy(MODEL), EngineConfig(device_budget=AMPLE,
                                                      grad_accum=2))
    stats = first.step(WHOLE_BATCHES[0])
    assert stats.micro_batches == 2 and len(stats.micro_losses) == 2
    assert stats.loss == pytest.approx(sum(stats.micro_losses) / 2)
    halves = [{k: v[i * 2:(i + 1) * 2] for k, v in WHOLE_BATCHES[0].items()} for i in (0, 1)]
    singles = [Engine(copy.deepcopy(MODEL), EngineConfig(device_budget=AMPLE))
               .step(h).loss for h in halves]
    assert stats.micro_losses == singles
    assert stats.tokens == WHOLE_BATCHES[0]["input_ids"].numel()


def test_a_batch_that_does_not_split_evenly_is_refused_before_anything_runs():
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(device_budget=AMPLE,
                                                    grad_accum=3))
    with pytest.raises(ValueError, match="does not split into 3"):
        eng.step(WHOLE_BATCHES[0])
    assert eng.step_count == 0
