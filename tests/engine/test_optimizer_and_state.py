"""The chunked AdamW beyond fp32: loss scaling, schedules, and resuming from state_dict."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import (
    build,
    make_batches,
    max_relative_difference,
    reference_run,
    whole_model_relative_difference,
)

from engine import Engine, EngineConfig
from engine.chunks.chunk import pack, packing_waste, search_chunk_size

MODEL = build("opt", layers=4, hidden=64)


def engine(**kw) -> Engine:
    kw.setdefault("device_budget", "64MiB")
    kw.setdefault("policy", "cpu")
    return Engine(copy.deepcopy(MODEL), EngineConfig(**kw))


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
    eng = engine(precision="fp16", initial_loss_scale=2.0**40)  # overflows fp16 for sure
    before = eng.model_state_dict()
    stats = eng.step(make_batches(1)[0])
    assert stats.skipped and stats.loss_scale == 2.0**39
    after = eng.model_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was updated
    for _ in range(30):
        stats = eng.step(make_batches(1)[0])
        if not stats.skipped:
            break
    assert not stats.skipped and stats.loss_scale < 2.0**39


def test_fp16_with_a_sane_scale_trains():
    eng = engine(precision="fp16")
    batch = make_batches(1)[0]
    losses = [eng.step(batch).loss for _ in range(8)]
    assert losses[-1] < losses[0]


def test_state_dict_resumes_exactly():
    batches = make_batches(6)
    straight = engine(policy="auto")
    losses = [straight.step(b).loss for b in batches]

    first = engine(policy="auto")
    for b in batches[:3]:
        first.step(b)
    state = first.state_dict()
    resumed = engine(policy="cpu", margin_ratio=0.5)  # placement may differ on resume
    resumed.load_state_dict(state)
    later = [resumed.step(b) for b in batches[3:]]
    assert [s.step for s in later] == [4, 5, 6]
    assert [s.loss for s in later] == losses[3:]
    assert max_relative_difference(resumed.model_state_dict(), straight.model_state_dict()) == 0


def test_load_state_dict_names_what_is_missing():
    eng = engine()
    state = eng.state_dict()
    del state["tensors"]["exp_avg/model.decoder.embed_tokens.weight"]
    with pytest.raises(ValueError, match="exp_avg/"):
        engine().load_state_dict(state)


def test_learning_rate_schedule_warms_up_then_decays():
    eng = engine(lr=1e-3, lr_schedule="cosine", warmup_steps=2, total_steps=6)
    lrs = [eng.step(b).lr for b in make_batches(6)]
    assert lrs[0] == pytest.approx(5e-4) and lrs[1] == pytest.approx(1e-3)
    assert lrs[2] > lrs[3] > lrs[4] > lrs[5] == pytest.approx(0.0, abs=1e-12)


def test_packing_puts_an_oversized_parameter_in_its_own_chunk():
    chunks = pack([10, 10, 1000, 10], chunk_size=64)
    assert chunks == [[0, 1], [2], [3]]


def test_searched_chunk_size_wastes_little_on_a_real_model():
    sizes = [p.numel() for p in build("opt", layers=8, hidden=128).parameters()]
    size = search_chunk_size(sizes)
    assert packing_waste(sizes, size) <= 0.05 * sum(sizes)
    assert size < sum(sizes) // 4  # small enough to offload piecewise


def test_model_state_dict_loads_into_a_fresh_model():
    eng = engine()
    eng.step(make_batches(1)[0])
    fresh = build("opt", layers=4, hidden=64, seed=5)
    fresh.load_state_dict(eng.model_state_dict())
    got = dict(fresh.named_parameters())
    want = eng.model_state_dict()
    assert all(torch.equal(got[k].detach(), want[k]) for k in got)


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_gradient_buffers_hold_no_stale_bytes_where_no_gradient_was_written(policy):
    """Gradient buffers start unset: padding, and a parameter that gets no gradient (here a
    layer the forward never calls), must read as zero, or clipping's norm would see them."""
    model = copy.deepcopy(MODEL)
    model.unused = torch.nn.Linear(64, 64)
    batches = make_batches(3)
    ref_losses, ref_weights = reference_run(model, batches, max_grad_norm=0.5)
    eng = Engine(copy.deepcopy(model), EngineConfig(policy=policy, device_budget="64MiB",
                                                    max_grad_norm=0.5))
    empty, host_empty = eng.device.empty, eng.device.host_empty

    def poisoned(allocate):
        return lambda numel, dtype: allocate(numel, dtype).fill_(float("nan"))

    # What a reused allocation may hold: on the device, and on the host, where fp32
    # gradients land in buffers made as they land (the simulated device keeps autograd's
    # gradients and sends them home one by one, rules.keeps_grad).
    eng.device.empty, eng.device.host_empty = poisoned(empty), poisoned(host_empty)
    losses = [eng.step(b).loss for b in batches]
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    weights = eng.model_state_dict()
    assert whole_model_relative_difference(weights, ref_weights) < 1e-5
    assert torch.equal(weights["unused.weight"], ref_weights["unused.weight"])
    (unused,) = [c for c in eng.chunks if any(s.name == "unused.weight" for s in c.slots)]
    assert any(s.param.requires_grad and not s.name.startswith("unused.")
               for s in unused.slots), "the unused layer shares its chunk with used ones"


