"""A tied weight's gradients go into its chunk's gradient buffer use by use.

The head and the embedding share one weight (vocabulary x hidden). Its gradient from the
head is made at the first module of backward, the embedding's at the last: kept apart until
then, the head's would be alive through the whole backward, beside the buffer it ends in.
Each use's goes into the buffer as soon as it is made, the math unchanged, and the planner
records and replays it so.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from engine.placement import rules
from engine.planning.planner import plan
from tests.engine.references import (
    engine_run,
    make_batches,
    max_relative_difference,
    reference_run,
)

VOCAB, HIDDEN = 4096, 32
HEAD_GRADIENT = VOCAB * HIDDEN * 4  # fp32 bytes of the tied weight's gradient
EXACT = 1e-5


def tied_model() -> OPTForCausalLM:
    torch.manual_seed(0)
    config = OPTConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, ffn_dim=64,
                       num_attention_heads=4, word_embed_proj_dim=HIDDEN,
                       max_position_embeddings=64, dropout=0.0)
    model = OPTForCausalLM(config)
    assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
    return model


@pytest.mark.parametrize("policy", ["cpu", "auto", "cuda"])
def test_the_head_gradient_is_not_kept_through_backward(policy):
    model = tied_model()
    batches = make_batches(3, vocab=VOCAB, seq_len=16)
    eng, losses = engine_run(model, batches, policy=policy, device_budget="64MiB")
    try:
        points = eng.trace.points
        backward = [p for p in points if p.phase == "backward"]
        # Between the head (first in backward) and the embedding (last), the layers' own
        # non-model bytes are far below one copy of the tied gradient.
        assert all(p.non_model_peak < HEAD_GRADIENT for p in backward[1:-1])
        ref_losses, ref_weights = reference_run(model, batches)
        assert losses == pytest.approx(ref_losses, rel=EXACT)
        assert max_relative_difference(eng.model_state_dict(), ref_weights) < EXACT
    finally:
        eng.close()


def test_the_plan_forecasts_the_tied_step_as_the_engine_measures_it(tmp_path):
    model = tied_model()
    model.config.save_pretrained(tmp_path)
    batch = make_batches(1, vocab=VOCAB, seq_len=16)
    eng, _ = engine_run(copy.deepcopy(model), batch * 2, policy="cpu", device_budget="64MiB")
    try:
        forecast = plan(str(tmp_path), device_mem="64MiB", host_mem="64GiB", precision="fp32",
                        batch_size=2, seq_len=16, simulated=True)
        assert forecast.working_set == pytest.approx(eng.trace.working_set, rel=EXACT)
        assert forecast.non_model_peak == pytest.approx(eng.trace.non_model_peak, rel=EXACT)
        # The tied weight's buffer is the only one open through backward: at most the
        # head's gradient, its buffer and the chunk, beside the activations.
        assert forecast.working_set < 3 * HEAD_GRADIENT + forecast.non_model_peak
    finally:
        eng.close()


def test_the_working_set_is_the_peak_the_step_reaches_and_a_budget_of_it_runs():
    """The room kept for activations after a gradient has arrived is the peak still to
    come, not the interval's whole: the minimum working set is then what the step really
    reaches at once (the head's gradient, its buffer and the chunk come after the logits'
    gradients are gone), and a budget of exactly that runs, reaching it. (With room to
    spare a step may reach more: the next module's chunks come in ahead of use.)"""
    model = tied_model()
    batches = make_batches(3, vocab=VOCAB, seq_len=16)
    probe, _ = engine_run(model, batches[:2], policy="cpu", device_budget="64MiB")
    try:
        least = probe.min_working_set()
        roomy = probe.step(batches[2]).memory.device_peak
    finally:
        probe.close()
    assert least <= roomy
    eng, losses = engine_run(model, batches[:2], policy="cpu", device_budget=least)
    try:
        stats = eng.step(batches[2])
        losses.append(stats.loss)
        assert stats.memory.device_peak == least
        ref_losses, _ = reference_run(model, batches)
        assert losses == pytest.approx(ref_losses, rel=EXACT)
    finally:
        eng.close()


@pytest.mark.parametrize("as_on_a_gpu", [False, True], ids=["simulated", "as-on-a-gpu"])
def test_a_chunk_of_the_tied_weight_alone_keeps_autograds_gradient_and_the_plan_knows(
        tmp_path, monkeypatch, as_on_a_gpu):
    """The tied weight fills a chunk by itself: its gradient is the chunk's whole, so the
    chunk keeps autograd's tensor until it goes home instead of copying it into a buffer
    of the same size (rules.keeps_grad), on any device. On the simulated device, where a
    buffer is only a second copy, every chunk does so and none takes a gradient buffer;
    on a GPU (the rule asked as a GPU's, by the engine and the plan alike) the others
    gather theirs in a buffer. Either way the plan forecasts the peak to the byte."""
    if as_on_a_gpu:
        keeps = rules.keeps_grad
        monkeypatch.setattr(rules, "keeps_grad",
                            lambda params, **kw: keeps(params, **{**kw, "simulated": False}))
    model = tied_model()
    model.config.save_pretrained(tmp_path)
    batches = make_batches(3, vocab=VOCAB, seq_len=16)
    eng, losses = engine_run(model, batches[:2], policy="cpu", device_budget="64MiB")
    try:
        (head,) = [c for c in eng.chunks
                   if any(s.name.endswith("embed_tokens.weight") for s in c.slots)]
        assert len(head.slots) == 1 and eng.manager.keeps_grad(head)
        buffers, grad_buffer = [], eng.manager.grad_buffer
        eng.manager.grad_buffer = lambda chunk, pos: (buffers.append(chunk.index),
                                                      grad_buffer(chunk, pos))[1]
        kept, keep = [], eng.manager.keep_slot_grad
        eng.manager.keep_slot_grad = lambda chunk, *rest: (kept.append(chunk.index),
                                                           keep(chunk, *rest))[1]
        stats = eng.step(batches[2])
        losses.append(stats.loss)
        if as_on_a_gpu:
            assert buffers and head.index not in buffers and set(kept) == {head.index}
        else:
            assert not buffers
            assert set(kept) == {c.index for c in eng.chunks} and len(kept) > len(eng.chunks)
        assert not any(c.slot_grads for c in eng.chunks)  # gone home with the rest
        forecast = plan(str(tmp_path), device_mem="64MiB", host_mem="64GiB", precision="fp32",
                        batch_size=2, seq_len=16, simulated=True)
        assert forecast.policies["cpu"].device_peak == stats.memory.device_peak
        ref_losses, ref_weights = reference_run(model, batches)
        assert losses == pytest.approx(ref_losses, rel=EXACT)
        assert max_relative_difference(eng.model_state_dict(), ref_weights) < EXACT
    finally:
        eng.close()
