"""The planner knows LoRA: frozen base weights in payload-only chunks, gradients and
optimizer state for the adapters alone. Its device peak, host bytes, bytes copied and the
disk tier's bytes are what the engine measures on the same LoRA model, as for a full run."""

from __future__ import annotations

import pytest
import torch

from engine.models.lora import Lora, apply_lora
from engine.models.zoo import build_model
from engine.planning.planner import plan
from tests.engine.test_planner import EXACT, SHAPE, TINY_PIECE, disk_steps, engine_steps

MiB = 2**20


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> int:
    """Pieces of disk I/O small enough that the tiny model's chunks go in several."""
    from engine.placement import disk_rules

    monkeypatch.setattr(disk_rules, "DISK_PIECE", TINY_PIECE)
    return TINY_PIECE
LORA = Lora(rank=4)


def lora_tiny():
    return apply_lora(build_model("tiny"), LORA)


@pytest.mark.parametrize(
    ("precision", "policy", "budget", "margin"),
    [
        ("fp32", "cuda", "6GiB", 0.0),
        ("fp32", "cpu", "6GiB", 0.0),
        ("bf16", "auto", "6GiB", 0.0),
        ("fp32", "auto", 20 * MiB, 0.5),  # evictions, and the margin keeps some resident
    ],
)
def test_a_lora_step_is_forecast_as_the_engine_measures_it(precision, policy, budget, margin):
    forecast = plan("tiny", device_mem=budget, host_mem="64GiB", precision=precision,
                    simulated=True, margin_ratio=margin, lora=LORA, **SHAPE)
    stats, engine = engine_steps(lora_tiny(), policy=policy, precision=precision,
                                 budget=budget, margin=margin)
    row = forecast.policies[policy]
    assert row.fits, row.reason
    assert row.device_peak == pytest.approx(stats.memory.device_peak, rel=EXACT)
    assert row.host_model == stats.memory.host_model  # same layout, same tensors: exact
    assert row.copied == stats.bytes_h2d + stats.bytes_d2h
    assert forecast.chunks == len(engine.chunks)
    assert forecast.working_set == pytest.approx(engine.trace.working_set, rel=EXACT)


def test_lora_needs_far_less_than_training_every_weight():
    full = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision="fp32", simulated=True,
                **SHAPE)
    lora = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision="fp32", simulated=True,
                lora=LORA, **SHAPE)
    # Frozen weights: 4 of full training's 16 B/param on the host, 12 between steps (its
    # gradients' landing place exists from their landing to the update).
    assert lora.model_bytes < 0.3 * full.model_bytes
    assert lora.cpu.host_model < 0.4 * full.cpu.host_model


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_disk_tier_of_a_lora_run_is_forecast_byte_for_byte(small_pieces, tmp_path,
                                                                precision):
    host_budget = int(0.5 * plan("tiny", device_mem="6GiB", host_mem="64GiB",
                                 precision=precision, simulated=True, lora=LORA,
                                 **SHAPE).model_bytes)
    forecast = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision=precision,
                    simulated=True, host_budget=host_budget, disk_dir=tmp_path, lora=LORA,
                    **SHAPE)
    stats, engine, (read, written) = disk_steps(
        lora_tiny(), policy="cpu", precision=precision, budget="6GiB",
        host_budget=host_budget, disk_dir=tmp_path)
    assert any(c.frozen and c.payload_on_disk for c in engine.chunks)
    row, memory = forecast.cpu, stats.memory
    assert row.fits, row.reason
    assert row.disk_bytes == memory.disk_model
    assert row.host_model == memory.host_model
    assert row.io_buffers == memory.host_io_buffers
    assert (row.disk_read, row.disk_written) == (read, written)
    assert row.copied == stats.bytes_h2d + stats.bytes_d2h
    assert forecast.disk_needed == engine.manager.disk_placement(set()).disk_bytes > 0
    engine.close()


def test_frozen_chunks_leave_the_device_after_their_module_s_backward(tmp_path, monkeypatch):
    """No gradient moves a frozen weight on in backward: its module's backward does. Under
    `cpu` a LoRA step then holds about one module's chunks beside the activations, not the
    whole base model, and the planner forecasts the same peak."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import tests.engine.test_planner as planner_tests

    # Weights well above the activations, over six layers (the planner traces three and
    # repeats the inner one), no tied head: no single chunk is most of the model.
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=256,
                         num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, tie_word_embeddings=False,
                         architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp_path)
    shape = {"batch_size": 1, "seq_len": 8}
    monkeypatch.setattr(planner_tests, "SHAPE", shape)
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_config(config), LORA)
    stats, engine = engine_steps(model, policy="cpu", precision="fp32", budget="6GiB")
    forecast = plan(str(tmp_path), device_mem="6GiB", host_mem="64GiB", precision="fp32",
                    simulated=True, lora=LORA, **shape)

    frozen = sum(c.nbytes for c in engine.chunks if c.frozen)
    activations = max(p.non_model_peak for p in engine.trace.points)
    one_module = 2 * max(c.nbytes for c in engine.chunks)
    assert frozen > 4 * one_module  # so holding them all could not pass below
    assert stats.memory.device_peak <= activations + one_module
    assert forecast.cpu.device_peak == pytest.approx(stats.memory.device_peak, rel=EXACT)
    assert forecast.working_set == pytest.approx(engine.trace.working_set, rel=EXACT)
