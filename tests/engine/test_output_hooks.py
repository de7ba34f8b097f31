"""A module's backward point (engine.step.hooks.wrap_outputs) fires once, before the module's
backward reads its weights, also where the caller modifies the output in place after the
module returned it.

Tried and dropped: a tensor hook on each output instead of the identity node (about 4 us a
call less, nothing a step here can measure): with the parent scaling a linear layer's output
in place, the engine's step crashed the process under cpu and auto (the last test below)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.step.hooks import wrap_outputs
from tests.engine.references import (
    engine_run,
    make_batches,
    max_relative_difference,
    reference_run,
)

EXACT = 1e-5


def _watched_linear(events: list[str]) -> tuple[torch.nn.Linear, torch.Tensor]:
    """A linear layer whose weight's gradient says when it comes, and an input whose
    gradient (the layer's backward done) says the same."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 4)
    lin.weight.register_post_accumulate_grad_hook(lambda _p: events.append("weight grad"))
    x = torch.randn(2, 4, requires_grad=True)
    x.register_hook(lambda _g: events.append("input grad"))
    return lin, x


def test_outputs_made_by_different_ops_fire_once_before_the_module_backward():
    events: list[str] = []
    lin, x = _watched_linear(events)
    y = lin(x)
    pair = wrap_outputs((y, y.tanh()), lambda: events.append("point"))
    (pair[0].sum() + pair[1].sum()).backward()
    assert events.count("point") == 1 and events[0] == "point"


def test_an_output_modified_in_place_afterwards_still_fires_first():
    events: list[str] = []
    lin, x = _watched_linear(events)
    out = wrap_outputs(lin(x), lambda: events.append("point"))
    out.mul_(2.0)  # the caller's in-place op, after the module returned
    out.sum().backward()
    assert events[0] == "point" and events.count("point") == 1
    assert torch.allclose(lin.weight.grad, 2.0 * x.detach().sum(0).expand(4, 4))


def test_a_leaf_output_fires_and_a_no_grad_output_is_left_alone():
    events: list[str] = []
    weight = torch.nn.Parameter(torch.ones(3))
    routed = wrap_outputs(weight, lambda: events.append("point"))
    (routed * 2).sum().backward()
    assert events == ["point"] and torch.equal(weight.grad, torch.full((3,), 2.0))
    with torch.no_grad():
        plain = weight * 2
    assert wrap_outputs(plain, lambda: events.append("never")) is plain


class _ScaledInPlace(torch.nn.Module):
    """Embedding, a linear layer whose output the parent scales in place, a head: the
    linear layer's backward point must still come before its backward reads its weight."""

    def __init__(self, vocab: int = 256, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.mid = torch.nn.Linear(width, width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> SimpleNamespace:
        h = self.mid(self.embed(input_ids))
        h.mul_(0.5)
        logits = self.head(torch.relu(h))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return SimpleNamespace(loss=loss)


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_training_through_an_in_place_scaled_output_matches_plain_pytorch(policy):
    model = _ScaledInPlace()
    batches = make_batches(3)
    eng, losses = engine_run(model, batches, policy=policy, device_budget="2MiB")
    try:
        ref_losses, ref_weights = reference_run(model, batches)
        assert losses == pytest.approx(ref_losses, rel=EXACT)
        assert max_relative_difference(eng.model_state_dict(), ref_weights) < EXACT
    finally:
        eng.close()
