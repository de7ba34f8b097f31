"""An engine can be let go: close() (or leaving a `with` block) removes its hooks and frees
every chunk, and an engine dropped without close() is freed by the garbage collector."""

from __future__ import annotations

import copy
import gc
import weakref

import psutil
import pytest
import torch
from transformers import OPTConfig, OPTForCausalLM

from engine import Engine, EngineConfig
from engine.devices.host_memory import release_free_host_memory
from tests.engine.conftest import build, make_batches

BATCHES = make_batches(2)


def sizeable_model() -> torch.nn.Module:
    """About 5M parameters: 80 MB of fp32 training state per engine, so that eight leaked
    engines would show far above the allocator's noise."""
    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(
        vocab_size=8192, hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
        ffn_dim=1024, max_position_embeddings=128, word_embed_proj_dim=256,
        dropout=0.0, attention_dropout=0.0))


def train_and_drop(close: bool) -> weakref.ref:
    model = sizeable_model()
    eng = Engine(model, EngineConfig(policy="auto", margin_ratio=0.5, device_budget="256MiB",
                                     simulate=True))
    ids = torch.randint(0, 8192, (2, 32))
    for _ in range(2):
        eng.step({"input_ids": ids, "labels": ids})
    gone = weakref.ref(eng)
    if close:
        eng.close()
    del eng, model
    return gone


@pytest.mark.parametrize("close", [True, False], ids=["closed", "dropped"])
def test_eight_engines_built_and_let_go_leave_nothing_behind(close):
    train_and_drop(close)  # the allocator's and torch's one-time growth
    gc.collect()
    before = psutil.Process().memory_info().rss
    refs = [train_and_drop(close) for _ in range(8)]
    gc.collect()
    assert [r() for r in refs] == [None] * 8
    if not close:
        # close() hands freed heap back to the OS; an engine merely dropped leaves that to
        # whoever trims next (glibc keeps freed heap for reuse until then).
        release_free_host_memory()
    grown = psutil.Process().memory_info().rss - before
    # One engine's state is ~80 MB: eight kept would be 640 MB.
    assert grown < 60 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"


@pytest.mark.parametrize("policy", ["cuda", "cpu", "auto"])
def test_after_close_the_model_has_its_trained_weights_and_no_hooks(policy):
    model = build("opt")
    with Engine(model, EngineConfig(policy=policy, device_budget="64MiB", margin_ratio=0.5,
                                    simulate=True)) as eng:
        for batch in BATCHES:
            eng.step(batch)
        trained = eng.model_state_dict()
    assert eng.closed and eng.manager.device_bytes == 0 and eng.manager.host_bytes == 0
    assert all(c.master is None and c.device_payload is None for c in eng.chunks)
    for name, value in model.state_dict().items():
        assert torch.equal(value, trained[name]), name
    # The model trains on its own now: no engine hook fires, gradients stay on the params.
    model(**BATCHES[0]).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    with pytest.raises(RuntimeError, match="closed"):
        eng.step(BATCHES[0])
    eng.close()  # twice is harmless


def test_an_engine_dropped_without_close_does_not_hold_the_model_hostage():
    model = build("opt")
    eng = Engine(copy.deepcopy(model), EngineConfig(device_budget="64MiB", simulate=True))
    eng.step(BATCHES[0])
    gone = weakref.ref(eng)
    del eng
    gc.collect()
    assert gone() is None
