"""A budget below the minimum working set is refused with the parts that make it up."""

from __future__ import annotations

import re

import pytest
from transformers import LlamaConfig

from engine.config import format_size, parse_size
from engine.planning.planner import plan


def test_a_budget_below_the_working_set_is_refused_with_its_parts(tmp_path):
    LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=True, bos_token_id=0, eos_token_id=0,
                ).save_pretrained(tmp_path)
    forecast = plan(str(tmp_path), device_mem="64KiB", host_mem="64GiB", precision="fp32",
                    batch_size=2, seq_len=32, simulated=True)
    reason = forecast.cpu.reason
    parts = re.search(r"minimum working set (.+) \(chunks in use and their gradient buffers "
                      r"(.+) \+ activations (.+) in (forward|backward)\)", reason)
    assert parts, reason
    assert parts[1] == format_size(forecast.working_set)
    chunks, activations = parse_size(parts[2]), parse_size(parts[3])
    # Sizes as shown, to a tenth of their unit.
    assert chunks > 0 and 0 < activations <= forecast.non_model_peak * 1.02
    assert chunks + activations == pytest.approx(forecast.working_set, rel=0.02)
