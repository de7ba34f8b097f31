"""Small real models and a plain-PyTorch reference run for the engine's tests, and which
device those tests run on."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    OPTConfig,
    OPTForCausalLM,
)

VOCAB = 256

# These models are tiny: one thread is faster than two fighting over a shared machine.
torch.set_num_threads(1)


def build(arch: str = "opt", *, seed: int = 0, layers: int = 4, hidden: int = 64
          ) -> torch.nn.Module:
    """A few-hundred-thousand-parameter model of a real architecture, dropout off so that a
    reference run and an engine run see the same arithmetic."""
    torch.manual_seed(seed)
    if arch == "opt":
        cfg = OPTConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=4, ffn_dim=4 * hidden, max_position_embeddings=128,
                        word_embed_proj_dim=hidden, dropout=0.0, attention_dropout=0.0)
        return OPTForCausalLM(cfg)
    if arch == "gpt2":
        cfg = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=layers, n_head=4, n_positions=128,
                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                         bos_token_id=0, eos_token_id=0)
        return GPT2LMHeadModel(cfg)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=128, bos_token_id=0, eos_token_id=0)
        return LlamaForCausalLM(cfg)
    raise ValueError(arch)


def make_batches(n: int, *, seq_len: int = 16, batch_size: int = 2, seed: int = 1
                 ) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (batch_size, seq_len), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def reference_run(model: torch.nn.Module, batches: list[dict], *, lr: float = 1e-3,
                  max_grad_norm: float | None = None, checkpointing: bool = False
                  ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Plain PyTorch: fused AdamW (the DESIGN's reference) over a copy of `model`."""
    model = copy.deepcopy(model)
    if checkpointing:
        model.gradient_checkpointing_enable()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    losses = []
    for batch in batches:
        loss = model(**batch).loss
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
    diff = sum(float((a[k].float() - b[k].float()).pow(2).sum()) for k in b)
    norm = sum(float(b[k].float().pow(2).sum()) for k in b)
    return (diff / norm) ** 0.5


@pytest.fixture
def tiny_opt() -> Callable[..., torch.nn.Module]:
    return lambda **kw: build("opt", **kw)
