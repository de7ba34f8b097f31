"""Exact AdamW in the corners fine-tuning reaches: a parameter that misses steps keeps its
own step count, a layer unfrozen mid-run trains from then on, and a parameter that a
module's forward reads from a child module is fetched like any other. Each compared with
plain `torch.optim.AdamW(fused=True)` on the same model and batches, under every policy."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from engine import Engine, EngineConfig
from tests.engine.conftest import build, make_batches, max_relative_difference

VOCAB = 256
PLACEMENTS = [("cuda", 0.0), ("cpu", 0.0), ("auto", 0.0), ("auto", 1.0)]


@dataclass
class Output:
    loss: torch.Tensor


def lm_output(logits: torch.Tensor, labels: torch.Tensor | None) -> Output:
    if labels is None:
        return Output(None)
    return Output(nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)))


class Branchy(nn.Module):
    """An embedding, a body, and a side layer that runs only when `use_side` is set (a
    conditional branch, as in mixture-of-experts or a task head)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 32)
        self.body = nn.Linear(32, 32)
        self.side = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB)
        self.use_side = False

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        x = torch.tanh(self.body(self.embed(input_ids)))
        if self.use_side:
            x = x + self.side(x)
        return lm_output(self.head(x), labels)


class EncoderLM(nn.Module):
    """torch's own TransformerEncoderLayer: its forward reads `self_attn.out_proj.weight`
    directly, so out_proj's parameters are used without out_proj's forward running."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 32)
        self.layer = nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0,
                                                batch_first=True)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Output:
        return lm_output(self.head(self.layer(self.embed(input_ids))), labels)


class EncoderStackNeedsLabels(nn.Module):
    """Two TransformerEncoderLayers (each reading its `out_proj` from its parent's forward)
    in a model whose forward cannot run without its labels, as many task models are: no
    forward before the first real step can find who reads whose parameters."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 32)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
            for _ in range(2))
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Output:
        x = self.embed(input_ids)
        for layer in self.layers:
            x = layer(x)
        return Output(nn.functional.cross_entropy(self.head(x).reshape(-1, VOCAB),
                                                  labels.reshape(-1)))


def run_both(model: nn.Module, batches: list[dict], before_step: Callable[[nn.Module, int], None],
             *, policy: str, margin: float, budget: str = "64MiB", chunk_size: int | None = None
             ) -> tuple[list[float], list[float], dict, dict]:
    """The engine and plain fused AdamW, with `before_step(model, i)` applied to each."""
    ref_losses = []
    # The optimizer is built over every parameter, like the engine, so a parameter
    # unfrozen later is one torch already knows (with no state until its first gradient).
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, fused=True)
    for i, batch in enumerate(batches):
        before_step(reference, i)
        loss = reference(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        ref_losses.append(loss.item())

    ours = copy.deepcopy(model)
    eng = Engine(ours, EngineConfig(policy=policy, margin_ratio=margin, device_budget=budget,
                                    lr=1e-3, simulate=True, chunk_size=chunk_size))
    losses = []
    for i, batch in enumerate(batches):
        before_step(ours, i)
        losses.append(eng.step(batch).loss)
    leftover = [n for n, p in ours.named_parameters() if p.grad is not None]
    assert leftover == [], f"gradients left on parameters: {leftover}"
    return losses, ref_losses, eng.model_state_dict(), reference.state_dict()


@pytest.mark.parametrize(("policy", "margin"), PLACEMENTS)
def test_a_layer_skipped_at_first_keeps_its_own_step_count(policy, margin):
    def side_from_step_2(model: Branchy, i: int) -> None:
        model.use_side = i >= 1

    losses, ref_losses, ours, ref = run_both(Branchy(), make_batches(5), side_from_step_2,
                                             policy=policy, margin=margin)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_relative_difference(ours, ref) <= 1e-5


@pytest.mark.parametrize(("policy", "margin"), PLACEMENTS)
def test_a_layer_unfrozen_before_step_2_trains_from_then_on(policy, margin):
    model = build("opt", layers=2)
    frozen = model.model.decoder.layers[1]
    frozen.requires_grad_(False)

    def unfreeze_at_step_2(m: nn.Module, i: int) -> None:
        if i == 1:
            m.model.decoder.layers[1].requires_grad_(True)

    losses, ref_losses, ours, ref = run_both(model, make_batches(4), unfreeze_at_step_2,
                                             policy=policy, margin=margin)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_relative_difference(ours, ref) <= 1e-5
    name = "model.decoder.layers.1.fc1.weight"
    assert not torch.equal(ours[name], model.state_dict()[name])  # it did train


@pytest.mark.parametrize(("policy", "margin"), PLACEMENTS)
def test_a_parameter_used_outside_its_own_module_is_fetched(policy, margin):
    losses, ref_losses, ours, ref = run_both(EncoderLM(), make_batches(4), lambda m, i: None,
                                             policy=policy, margin=margin)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_relative_difference(ours, ref) <= 1e-5


# Chunks of 4096 elements put a layer's out_proj in another chunk than its in_proj.
@pytest.mark.parametrize("chunk_size", [None, 4096])
@pytest.mark.parametrize(("policy", "margin"), PLACEMENTS)
def test_a_parameter_used_outside_its_module_by_a_model_that_needs_labels_trains(
        policy, margin, chunk_size):
    losses, ref_losses, ours, ref = run_both(EncoderStackNeedsLabels(), make_batches(4),
                                             lambda m, i: None, policy=policy, margin=margin,
                                             chunk_size=chunk_size)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    assert max_relative_difference(ours, ref) <= 1e-5


def test_checkpoints_keep_each_parameters_step_count():
    model = Branchy()
    eng = Engine(model, EngineConfig(policy="cpu", device_budget="64MiB", simulate=True))
    for i, batch in enumerate(make_batches(3)):
        model.use_side = i >= 1
        eng.step(batch)
    tensors = eng.state_dict()["tensors"]
    assert float(tensors["step/body.weight"]) == 3
    assert float(tensors["step/side.weight"]) == 2
