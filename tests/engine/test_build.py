"""Models made on the meta device and built a chunk at a time: a zoo model's weights, fixed
by the seed whatever the placement, and a local safetensors folder read tensor by tensor."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import VOCAB, build, make_batches
from safetensors.torch import save_file

from engine import Engine, EngineConfig
from engine.models.initial_weights import ModelInit
from engine.models.zoo import BadCheckpoint, build_model, meta_build
from engine.placement import disk_rules


def engine_for(built, *, policy: str = "cpu", host_budget: int | None = None,
               disk_dir=None) -> Engine:
    return Engine(built.model, EngineConfig(policy=policy, device_budget="1GiB",
                                            precision="fp32", simulate=True,
                                            host_budget=host_budget, disk_dir=disk_dir),
                  weights=built.weights)


def assert_same_weights(expected: dict, got: dict) -> None:
    assert expected.keys() == got.keys()
    different = [k for k in expected if not torch.equal(expected[k], got[k].to(expected[k]))]
    assert different == []


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    # tiny's chunks are small: pieces of 2**14 elements let a 4 MiB host budget send most
    # of its state to disk (at the default size the I/O buffers alone outweigh tiny).
    monkeypatch.setattr(disk_rules, "DISK_PIECE", 2**14)


@pytest.mark.parametrize(("policy", "budgeted"),
                         [("cuda", False), ("auto", False), ("cpu", False), ("cpu", True)])
def test_a_zoo_model_built_chunk_by_chunk_has_the_weights_of_the_whole_build(
        policy, budgeted, small_pieces, tmp_path):
    whole = build_model("tiny", seed=5).state_dict()
    with engine_for(meta_build("tiny", seed=5), policy=policy, disk_dir=tmp_path,
                    host_budget=4 * 2**20 if budgeted else None) as eng:
        if budgeted:
            assert eng.snapshot().disk_model > 0  # chunks were sent to disk as they were made
        assert_same_weights(whole, eng.model_state_dict())


def test_the_seed_fixes_a_zoo_models_weights_and_another_seed_changes_them():
    with engine_for(meta_build("tiny", seed=1)) as one, \
            engine_for(meta_build("tiny", seed=2)) as two:
        first, second = one.model_state_dict(), two.model_state_dict()
    name = "model.decoder.layers.1.fc2.weight"
    assert not torch.equal(first[name], second[name])
    assert_same_weights(first, build_model("tiny", seed=1).state_dict())


def test_tied_weights_stay_one_parameter_after_a_chunked_build():
    built = meta_build("tiny")
    with engine_for(built) as eng:
        model = built.model
        assert model.lm_head.weight is model.model.decoder.embed_tokens.weight
        assert sum(len(c.slots) for c in eng.chunks) == len(list(model.parameters()))
        embedding = eng.model_state_dict()["model.decoder.embed_tokens.weight"]
        assert torch.count_nonzero(embedding[model.config.pad_token_id]) == 0
        eng.step(make_batches(1, vocab=8192)[0])
        state = eng.model_state_dict()
        assert torch.equal(state["lm_head.weight"], state["model.decoder.embed_tokens.weight"])


def test_a_module_added_to_the_meta_model_is_initialised_by_its_module():
    def add_head(model: torch.nn.Module) -> torch.nn.Module:
        with torch.device("meta"):
            model.extra = torch.nn.LayerNorm(64)
        return model

    built = meta_build("tiny", transform=add_head)
    with engine_for(built) as eng:
        state = eng.model_state_dict()
    assert torch.equal(state["extra.weight"], torch.ones(64))
    assert torch.equal(state["extra.bias"], torch.zeros(64))


def test_a_meta_model_without_its_weights_is_refused():
    with pytest.raises(ValueError, match="meta device"):
        Engine(meta_build("tiny").model, EngineConfig(device_budget="1GiB", simulate=True))


# --- local folders -------------------------------------------------------------------------

def llama(tied: bool) -> torch.nn.Module:
    """A Llama with grouped-query attention and RoPE, its head tied or not."""
    model = build("llama", seed=3, layers=2)
    if tied:
        model.config.tie_word_embeddings = True
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


@pytest.mark.parametrize("tied", [False, True])
def test_a_sharded_folder_is_read_into_the_chunks_and_gives_the_models_loss(tmp_path, tied):
    original = llama(tied)
    # Shards of ~100 kB: several files and their index.
    original.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    batch = make_batches(1, vocab=VOCAB)[0]
    original.eval()
    with torch.no_grad():
        expected = original(**batch).loss.item()
    built = meta_build(str(tmp_path))
    with engine_for(built, policy="auto") as eng:
        assert_same_weights(original.state_dict(), eng.model_state_dict())
        assert eng.evaluate(batch) == pytest.approx(expected, rel=1e-6)
    assert (built.model.lm_head.weight is built.model.model.embed_tokens.weight) is tied


def test_a_folder_read_under_a_host_budget_sends_its_chunks_to_disk(tmp_path, small_pieces):
    original = build_model("tiny", seed=9)
    original.save_pretrained(tmp_path / "model")
    with engine_for(meta_build(str(tmp_path / "model")), host_budget=4 * 2**20,
                    disk_dir=tmp_path / "scratch") as eng:
        assert eng.snapshot().disk_model > 0
        assert_same_weights(original.state_dict(), eng.model_state_dict())


def test_a_tensor_the_folder_lacks_is_initialised_as_a_fresh_model_would_be(tmp_path):
    original = build_model("tiny", seed=4)
    original.save_pretrained(tmp_path)
    name = "model.decoder.final_layer_norm.weight"
    tensors = {k: v.contiguous() for k, v in original.state_dict().items()
               if k not in (name, "lm_head.weight")}
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with engine_for(meta_build(str(tmp_path))) as eng:
        state = eng.model_state_dict()
    assert torch.equal(state[name], torch.ones_like(state[name]))
    assert torch.equal(state["model.decoder.layers.0.fc1.weight"],
                       original.state_dict()["model.decoder.layers.0.fc1.weight"])


def test_a_tensor_of_the_wrong_shape_is_a_bad_checkpoint(tmp_path):
    build_model("tiny").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["ffn_dim"] = 128
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(BadCheckpoint, match="fc1.weight .* has shape"):
        engine_for(meta_build(str(tmp_path)))


def test_a_folder_with_only_pickled_weights_is_refused_in_one_line(tmp_path):
    model = build_model("tiny")
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(BadCheckpoint, match=r"only \.bin") as caught:
        meta_build(str(tmp_path))
    assert "\n" not in str(caught.value)


def test_a_fresh_models_buffers_get_their_values_at_once():
    """RoPE's inverse frequencies are buffers, computed from the config, not drawn."""
    reference = build("llama", layers=1)
    with torch.device("meta"):
        model = type(reference)(reference.config)
    ModelInit(model, seed=0)
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)
