"""`tuitrain export CHECKPOINT --merge OUT` of a LoRA run on a model folder: the merged
folder gives peft's merged logits and carries the folder's tokenizer, and merging a model
many times the host budget holds the budget, give or take a weight, never the model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from engine import Engine, EngineConfig
from engine.data.tokenizer import train_tokenizer
from engine.models.lora import LoraWeights, apply_lora
from engine.models.zoo import build_model, meta_build
from tests.engine.references import make_batches
from tuitrain.checkpoint import save_checkpoint
from tuitrain.cli import main
from tuitrain.settings import validate_settings

VOCAB = 300


def model_folder(folder) -> None:
    """A small Llama with a tokenizer of its own, saved as a Hugging Face folder."""
    tokenizer = train_tokenizer(["def step(self, batch):\n    return self.engine(batch)\n"] * 20,
                                vocab_size=VOCAB)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def lora_checkpoint(model: str, folder) -> tuple:
    """(the checkpoint in `folder` of two LoRA steps on the model folder `model`, as the
    run names it; the model's vocabulary size)."""
    settings = validate_settings({"model": model, "checkpoint": {"dir": str(folder)},
                                  "training": {"lora": {"rank": 4}}})
    built = meta_build(model, seed=0)
    adapted = apply_lora(built.model, settings.lora(), seed=0)
    vocab = adapted.config.vocab_size
    with Engine(adapted, EngineConfig(policy="cpu", device_budget="256MiB", precision="fp32",
                                      lr=1e-2), weights=LoraWeights(adapted, built.weights, 0)
                ) as eng:
        for batch in make_batches(2, vocab=vocab):
            eng.step(batch)
        return save_checkpoint(eng, adapted, None, settings, step=2), vocab


def test_a_merged_lora_run_on_a_folder_gives_peft_logits_and_keeps_its_tokenizer(tmp_path):
    from peft import PeftModel

    folder = tmp_path / "base"
    model_folder(folder)
    checkpoint, vocab = lora_checkpoint(str(folder), tmp_path)

    out = tmp_path / "merged"
    assert main(["export", str(checkpoint), "--merge", str(out)]) == 0
    ids = make_batches(1, vocab=vocab, seed=9)[0]["input_ids"]
    merged = AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    peft = PeftModel.from_pretrained(build_model(str(folder)), checkpoint / "adapter")
    reference = peft.merge_and_unload().eval()
    with torch.no_grad():
        ours, theirs = merged(input_ids=ids).logits, reference(input_ids=ids).logits
        base = build_model(str(folder)).eval()(input_ids=ids).logits
    assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())
    assert float((theirs - base).abs().max()) > 1e-3  # the adapters changed something

    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert tokenizer("def step")["input_ids"] == \
        AutoTokenizer.from_pretrained(folder, local_files_only=True)("def step")["input_ids"]


def test_a_checkpoint_and_its_merge_give_the_weights_the_mode_of_every_other_file(tmp_path):
    """safetensors writes owner-only files whatever the umask; a checkpoint's folder and a
    merged model folder are read by others as a whole (a group's server, a container run
    as another user), so their weights get the mode the umask gives the files beside."""
    import os
    import stat

    old = os.umask(0o027)
    try:
        folder = tmp_path / "base"
        model_folder(folder)
        checkpoint, _ = lora_checkpoint(str(folder), tmp_path / "ck")
        out = tmp_path / "merged"
        assert main(["export", str(checkpoint), "--merge", str(out)]) == 0
    finally:
        os.umask(old)
    written = [p for root in (checkpoint, out) for p in root.rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in written)
    modes = {p.relative_to(tmp_path): oct(stat.S_IMODE(p.stat().st_mode)) for p in written}
    assert set(modes.values()) == {oct(0o640)}, modes


