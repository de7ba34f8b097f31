"""LoRA on the offload engine: peft's adapters train, the base weights stay frozen in
payload-only chunks, and the math is the same PEFT model's with fused AdamW.

Frozen chunks keep no gradient buffer, fp32 master or moments, are never packed with
trainable parameters, and go wherever the policy puts them (device, host, disk). The adapter
weights come from the seed alone, whether the model was wrapped whole or on the meta device.
"""

from __future__ import annotations

import copy
from functools import cache

import pytest
import torch
from conftest import build, engine_run, make_batches, max_relative_difference, reference_run

from engine import Engine, EngineConfig
from engine.models.lora import Lora, LoraWeights, NoTargets, apply_lora, parameter_counts
from engine.models.weight_source import materialise
from engine.models.zoo import build_model, meta_build

STEPS = 4
TOL = 1e-5
BATCHES = make_batches(STEPS)
LORA = Lora(rank=4, alpha=8)


def lora_model(arch: str = "opt", **lora) -> torch.nn.Module:
    """A small model with adapters whose B starts away from zero, so that A gets gradients
    from the first step (as after a step or two of training)."""
    model = apply_lora(build(arch, layers=4), Lora(**{"rank": 4, "alpha": 8, **lora}), seed=3)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


MODEL = lora_model()


