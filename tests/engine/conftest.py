"""Small real models and a plain-PyTorch reference run for the engine's tests, and which
device those tests run on."""

from __future__ import annotations

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

from tests.engine.references import (  # noqa: F401 - the tests import them from here too
    VOCAB,
    engine_run,
    make_batches,
    max_relative_difference,
    reference_run,
    whole_model_relative_difference,
)

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


@pytest.fixture
def tiny_opt() -> Callable[..., torch.nn.Module]:
    return lambda **kw: build("opt", **kw)


def sample_host_peak(eng) -> list[int]:
    """From now on, the most chunk bytes and disk I/O buffers `eng`'s host holds at any
    allocation or free, in the one-item list returned (read it after the steps)."""
    peak = [0]
    inner = eng.manager.on_change

    def sample() -> None:
        peak[0] = max(peak[0], eng.manager.host_bytes + eng.manager.io_buffer_bytes)
        inner()

    eng.manager.on_change = sample
    return peak
