"""LoRA in the application: the flags and preset keys, a checkpoint's PEFT adapter folder
(which peft loads onto the base and which gives the engine's logits), an exact resume, and
`tuitrain export --merge`."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from engine import Engine, EngineConfig
from engine.models.zoo import build_model
from tests.engine.references import make_batches
from tuitrain.checkpoint import load_checkpoint, save_checkpoint
from tuitrain.cli import main
from tuitrain.presets import load_preset
from tuitrain.settings import InvalidSettings, Settings, validate_settings

BATCHES = make_batches(4, seq_len=16, vocab=512)


def lora_settings(tmp_path, **lora) -> Settings:
    return validate_settings({"model": "tiny", "checkpoint": {"dir": str(tmp_path / "ckpt")},
                              "training": {"lora": {"rank": 4, **lora}}})


def lora_engine(settings: Settings) -> tuple[Engine, torch.nn.Module]:
    from engine.models.lora import apply_lora

    model = apply_lora(build_model("tiny", seed=0), settings.training.lora.as_lora(), seed=0)
    return Engine(model, EngineConfig(policy="cpu", device_budget="256MiB", precision="fp32",
                                      lr=1e-2)), model


# --- flags and preset keys ------------------------------------------------------------------


def test_the_lora_flags_set_the_training_lora_keys():
    from tuitrain.cli import build_parser, resolve_settings

    parser_args = ["run", "tiny", "--lora", "8", "--lora-alpha", "32", "--lora-dropout", "0.1",
                   "--lora-targets", "q_proj, v_proj"]
    settings = resolve_settings(build_parser().parse_args(parser_args))
    lora = settings.training.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.targets) == (8, 32, 0.1, "q_proj,v_proj")
    assert lora.as_lora().targets == ("q_proj", "v_proj")
    assert Settings().training.lora is None  # no flag: every weight trains


def test_a_preset_sets_lora_under_training(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("version: 1\nmodel: tiny\ntraining:\n  lora:\n    rank: 16\n"
                    "    targets: all-linear\n")
    lora = load_preset(path).training.lora
    assert (lora.rank, lora.alpha, lora.targets) == (16, None, "all-linear")
    assert lora.as_lora().scale_alpha == 32.0


@pytest.mark.parametrize(("data", "key"), [
    ({"rank": 0}, "training.lora.rank"),
    ({"rank": 4, "dropout": 1.0}, "training.lora.dropout"),
    ({"rank": 4, "alpha": -1}, "training.lora.alpha"),
    ({"rank": 4, "targets": "q_proj;v_proj"}, "training.lora.targets"),
    ({"rank": 4, "bias": "all"}, "training.lora.bias"),
    ({"alpha": 8}, "training.lora.rank"),
])
def test_bad_lora_keys_are_refused_by_name(data, key):
    with pytest.raises(InvalidSettings) as error:
        validate_settings({"training": {"lora": data}})
    assert error.value.key == key


@pytest.mark.parametrize(("argv", "says"), [
    (["--lora", "0"], "--lora: must be greater than 0"),
    (["--lora", "four"], "--lora: must be a whole number"),
    (["--lora", "4", "--lora-dropout", "1.5"], "--lora-dropout: must be less than 1"),
    (["--lora-alpha", "8"], "--lora: missing (the rank, which any other LoRA setting needs)"),
    (["--lora", "4", "--lora-targets", "no_such_proj"], "no_such_proj"),
])
@pytest.mark.parametrize("command", ["run", "plan"])
def test_a_bad_lora_flag_is_one_line_and_status_2(capsys, command, argv, says):
    extra = ["--headless", "--steps", "1"] if command == "run" else []
    assert main([command, "tiny", *argv, *extra]) == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err


# --- checkpoints ----------------------------------------------------------------------------


def test_a_checkpoint_holds_an_adapter_folder_that_peft_loads_onto_the_base(tmp_path):
    from peft import PeftModel

    settings = lora_settings(tmp_path, alpha=16)
    eng, model = lora_engine(settings)
    for batch in BATCHES[:3]:
        eng.step(batch)
    folder = save_checkpoint(eng, model, None, settings, step=3)
    adapter = folder / "adapter"
    assert not (folder / "model").exists()  # the base never changed: not written again
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 16)
    weights = load_file(adapter / "adapter_model.safetensors")
    assert weights and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in weights)
    ids = BATCHES[3]["input_ids"]
    model.eval()
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    loaded = PeftModel.from_pretrained(build_model("tiny", seed=0), adapter).eval()
    with torch.no_grad():
        theirs = loaded(input_ids=ids).logits
    assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())
    # Trained: not the base model's logits.
    with torch.no_grad():
        base = build_model("tiny", seed=0).eval()(input_ids=ids).logits
    assert float((theirs - base).abs().max()) > 1e-3
    eng.close()

    # Merged into the base: a plain Hugging Face folder with the same logits.
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    assert main(["export", str(folder), "--merge", str(out)]) == 0
    merged = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():
        plain = merged(input_ids=ids).logits
    assert float((plain - ours).abs().max()) <= 1e-5 * float(ours.abs().max())
    # An existing folder is never overwritten; a missing checkpoint is one line.
    assert main(["export", str(folder), "--merge", str(out)]) == 2
    assert main(["export", str(tmp_path / "none"), "--merge", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()


def test_a_lora_checkpoint_keeps_the_runs_tokenizer_which_the_merged_folder_reads_with(
        tmp_path):
    """A zoo model has no folder of its own: the tokenizer the run's data was read with is
    kept beside the adapters, and the merged folder carries it."""
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from engine.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer(["the quick brown fox jumps over the lazy dog\n"] * 20,
                                vocab_size=300)
    settings = lora_settings(tmp_path)
    eng, model = lora_engine(settings)
    eng.step(BATCHES[0])
    folder = save_checkpoint(eng, model, SimpleNamespace(tokenizer=tokenizer), settings, step=1)
    eng.close()
    out = tmp_path / "merged"
    assert main(["export", str(folder), "--merge", str(out)]) == 0
    ids = AutoTokenizer.from_pretrained(out, local_files_only=True)("the lazy fox")["input_ids"]
    assert ids == tokenizer("the lazy fox")["input_ids"]
    assert ids


def test_a_lora_run_resumes_exactly(tmp_path):
    settings = lora_settings(tmp_path)
    straight, _ = lora_engine(settings)
    want = [straight.step(b).loss for b in BATCHES]
    want_weights = straight.model_state_dict()
    first, model = lora_engine(settings)
    for batch in BATCHES[:2]:
        first.step(batch)
    folder = save_checkpoint(first, model, None, settings, step=2)
    first.close()
    resumed, model = lora_engine(settings)
    assert load_checkpoint(resumed, model, None, resumed_settings(settings, folder)) == 2
    got = [resumed.step(b).loss for b in BATCHES[2:]]
    assert got == want[2:]
    weights = resumed.model_state_dict()
    assert all(torch.equal(weights[k], want_weights[k]) for k in want_weights)


def resumed_settings(settings: Settings, folder) -> Settings:
    return settings.model_copy(update={
        "checkpoint": settings.checkpoint.model_copy(update={"resume": str(folder)})})


# --- what the screens show ------------------------------------------------------------------


def test_the_lines_show_trainable_and_frozen_counts():
    from tuitrain.formatting import format_trained
    from tuitrain.tui.header import HeaderInfo, header_items

    assert format_trained(666_500, 9_200) == " (9.2k trainable, 657.3k frozen)"
    assert format_trained(666_500, 666_500) == format_trained(666_500, None) == ""
    first, _ = header_items(HeaderInfo("tiny", parameters=666_500, trainable=9_200))
    assert "666.5k params (9.2k trainable)" in "".join(t for i in first for t, _ in i.parts)
    first, _ = header_items(HeaderInfo("tiny", parameters=666_500))
    assert "666.5k params" in "".join(t for i in first for t, _ in i.parts)


def test_the_chunk_map_marks_frozen_chunks_apart_from_trainable_ones():
    from engine.telemetry import ChunkInfo
    from tuitrain.tui.chunk_map import IN_USE, cell_for

    for location in ("device", "host", "disk"):
        frozen = cell_for(ChunkInfo(0, location, "HOLD", 64, frozen=True))
        trained = cell_for(ChunkInfo(0, location, "HOLD", 64))
        assert frozen[0] != trained[0] and frozen[1] == trained[1]  # glyph apart, colour kept
    assert cell_for(ChunkInfo(0, "host", "COMPUTE", 64, frozen=True)) == IN_USE


def test_a_snapshot_says_which_chunks_are_frozen(tmp_path):
    eng, _ = lora_engine(lora_settings(tmp_path))
    chunks = eng.snapshot().chunks
    assert {c.frozen for c in chunks} == {True, False}
    assert [c.frozen for c in chunks] == [c.frozen for c in eng.chunks]
    eng.close()