class SharedBlock(torch.nn.Module):
    """A small LM whose one block runs twice, each time in its own reentrant checkpoint:
    autograd completes the block's gradients twice in one backward, the second time after
    the block's chunk may have sent its gradients home."""

    def __init__(self, vocab: int = 256, hidden: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.block = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.Tanh())
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, input_ids, labels=None):
        from types import SimpleNamespace

        from torch.utils.checkpoint import checkpoint

        h = self.embed(input_ids)
        for _ in range(2):
            h = checkpoint(self.block, h, use_reentrant=True)
        logits = self.head(h)
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return SimpleNamespace(loss=loss, logits=logits)


@pytest.mark.parametrize("policy,margin", [("cpu", 0.0), ("auto", 0.0), ("auto", 1.0),
                                           ("cuda", 0.0)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_parameter_whose_gradient_completes_twice_adds_up(policy, margin, precision):
    torch.manual_seed(0)
    model = SharedBlock()
    batches = make_batches(3)
    ref_losses, ref_weights = reference_run(model, batches)
    # A small chunk size, so that the block's chunk finishes before its second gradient.
    eng = Engine(copy.deepcopy(model), EngineConfig(
        policy=policy, margin_ratio=margin, precision=precision, device_budget="64MiB",
        chunk_size=32 * 32 + 32))
    losses = [eng.step(b).loss for b in batches]
    if precision == "fp32":
        assert losses == pytest.approx(ref_losses, rel=1e-5)
        assert whole_model_relative_difference(eng.model_state_dict(), ref_weights) < 1e-5
    else:  # the same training, rounded to bf16 on the way: close, not equal
        assert losses == pytest.approx(ref_losses, rel=2e-2)
        assert whole_model_relative_difference(eng.model_state_dict(), ref_weights) < 2e-2


class FrozenMiddle(torch.nn.Module):
    """embed -> frozen -> trainable -> head. Were `frozen` and `trainable` packed in one
    chunk, that chunk's gradients would all be in (and, in bf16, gone home into its payload)
    before the frozen layer's backward, which still needs its weights. Frozen parameters
    are packed apart (payload-only chunks), so the frozen layer keeps its own chunk."""

    def __init__(self, vocab: int = 256, hidden: int = 32) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.frozen = torch.nn.Linear(hidden, hidden)
        self.trainable = torch.nn.Linear(hidden, hidden)
        self.head = torch.nn.Linear(hidden, vocab)
        self.frozen.requires_grad_(False)

    def forward(self, input_ids, labels=None):
        from types import SimpleNamespace

        logits = self.head(self.trainable(torch.tanh(self.frozen(self.embed(input_ids)))))
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return SimpleNamespace(loss=loss, logits=logits)


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_a_frozen_layer_after_its_chunks_gradients_went_home_gets_its_weights(policy):
    torch.manual_seed(0)
    model = FrozenMiddle()
    batches = make_batches(3)
    runs = {}
    # 8448: [embed] [frozen] [trainable] [head]: the frozen layer is packed apart even
    # where one chunk would hold both; 1056: every layer in a chunk of its own.
    for chunk_size in (8448, 1056):
        eng = Engine(copy.deepcopy(model), EngineConfig(
            policy=policy, precision="bf16", device_budget="64MiB", chunk_size=chunk_size))
        runs[chunk_size] = ([eng.step(b).loss for b in batches], eng.model_state_dict())
    assert [len(c.slots) for c in Engine(copy.deepcopy(model), EngineConfig(
        precision="bf16", device_budget="64MiB", chunk_size=8448)).chunks] == [1, 2, 2, 2]
    (shared_losses, shared), (alone_losses, alone) = runs[8448], runs[1056]
    assert shared_losses == alone_losses
    assert all(torch.equal(shared[k], alone[k]) for k in alone)
