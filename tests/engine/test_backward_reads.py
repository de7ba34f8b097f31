"""A module whose backward reads none of its parameters is not fetched for its backward.

An embedding saves only its token ids for backward; a linear layer saves its weight. A
traced step watches what each forward saves (engine.step.backward_reads): the embedding's
backward point fetches nothing, so under cpu its chunk is copied in once less per step and
is not on the device while the last gradients arrive, and the planner forecasts the same.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from engine.planning.recording import record_step
from engine.step.backward_reads import BackwardReads
from tests.engine.references import engine_run, make_batches, reference_run
from tests.engine.test_tied_gradients import EXACT, VOCAB, tied_model

EMBEDDINGS = ("model.decoder.embed_tokens", "model.decoder.embed_positions")


def judged(model: torch.nn.Module, *inputs: torch.Tensor) -> dict[str, bool]:
    """Whether the backward of each module of `model` that holds parameters reads them,
    after one watched forward, each module watched over its own parameters as the engine's
    hooks watch it (nested modules inside their parent)."""
    reads, names, handles = BackwardReads(), {}, []
    for key, (name, module) in enumerate(model.named_modules()):
        if next(module.parameters(recurse=False), None) is None:
            continue
        names[key] = name
        handles += [module.register_forward_pre_hook(lambda m, a, key=key: reads.enter(key)),
                    module.register_forward_hook(lambda m, a, out, key=key: reads.leave(
                        key, m.parameters(recurse=False)))]
    with reads.watching():
        model(*inputs).sum()
    for h in handles:
        h.remove()
    return {name: reads.reads(key) for key, name in names.items()}


def test_an_embedding_saves_no_weight_for_backward_and_a_linear_layer_does():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 4))
    assert judged(model, torch.tensor([[1, 2, 3]])) == {"0": False, "1": True}


class _Half(torch.nn.Module):
    """Multiplies its input by `self.weight`, which views half of a flat buffer shared
    with another module's parameter, as parameters view their chunk in the engine."""

    def __init__(self, flat: torch.Tensor, lo: int, saves_weight: bool) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4))
        self.weight.data = flat[lo:lo + 4]
        self.saves_weight = saves_weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * w saves both factors; (x + w) ** 2 saves the sum, not the weight.
        return x * self.weight if self.saves_weight else (x + self.weight) ** 2


class _Pair(torch.nn.Module):
    def __init__(self, flat: torch.Tensor) -> None:
        super().__init__()
        self.first, self.second = _Half(flat, 0, True), _Half(flat, 4, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x))


def test_a_parameter_is_told_from_its_neighbours_in_the_same_storage():
    model = _Pair(torch.randn(8))
    assert judged(model, torch.randn(4, requires_grad=True)) == {"first": True,
                                                                  "second": False}


class _Whole(torch.nn.Module):
    """Owns the second half of a flat buffer and computes with all of it: what it saves
    begins before its parameter and covers it."""

    def __init__(self, flat: torch.Tensor) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4))
        self.weight.data = flat[4:]
        self.flat = flat

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.flat


def test_a_saved_tensor_that_covers_a_parameter_from_before_it_is_read():
    assert judged(_Whole(torch.randn(8)), torch.randn(8, requires_grad=True)) == {"": True}


class _Transposed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t()


def test_a_weight_saved_through_a_view_is_read():
    assert judged(_Transposed(), torch.randn(2, 3, requires_grad=True)) == {"": True}


class _Checkpointed(torch.nn.Module):
    """Runs `inner` under activation checkpointing (non-reentrant, as the engine's users
    enable it), and its own weight through a checkpointed function."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = checkpoint(self.inner, x, use_reentrant=False)
        return checkpoint(torch.mul, y, self.scale, use_reentrant=False)


@pytest.mark.parametrize("inner", ["linear", "embedding"])
def test_under_activation_checkpointing_every_backward_is_fetched_as_before(inner):
    """Checkpointing saves what runs inside through hooks of its own, which nothing here
    sees, and saves a checkpointed function's inputs, a weight among them, where the watch
    sees them: nothing says a backward reads no weight."""
    if inner == "linear":
        model, x = _Checkpointed(torch.nn.Linear(4, 4)), torch.randn(2, 4, requires_grad=True)
    else:
        model, x = _Checkpointed(torch.nn.Embedding(10, 4)), torch.tensor([1, 2])
    assert judged(model, x) == {"": True, "inner": True}


@pytest.mark.parametrize("policy", ["cpu", "auto"])
def test_an_embeddings_backward_fetches_nothing_and_trains_the_same(policy):
    model = tied_model()
    batches = make_batches(3, vocab=VOCAB, seq_len=16)
    eng, losses = engine_run(model, batches[:2], policy=policy, device_budget="64MiB")
    try:
        chunk_of = {s.name: c.index for c in eng.chunks for s in c.slots}
        stats = eng.step(batches[2])
        losses.append(stats.loss)
        steps = [p for p in stats.timeline if p.phase == "backward"]
        trace = [p for p in eng.trace.points if p.phase == "backward"]
        for point, traced in zip(steps, trace, strict=True):
            if point.module in EMBEDDINGS:
                assert point.bytes_h2d == 0
                assert traced.chunks == ()
                assert traced.grad_chunks == (chunk_of[f"{point.module}.weight"],)
            else:
                assert traced.chunks and traced.grad_chunks == traced.chunks
        if policy == "cpu":  # the layers' chunks come in again for their backward
            assert sum(p.bytes_h2d for p in steps) > 0
        ref_losses, _ = reference_run(model, batches)
        assert losses == pytest.approx(ref_losses, rel=EXACT)
    finally:
        eng.close()


def test_the_planners_recording_fetches_what_the_engine_fetches():
    events = record_step(tied_model().config, torch.float32, 2, 16, False, trace_layers=3)
    backward = {e[1]: e[3] for e in events if e[0] == "point" and e[2] == "backward"}
    assert {name for name, fetch in backward.items() if not fetch} == set(EMBEDDINGS)
    assert backward["lm_head"] and backward["model.decoder.layers.0.fc1"]
