"""Building, saving and loading a model twelve times the host budget: a fresh process
holds at most the budget, one chunk and one tensor read, as the plan's building peak says."""

from __future__ import annotations

import json
import sys
import textwrap

import pytest
from transformers import OPTConfig

from engine.placement import disk_rules
from engine.planning.host_memory import RUNTIME_BYTES
from engine.planning.planner import plan
from tests.forked import run_script

BUDGET = 32 * 2**20
PIECE = 2**18  # elements per piece of disk I/O: buffers small beside the budget

# argv: the model folder (config.json), the scratch folder. Prints the growth of the peak
# resident memory over the settled process for: building from a fresh init, reading every
# weight back (saving, one safetensors file per tensor), loading that folder.
SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    from safetensors.torch import save_file
    from engine.placement import disk_rules
    disk_rules.DISK_PIECE = %d
    from engine import Engine, EngineConfig
    from engine.devices.host_memory import release_free_host_memory, steady_heap
    from engine.models.initial_weights import ModelInit
    from engine.models.zoo import meta_build
    from transformers import OPTConfig, OPTForCausalLM

    steady_heap()  # as every run keeps it (tuitrain.training_run)
    folder, scratch = Path(sys.argv[1]), Path(sys.argv[2])
    config = EngineConfig(policy="cpu", device_budget="1GiB", precision="fp32", simulate=True,
                          host_budget=%d, disk_dir=scratch)

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    def settled():
        release_free_host_memory()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from here
        return status("VmRSS")

    grown = {}
    with torch.device("meta"):  # a fresh model of the folder's config, as the zoo makes one
        model = OPTForCausalLM(OPTConfig.from_pretrained(folder))
    base = settled()
    engine = Engine(model, config, weights=ModelInit(model))
    grown["build"] = status("VmHWM") - base
    out = folder / "weights"
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    base = settled()
    for i, (name, tensor) in enumerate(engine.iter_model_state()):
        if name != "lm_head.weight":  # tied: saved once, as transformers saves it
            save_file({name: tensor.contiguous()}, out / f"{i:05d}.safetensors")
        del tensor
    grown["save"] = status("VmHWM") - base
    engine.close(keep_weights=False)
    del engine, model
    built = meta_build(str(out))
    base = settled()
    engine = Engine(built.model, config, weights=built.weights)
    grown["load"] = status("VmHWM") - base
    grown["disk_model"] = engine.snapshot().disk_model
    engine.close(keep_weights=False)
    print(json.dumps(grown))
""") % (PIECE, BUDGET)


@pytest.mark.alone
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_building_saving_and_loading_hold_the_host_budget_one_chunk_and_one_tensor(
        tmp_path, monkeypatch):
    monkeypatch.setattr(disk_rules, "DISK_PIECE", PIECE)
    folder = tmp_path / "opt-26m"  # 26M parameters: 420 MB of fp32 training state
    OPTConfig(vocab_size=2048, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
              ffn_dim=2048, max_position_embeddings=128, word_embed_proj_dim=512,
              dropout=0.0, attention_dropout=0.0).save_pretrained(folder)
    forecast = plan(str(folder), device_mem="1GiB", host_mem="64GiB", precision="fp32",
                    simulated=True, host_budget=BUDGET, disk_dir=tmp_path, batch_size=1,
                    seq_len=16)
    state = forecast.model_bytes
    assert state > 12 * BUDGET
    building = forecast.build_peak - RUNTIME_BYTES
    largest_tensor = 4 * 2048 * 512  # the embedding, fc1 and fc2 alike
    assert building <= BUDGET + 16 * forecast.chunk_size + largest_tensor
    assert building < 4 * forecast.parameters  # less than the fp32 weights alone
    # A forked process (tests/forked.py): each figure is a growth past a reset of the
    # high-water mark, which the imports the fork server made do not change.
    grown = json.loads(run_script(SCRIPT, str(folder), str(tmp_path),
                                  timeout=600).splitlines()[-1])
    assert grown["disk_model"] > state / 2
    for what in ("build", "save", "load"):
        # The plan is the bound: a few MB of allocator and page slack aside.
        assert grown[what] <= building + 16 * 2**20, (what, grown, building)
    assert grown["build"] > building / 2  # the chunks were really made here