def test_the_merge_is_onto_the_folder_the_run_trained_on_wherever_it_runs(tmp_path,
                                                                             monkeypatch):
    """A run given its model folder as a relative path: exported from another folder that
    holds another model of that name, the adapters still go onto the one trained on."""
    from peft import PeftModel

    monkeypatch.chdir(tmp_path)
    model_folder(tmp_path / "base")
    checkpoint, vocab = lora_checkpoint("base", tmp_path)
    checkpoint = checkpoint.resolve()
    elsewhere = tmp_path / "elsewhere"
    model_folder(elsewhere / "base")
    other = AutoModelForCausalLM.from_pretrained(elsewhere / "base")
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)  # another model under the same relative name
    other.save_pretrained(elsewhere / "base")
    monkeypatch.chdir(elsewhere)
    assert main(["export", str(checkpoint), "--merge", "merged"]) == 0
    ids = make_batches(1, vocab=vocab, seed=9)[0]["input_ids"]
    merged = AutoModelForCausalLM.from_pretrained(elsewhere / "merged").eval()
    peft = PeftModel.from_pretrained(build_model(str(tmp_path / "base")), checkpoint / "adapter")
    with torch.no_grad():
        ours, theirs = merged(input_ids=ids).logits, peft.merge_and_unload()(input_ids=ids).logits
    assert float((ours - theirs).abs().max()) <= 1e-5 * float(theirs.abs().max())


# --- host memory ----------------------------------------------------------------------------

BUDGET = 8 * 2**20
LARGEST = 4 * 2048 * 512  # bytes of the largest weight (the embedding, fc1 and fc2 alike)
SLACK = 24 * 2**20  # allocator and page slack, Python objects of the meta model and peft

# argv: the checkpoint folder, the output folder. Prints the growth of the peak resident
# memory over the settled process while the merge runs.
SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import peft.tuners.lora, transformers.models.opt.modeling_opt  # code, not data
    import engine.models.zoo, tuitrain.checkpoint
    from engine.devices.host_memory import release_free_host_memory, steady_heap
    from tuitrain.export import merge_adapter

    steady_heap()  # as a run whose host memory is tight keeps it

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    release_free_host_memory()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from here
    base = status("VmRSS")
    merge_adapter(Path(sys.argv[1]), Path(sys.argv[2]))
    print(status("VmHWM") - base)
""")


@pytest.mark.alone
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_merging_holds_the_host_budget_and_a_weight_not_the_model(tmp_path):
    from transformers import OPTConfig, OPTForCausalLM

    from tuitrain.adapter_folder import write_adapter

    folder = tmp_path / "opt-26m"  # 26M parameters: 105 MB of fp32 weights
    config = OPTConfig(vocab_size=2048, hidden_size=512, num_hidden_layers=8,
                       num_attention_heads=8, ffn_dim=2048, max_position_embeddings=128,
                       word_embed_proj_dim=512, dropout=0.0, attention_dropout=0.0)
    torch.manual_seed(0)
    OPTForCausalLM(config).save_pretrained(folder)
    weights = 4 * sum(p.numel() for p in build_model(str(folder)).parameters())
    assert weights > 6 * BUDGET

    settings = validate_settings({"model": str(folder), "engine": {"host_budget": BUDGET},
                                  "training": {"lora": {"rank": 8}}})
    checkpoint = tmp_path / "step-000001"
    checkpoint.mkdir()
    (checkpoint / "state.json").write_text(json.dumps({"settings": settings.model_dump()}))
    adapted = apply_lora(meta_build(str(folder)).model, settings.lora())
    generator = torch.Generator().manual_seed(0)
    pairs = ((name, torch.randn(p.shape, generator=generator) * 0.01)
             for name, p in adapted.named_parameters() if "lora_" in name)
    write_adapter(checkpoint / "adapter", adapted, pairs)

    out = tmp_path / "merged"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(checkpoint), str(out)],
                          capture_output=True, text=True, timeout=300, check=True)
    grown = int(done.stdout.splitlines()[-1])
    assert grown <= BUDGET + 2 * LARGEST + SLACK, grown
    assert grown < weights / 2, grown
    files = list(out.glob("model-*.safetensors"))
    assert len(files) > 6  # shards of half the budget each
    assert sum(f.stat().st_size for f in files) >= weights
