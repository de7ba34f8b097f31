"""The model zoo: published OPT shapes, deterministic builds, local checkpoint folders."""

from __future__ import annotations

import math
import textwrap
import time

import psutil
import pytest
import torch

from engine.models import zoo
from engine.models.zoo import (
    KNOWN_MODELS,
    BadCheckpoint,
    UnknownModel,
    build_model,
    count_parameters,
    is_model_folder,
    list_models,
    meta_model,
    model_config,
)
from tests.forked import run_script


def test_the_zoo_lists_tiny_then_the_opt_family_then_llama_by_size():
    assert KNOWN_MODELS == (
        "tiny", "opt-125m", "opt-350m", "opt-1.3b", "opt-2.7b", "opt-6.7b", "opt-13b", "opt-30b",
        "llama-1b", "llama-3b", "llama-8b",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("name", "parameters"),
    [("opt-125m", 125_239_296), ("opt-350m", 331_196_416), ("opt-1.3b", 1_315_758_080)],
)
def test_parameter_counts_match_the_published_models(name, parameters):
    assert count_parameters(name) == parameters


@pytest.mark.parametrize(
    ("name", "nominal"),
    [("opt-2.7b", 2.7e9), ("opt-6.7b", 6.7e9), ("opt-13b", 13e9), ("opt-30b", 30e9)],
)
def test_large_models_are_the_size_their_name_says(name, nominal):
    assert abs(count_parameters(name) / nominal - 1) < 0.03


def test_opt_350m_embeds_in_512_dims_and_normalises_after_each_block():
    config = model_config("opt-350m")
    assert (config.hidden_size, config.word_embed_proj_dim) == (1024, 512)
    assert config.do_layer_norm_before is False
    decoder = meta_model("opt-350m").model.decoder
    assert decoder.project_in.weight.shape == (1024, 512)
    assert decoder.project_out.weight.shape == (512, 1024)


OPT_MODELS = tuple(name for name in KNOWN_MODELS if not name.startswith("llama"))


@pytest.mark.parametrize(
    ("name", "parameters"),
    # Llama 3.2 1B and 3B, Llama 3.1 8B as published.
    [("llama-1b", 1_235_814_400), ("llama-3b", 3_212_749_824), ("llama-8b", 8_030_261_248)],
)
def test_llama_entries_have_the_published_parameter_counts(name, parameters):
    assert count_parameters(name) == parameters


@pytest.mark.parametrize(("name", "tied", "factor"),
                         [("llama-1b", True, 32.0), ("llama-3b", True, 32.0),
                          ("llama-8b", False, 8.0)])
def test_llama_entries_use_grouped_query_attention_and_llama3_rope(name, tied, factor):
    config = model_config(name)
    assert config.vocab_size == 128256
    assert (config.num_attention_heads, config.num_key_value_heads) in {(32, 8), (24, 8)}
    assert config.rope_parameters["rope_type"] == "llama3"
    assert config.rope_parameters["factor"] == factor
    assert config.rope_parameters["rope_theta"] == 500000.0
    model = meta_model(name)
    attention = model.model.layers[0].self_attn
    # Eight key/value heads shared by all the query heads.
    assert attention.k_proj.weight.shape[0] == 8 * config.head_dim
    assert attention.q_proj.weight.shape[0] == config.num_attention_heads * config.head_dim
    assert (model.lm_head.weight is model.model.embed_tokens.weight) is tied


@pytest.mark.parametrize("name", OPT_MODELS)
def test_every_opt_model_shares_the_opt_vocabulary_conventions(name):
    config = model_config(name)
    assert (config.pad_token_id, config.eos_token_id) == (1, 2)
    assert config.tie_word_embeddings
    if name != "tiny":
        assert (config.vocab_size, config.max_position_embeddings) == (50272, 2048)


def test_opt_30b_on_the_meta_device_allocates_nothing():
    process = psutil.Process()
    before = process.memory_info().rss
    model = meta_model("opt-30b")
    grown = process.memory_info().rss - before
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) > 29e9  # 120 GB were it real
    assert grown < 256 * 1024**2


def test_list_models_describes_every_zoo_model_quickly():
    zoo._zoo_count.cache_clear()
    # CPU time of this process: other processes sharing the machine do not count.
    start = time.process_time()
    infos = list_models()
    assert time.process_time() - start < 2.0
    assert [info.name for info in infos] == list(KNOWN_MODELS)
    by_name = {info.name: info for info in infos}
    assert (by_name["opt-1.3b"].layers, by_name["opt-1.3b"].hidden) == (24, 2048)
    assert by_name["opt-125m"].parameters == 125_239_296
    assert by_name["tiny"].parameters == count_parameters("tiny")


def test_tiny_builds_in_train_mode_and_learns_from_a_batch():
    model = build_model("tiny")
    assert model.training and model.config.use_cache is False
    ids = torch.randint(4, 8000, (2, 32), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids).loss
    # Freshly initialised: close to a uniform guess over the 8192-token vocabulary.
    assert abs(loss.item() - math.log(8192)) < 0.5
    loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None]
    assert missing == []
    assert model.lm_head.weight.grad.abs().sum() > 0


