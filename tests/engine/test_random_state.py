"""The engine draws no random number of the run's: a script that seeds, builds an engine
and trains a model with dropout on gets the losses and weights of plain PyTorch seeded the
same way, under any placement, with the disk tier's probe at build time and evaluations
between steps. And training sets what it needs of a model (no generation cache) itself."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from conftest import VOCAB, make_batches, max_relative_difference, reference_run
from transformers import GPT2Config, GPT2LMHeadModel, OPTConfig, OPTForCausalLM

from engine import Engine, EngineConfig

SEED = 7
BATCHES = make_batches(3)


def dropout_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        ffn_dim=128, max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.1,
        attention_dropout=0.0))


MODEL = dropout_model()


def plain_pytorch() -> tuple[list[float], dict]:
    torch.manual_seed(SEED)
    return reference_run(MODEL, BATCHES)


REF_LOSSES, REF_WEIGHTS = plain_pytorch()


def engine_run(*, evaluate: bool = False, **config) -> tuple[list[float], dict]:
    torch.manual_seed(SEED)  # before the engine is built, as a script would
    eng = Engine(copy.deepcopy(MODEL), EngineConfig(precision="fp32", lr=1e-3, **config))
    losses = []
    for batch in BATCHES:
        losses.append(eng.step(batch).loss)
        if evaluate:
            eng.evaluate(batch)
    weights = eng.model_state_dict()
    eng.close()
    return losses, weights


def test_dropout_draws_masks_at_all() -> None:
    torch.manual_seed(SEED + 1)
    other, _ = reference_run(MODEL, BATCHES)
    assert other != REF_LOSSES  # else this file could not tell masks apart


@pytest.mark.parametrize(("policy", "margin"), [("cuda", 0.0), ("cpu", 0.0), ("auto", 0.0),
                                                ("auto", 1.0)])
def test_seeded_before_the_engine_the_losses_are_plain_pytorchs(policy: str,
                                                                margin: float) -> None:
    losses, weights = engine_run(policy=policy, margin_ratio=margin, device_budget="64MiB",
                                 evaluate=True)
    assert losses == pytest.approx(REF_LOSSES, rel=1e-5)
    assert max_relative_difference(weights, REF_WEIGHTS) <= 1e-5


def test_the_disk_tier_and_its_probe_draw_nothing(tmp_path: Path) -> None:
    losses, weights = engine_run(policy="cpu", device_budget="64MiB", host_budget=2**20,
                                 disk_dir=tmp_path)
    assert losses == pytest.approx(REF_LOSSES, rel=1e-5)
    assert max_relative_difference(weights, REF_WEIGHTS) <= 1e-5


def test_building_leaves_each_modules_mode_and_the_random_state_as_they_were() -> None:
    model = copy.deepcopy(MODEL)
    model.model.decoder.layers[1].eval()  # a user's choice the engine must keep
    modes = [m.training for m in model.modules()]
    torch.manual_seed(SEED)
    state = torch.random.get_rng_state()
    eng = Engine(model, EngineConfig(policy="cpu", device_budget="64MiB"))
    assert torch.equal(torch.random.get_rng_state(), state)
    assert [m.training for m in model.modules()] == modes
    eng.evaluate(BATCHES[0])
    assert torch.equal(torch.random.get_rng_state(), state)
    assert [m.training for m in model.modules()] == modes
    eng.close()


def test_a_model_handed_over_trains_without_its_generation_cache() -> None:
    def gpt2(use_cache: bool) -> torch.nn.Module:
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4,
                                          n_positions=64, bos_token_id=0, eos_token_id=0,
                                          use_cache=use_cache))

    peaks = []
    for use_cache in (True, False):  # GPT-2's default; as the planner records it
        model = gpt2(use_cache)
        eng = Engine(model, EngineConfig(policy="cpu", device_budget="64MiB"))
        peaks.append(eng.step(BATCHES[0]).memory.device_peak)
        assert model.config.use_cache is False
        eng.close()
    assert peaks[0] == peaks[1]