@cache  # made by the worker that runs these tests, not by every worker that collects them
def reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The PEFT model itself, with fused AdamW, over BATCHES."""
    return reference_run(MODEL, BATCHES)


def run_engine(model, batches, *, changes=(), **config):
    return engine_run(model, batches, changes=changes, **config)


def assert_matches_peft(eng, losses):
    ref_losses, ref_weights = reference()
    assert losses == pytest.approx(ref_losses, rel=TOL)
    assert max_relative_difference(eng.model_state_dict(), ref_weights) <= TOL


# --- the adapters -------------------------------------------------------------------------


def test_adapters_wrapped_on_the_meta_device_come_out_as_when_wrapped_whole():
    whole = apply_lora(build_model("tiny", seed=1), LORA, seed=5)
    built = meta_build("tiny", seed=1)
    meta = apply_lora(built.model, LORA, seed=5)
    assert all(p.is_meta for p in meta.parameters())
    # A tensor at a time, in another order and place than the whole build, as the engine
    # fills its chunks: the base's weights from the build's source, the adapters by name.
    materialise(meta, LoraWeights(meta, built.weights, 5))
    whole_params = dict(whole.named_parameters())
    for name, p in meta.named_parameters():
        assert torch.equal(p, whole_params[name]), name
    adapters = {n: p for n, p in whole.named_parameters() if ".lora_" in n}
    assert adapters and len(adapters) == sum(".lora_" in n for n, _ in meta.named_parameters())
    for name, p in meta.named_parameters():
        if ".lora_" in name:
            assert torch.equal(p, adapters[name]), name
    # A starts drawn, B at zero: the wrapped model starts as the base model.
    assert all(p.abs().sum() > 0 for n, p in adapters.items() if ".lora_A." in n)
    assert all(p.abs().sum() == 0 for n, p in adapters.items() if ".lora_B." in n)


def test_another_seed_draws_other_adapters_and_the_callers_random_state_is_left_alone():
    torch.manual_seed(11)
    before = torch.get_rng_state()
    one = apply_lora(build_model("tiny"), LORA, seed=1)
    assert torch.equal(torch.get_rng_state(), before)
    two = apply_lora(build_model("tiny"), LORA, seed=2)
    a1 = next(p for n, p in one.named_parameters() if ".lora_A." in n)
    a2 = next(p for n, p in two.named_parameters() if ".lora_A." in n)
    assert not torch.equal(a1, a2)


def test_only_the_adapters_train():
    model = apply_lora(build_model("tiny"), LORA)
    trainable, frozen = parameter_counts(model)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(".lora_" in n for n in names)
    assert trainable == sum(p.numel() for n, p in model.named_parameters() if ".lora_" in n)
    assert frozen == sum(p.numel() for p in build_model("tiny").parameters())


def test_targets_that_match_no_module_are_refused_by_name():
    with pytest.raises(NoTargets, match="nope"):
        apply_lora(build_model("tiny"), Lora(rank=4, targets=("q_proj", "nope")))
    with pytest.raises(NoTargets, match="'self_attn' name a module LoRA cannot adapt"):
        apply_lora(build_model("tiny"), Lora(rank=4, targets=("self_attn",)))  # a block
    for tied in ("embed_tokens", "lm_head"):  # OPT ties them: a merge would change both
        with pytest.raises(NoTargets, match=f"'{tied}': the model's input and output"):
            apply_lora(build_model("tiny"), Lora(rank=4, targets=("q_proj", tied)))
    only_q = apply_lora(build_model("tiny"), Lora(rank=4, targets=("q_proj",)))
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1]
            for n, p in only_q.named_parameters() if p.requires_grad} == {"q_proj"}


# --- frozen weights in payload-only chunks ------------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_frozen_weights_live_in_payload_only_chunks_never_packed_with_trainable_ones(
        precision):
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy="cpu", device_budget="64MiB",
                                                   precision=precision))
    frozen = [c for c in eng.chunks if c.frozen]
    trainable = [c for c in eng.chunks if not c.frozen]
    assert frozen and trainable
    for chunk in eng.chunks:  # all of a chunk's parameters are of one kind
        assert len({s.param.requires_grad for s in chunk.slots}) == 1
        assert chunk.frozen == (not chunk.slots[0].param.requires_grad)
    for chunk in frozen:
        assert chunk.exp_avg is None and chunk.exp_avg_sq is None and chunk.host_grad is None
        assert chunk.master is (chunk.payload if precision == "fp32" else None)
    eng.step(BATCHES[0])
    # The host holds each frozen chunk's payload and nothing more. A trainable one: in fp32
    # its master and moments (its gradients' landing place went with their update).
    itemsize = 4 if precision == "fp32" else 2
    per_param = 12 if precision == "fp32" else 14
    assert eng.manager.host_bytes == (sum(c.numel * itemsize for c in frozen)
                                      + sum(c.numel * per_param for c in trainable))
    # No frozen chunk ever got a gradient buffer or an update.
    assert all(c.grad is None and not c.holds_grads for c in frozen)


def test_a_resident_frozen_chunk_costs_its_payload_on_the_device():
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(policy="cuda", device_budget="64MiB",
                                                   precision="fp32"))
    eng.step(BATCHES[0])
    frozen = [c for c in eng.chunks if c.frozen]
    assert all(c.resident and c.exp_avg is None for c in frozen)
    assert all(eng.manager.resident_cost(c) == 4 * c.numel for c in frozen)
    assert eng.manager.host_bytes == 0


def test_frozen_chunks_go_to_disk_as_payloads_alone(tmp_path):
    eng, losses = run_engine(MODEL, BATCHES, policy="cpu", device_budget="64MiB",
                             host_budget=2**20, disk_dir=tmp_path)
    frozen = [c for c in eng.chunks if c.frozen]
    assert any(c.payload_on_disk for c in frozen)
    state_files = {p.name for p in tmp_path.rglob("chunk-*-state")}
    assert state_files  # the adapters' optimizer state is there
    assert not any(f"chunk-{c.index:05d}-state" in state_files for c in frozen)
    assert_matches_peft(eng, losses)


# --- exact: the PEFT model with fused AdamW ------------------------------------------------


@pytest.mark.parametrize("policy", ["cuda", "cpu", "auto"])
def test_every_policy_trains_as_the_peft_model_with_fused_adamw(policy):
    eng, losses = run_engine(MODEL, BATCHES, policy=policy, device_budget="64MiB")
    assert_matches_peft(eng, losses)


def test_a_tight_budget_with_a_margin_trains_as_the_peft_model():
    probe, _ = run_engine(MODEL, BATCHES[:1], policy="auto", device_budget="64MiB")
    tight = int(probe.trace.working_set * 1.05)
    eng, losses = run_engine(MODEL, BATCHES, policy="auto", device_budget=tight,
                             margin_ratio=0.5)
    assert_matches_peft(eng, losses)


def test_live_changes_train_as_the_peft_model():
    changes = [(), [("policy", "cuda")], [("margin", 0.5), ("policy", "auto")],
               [("policy", "cpu"), ("budget", "32MiB")]]
    eng, losses = run_engine(MODEL, BATCHES, policy="auto", device_budget="64MiB",
                             changes=changes)
    assert_matches_peft(eng, losses)


def test_accumulation_trains_as_the_peft_model_on_the_whole_batch(tmp_path):
    eng, losses = run_engine(MODEL, BATCHES, policy="auto", device_budget="64MiB",
                             grad_accum=2, host_budget=2**20, disk_dir=tmp_path)
    assert_matches_peft(eng, losses)


def test_lora_dropout_is_drawn_from_the_seed_like_the_models():
    model = lora_model(dropout=0.3)
    model.train()

    def losses() -> list[float]:
        torch.manual_seed(5)
        eng, out = run_engine(model, BATCHES[:2], policy="cpu", device_budget="64MiB")
        eng.close()
        return out

    first = losses()
    assert first == losses()
    torch.manual_seed(5)
    ref, _ = reference_run(model, BATCHES[:2])
    assert first == pytest.approx(ref, rel=TOL)


def test_a_base_layer_unfrozen_mid_run_trains_from_then_on():
    model = copy.deepcopy(MODEL)
    eng = Engine(model, EngineConfig(policy="auto", device_budget="64MiB", precision="fp32"))
    ref = copy.deepcopy(MODEL)
    opt = torch.optim.AdamW([p for p in ref.parameters()], lr=1e-3, fused=True)
    for i, batch in enumerate(BATCHES):
        if i == 2:
            for m in (model, ref):
                m.base_model.model.model.decoder.layers[1].fc1.base_layer.requires_grad_(True)
        ours = eng.step(batch).loss
        loss = ref(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert ours == pytest.approx(loss.item(), rel=TOL)
    weights = {k: v.detach() for k, v in ref.state_dict().items()}
    assert max_relative_difference(eng.model_state_dict(), weights) <= TOL
