"""The plain-PyTorch side of the engine's tests: batches of a byte vocabulary, a reference
run with fused AdamW, and how two runs' weights are compared. A module of its own (not the
conftest) so that the data-parallel harness's spawned ranks import it too."""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch

VOCAB = 256


def make_batches(n: int, *, seq_len: int = 16, batch_size: int = 2, seed: int = 1,
                 vocab: int = VOCAB) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def reference_run(model: torch.nn.Module, batches: list[dict], *, lr: float = 1e-3,
                  max_grad_norm: float | None = None, checkpointing: bool = False,
                  loss_of: Callable[[torch.nn.Module, dict], torch.Tensor] | None = None
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: fused AdamW (the DESIGN's reference) over a copy of `model`; `loss_of`
    for a model whose forward takes more than the batch."""
    model = copy.deepcopy(model)
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    losses = []
    for batch in batches:
        loss = loss_of(model, batch) if loss_of else model(**batch).loss
        loss.backward()
        if max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest per-tensor relative norm difference (the DESIGN's comparison)."""
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).norm() / (b[k].float().norm() + 1e-12))
               for k in b)


def whole_model_relative_difference(a: dict[str, torch.Tensor],
                                    b: dict[str, torch.Tensor]) -> float:
    """Relative norm difference of all weights as one vector.

    For comparisons that are not bit-identical by construction: OPT's attention key bias has
    a true gradient of zero, so AdamW turns float noise there into full-size (but tiny)
    steps, and a per-tensor comparison of it measures noise, not correctness.
    """
    assert a.keys() == b.keys()
    diff = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in b)
    norm = sum(float(b[k].float().pow(2).sum()) for k in b)
    return (diff / norm) ** 0.5


def engine_run(model: torch.nn.Module, batches: list[dict], *, changes=(), **config):
    """The engine's side of a comparison: a copy of `model` trained in fp32 on `batches`,
    the settings changes of `changes[i]` ((kind, value) pairs) made before step i, each
    step's device peak checked against its budget. Returns (engine, losses)."""
    from engine import Engine, EngineConfig

    eng = Engine(copy.deepcopy(model), EngineConfig(precision="fp32", **config))
    losses = []
    for i, batch in enumerate(batches):
        for kind, value in changes[i] if i < len(changes) else ():
            getattr(eng, f"set_{kind}")(value)
        stats = eng.step(batch)
        assert stats.memory.device_peak <= stats.device_budget
        losses.append(stats.loss)
    return eng, losses