def test_tiny_ties_lm_head_to_the_embedding_and_zeroes_the_padding_row():
    model = build_model("tiny")
    embedding = model.model.decoder.embed_tokens.weight
    assert model.lm_head.weight is embedding
    assert torch.count_nonzero(embedding[model.config.pad_token_id]) == 0
    assert embedding.std().item() == pytest.approx(model.config.init_std, rel=0.05)


def test_the_same_seed_gives_the_same_weights():
    first, second = (
        build_model("tiny", seed=7).state_dict(),
        build_model("tiny", seed=7).state_dict(),
    )
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_another_seed_gives_other_weights():
    first, second = build_model("tiny", seed=0), build_model("tiny", seed=1)
    assert not torch.equal(first.lm_head.weight, second.lm_head.weight)
    assert not torch.equal(
        first.model.decoder.layers[0].fc1.weight, second.model.decoder.layers[0].fc1.weight
    )


def test_building_leaves_the_callers_random_state_alone():
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_model("tiny", seed=5)
    assert torch.equal(torch.rand(3), expected)


def test_a_dtype_is_built_directly():
    model = build_model("tiny", dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.slow
def test_building_opt_125m_peaks_at_one_copy_of_the_weights():
    # The kernel's high-water mark is reset once imports have settled (clear_refs 5), so
    # the peak measures the build alone, even if cold import pages were reclaimed meanwhile;
    # so a forked process (tests/forked.py), whose imports the fork server already made,
    # measures it as a fresh one does.
    script = textwrap.dedent(
        """
        from engine.models.zoo import build_model, meta_model
        meta_model("opt-125m")  # imports settle before the baseline

        def status(key):
            for line in open("/proc/self/status"):
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024

        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = status("VmRSS")
        build_model("opt-125m")
        print(status("VmHWM") - base)
        """
    )
    peak_growth = int(run_script(script, timeout=120).split()[-1])
    one_copy = 125_239_296 * 4
    assert peak_growth < 1.2 * one_copy


@pytest.fixture
def saved_tiny(tmp_path):
    model = build_model("tiny", seed=3)
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    return model, folder


def test_a_saved_folder_loads_with_its_weights(saved_tiny):
    original, folder = saved_tiny
    assert is_model_folder(folder)
    loaded = build_model(str(folder))
    assert loaded.training and loaded.config.use_cache is False
    expected, got = original.state_dict(), loaded.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert model_config(str(folder)).hidden_size == 64
    assert count_parameters(str(folder)) == count_parameters("tiny")


def test_a_folder_loads_in_the_dtype_asked_for(saved_tiny):
    _, folder = saved_tiny
    model = build_model(str(folder), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_an_unknown_name_lists_the_known_ones():
    with pytest.raises(UnknownModel) as caught:
        build_model("opt-7b")
    message = str(caught.value)
    assert "'opt-7b'" in message and "local model folder" in message
    assert all(name in message for name in KNOWN_MODELS)
    assert "\n" not in message
    assert isinstance(caught.value, ValueError)


def test_count_and_config_reject_unknown_names_too():
    with pytest.raises(UnknownModel):
        count_parameters("gpt-5")
    with pytest.raises(UnknownModel):
        model_config("gpt-5")


def test_corrupt_weights_are_a_bad_checkpoint(saved_tiny):
    _, folder = saved_tiny
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(BadCheckpoint, match="cannot load model folder"):
        build_model(str(folder))


def test_a_folder_without_weights_is_a_bad_checkpoint(saved_tiny):
    _, folder = saved_tiny
    (folder / "model.safetensors").unlink()
    assert not is_model_folder(folder)
    with pytest.raises(BadCheckpoint, match="no weights"):
        build_model(str(folder))


@pytest.mark.parametrize("config_text", ["{not json", "{}", '{"model_type": "no-such-model"}'])
def test_an_unreadable_config_is_a_bad_checkpoint(saved_tiny, config_text):
    _, folder = saved_tiny
    (folder / "config.json").write_text(config_text)
    with pytest.raises(BadCheckpoint, match="config.json"):
        build_model(str(folder))
    with pytest.raises(BadCheckpoint):
        count_parameters(str(folder))


def test_a_folder_without_config_or_a_plain_file_is_a_bad_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x")
    assert not is_model_folder(tmp_path / "empty")
    with pytest.raises(BadCheckpoint, match="no config.json"):
        build_model(str(tmp_path / "empty"))
    with pytest.raises(BadCheckpoint, match="not a model folder"):
        build_model(str(tmp_path / "weights.bin"))


def test_a_missing_folder_is_named_as_a_folder(tmp_path):
    with pytest.raises(UnknownModel, match="no model folder at") as caught:
        build_model(str(tmp_path / "nowhere"))
    assert "opt-125m" in str(caught.value)


def test_tuitrain_models_lists_the_llama_entries_with_their_sizes():
    from tuitrain.model_list import model_listing

    lines = {line.split()[0]: line.split() for line in model_listing()[1:-1]}
    assert lines["llama-1b"][1:3] == ["1.2B", "1,235,814,400"]
    assert lines["llama-3b"][1:3] == ["3.2B", "3,212,749,824"]
    assert lines["llama-8b"][1:] == ["8.0B", "8,030,261,248", "32", "4096"]
