"""Checkpoints of a model over the host budget: written shard by shard, read tensor by tensor.

The engine's payloads and optimizer state live on disk here (a host budget of 15% of the
state); a checkpoint still resumes exactly, the model folder is Hugging Face's sharded
layout that from_pretrained loads, saving holds about one shard beyond the engine, and a
damaged shard or index is refused whole.
"""

from __future__ import annotations

import json
import shutil
import weakref
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, OPTConfig, OPTForCausalLM

from engine import Engine, EngineConfig
from engine.data.corpus import TokenBatches
from engine.placement import disk_rules
from tuitrain import checkpoint, shard_files
from tuitrain.checkpoint import CheckpointError, find_checkpoint, load_checkpoint, save_checkpoint
from tuitrain.settings import Settings

TOKENS = np.random.default_rng(0).integers(0, 1000, 20_000).astype(np.int64)
SHARD = 256 * 1024  # bytes: several shards of weights and of optimizer state
SMALL_PIECE = 2**14  # disk I/O pieces, so that these small chunks go piece by piece


def build() -> OPTForCausalLM:
    """Seven chunks of ~67k parameters: 1.9 MB of weights, 7.5 MB of training state."""
    torch.manual_seed(0)
    return OPTForCausalLM(OPTConfig(
        vocab_size=1024, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
        ffn_dim=256, max_position_embeddings=64, word_embed_proj_dim=64, dropout=0.0,
        attention_dropout=0.0))


def host_state() -> int:
    with Engine(build(), EngineConfig(policy="cpu", device_budget="64MiB",
                                      precision="fp32")) as eng:
        return eng.manager.host_bytes


HOST_BUDGET = int(0.15 * host_state())  # payloads and optimizer state on disk


class Run:
    """An fp32 run whose chunks live on disk, with what the checkpoint functions take."""

    def __init__(self, tmp_path, **checkpoint_settings) -> None:
        self.settings = Settings(model="tiny", checkpoint={"dir": str(tmp_path / "ck"),
                                                           **checkpoint_settings})
        self.model = build()
        self.engine = Engine(self.model, EngineConfig(
            policy="auto", device_budget="64MiB", precision="fp32", host_budget=HOST_BUDGET,
            disk_dir=tmp_path / f"scratch-{id(self)}"))
        self.data = TokenBatches(TOKENS, batch_size=2, seq_len=16, seed=0)
        self.batches = iter(self.data)

    def steps(self, n: int) -> list[float]:
        return [self.engine.step(next(self.batches)).loss for _ in range(n)]

    def save(self):
        return save_checkpoint(self.engine, self.model, self.data, self.settings,
                               self.engine.step_count, shard_bytes=SHARD)

    def within_host_budget(self) -> bool:
        m = self.engine.manager
        return m.host_bytes + m.io_buffer_bytes <= HOST_BUDGET


@pytest.fixture(autouse=True, scope="module")
def small_pieces() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(disk_rules, "DISK_PIECE", SMALL_PIECE)
        yield


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Run, Path]:
    """A run after two steps and its checkpoint (tests that change it take a copy)."""
    run = Run(tmp_path_factory.mktemp("saved"))
    run.steps(2)
    return run, run.save()


def test_resume_from_shards_gives_the_losses_of_the_uninterrupted_run(tmp_path):
    straight = Run(tmp_path)
    assert all(c.payload_on_disk and c.state_on_disk for c in straight.engine.chunks)
    losses = straight.steps(4)

    first = Run(tmp_path)
    first.steps(2)
    folder = first.save()
    assert (folder / "optimizer.safetensors.index.json").is_file()
    manifest = json.loads((folder / "manifest.json").read_text())["files"]
    assert "optimizer.safetensors.index.json" in manifest
    assert sum(n.startswith("optimizer-") for n in manifest) > 1

    resumed = Run(tmp_path, resume=str(tmp_path / "ck"))
    assert load_checkpoint(resumed.engine, resumed.model, resumed.data, resumed.settings) == 2
    assert resumed.within_host_budget()
    assert resumed.steps(2) == losses[2:]
    assert resumed.engine.step_count == 4


def test_the_sharded_model_folder_loads_with_transformers(saved):
    run, folder = saved
    model_dir = folder / "model"
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 3
    assert shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                      for i in range(1, len(shards) + 1)]
    sizes = 0
    for shard in shards:
        with safe_open(model_dir / shard, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            sizes += sum(f.get_tensor(k).nbytes for k in f.keys())
    assert index["metadata"]["total_size"] == sizes
    # The tied head is written once, under the embedding's name, as save_pretrained does.
    assert "lm_head.weight" not in index["weight_map"]
    assert "model.decoder.embed_tokens.weight" in index["weight_map"]

    loaded = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    want = run.engine.model_state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in got)


def test_saving_holds_about_one_shard_and_one_chunk_never_the_whole_state(tmp_path,
                                                                          monkeypatch):
    run = Run(tmp_path)
    alive = {"now": 0, "peak": 0}

    def tracked(pairs):
        """The engine's pairs, counting the bytes of every one not yet freed."""
        for name, tensor in pairs:
            nbytes = tensor.nbytes
            alive["now"] += nbytes
            alive["peak"] = max(alive["peak"], alive["now"])
            weakref.finalize(tensor, lambda n=nbytes: alive.__setitem__("now", alive["now"] - n))
            yield name, tensor

    engine = run.engine
    whole = (sum(t.nbytes for t in engine.model_state_dict().values())
             + sum(t.nbytes for t in engine.state_dict()["tensors"].values()))
    model_pairs, state_pairs = engine.iter_model_state, engine.iter_optimizer_state
    monkeypatch.setattr(engine, "iter_model_state", lambda: tracked(model_pairs()))
    monkeypatch.setattr(engine, "iter_optimizer_state", lambda: tracked(state_pairs()))
    written = []
    save = shard_files.save_file

    def recording(tensors, path, **kw):
        written.append(sum(t.nbytes for t in tensors.values()))
        return save(tensors, path, **kw)

    monkeypatch.setattr(shard_files, "save_file", recording)
    run.save()
    chunk = max(4 * 3 * c.numel for c in engine.chunks)  # a chunk's master and moments
    assert max(written) <= SHARD
    assert alive["peak"] <= SHARD + chunk
    assert alive["peak"] < whole / 4
    print(f"shards written {len(written)}, peak {alive['peak']} bytes alive while saving, "
          f"whole state {whole} bytes")


@pytest.mark.parametrize("damage", ["model index", "model shard", "optimizer index",
                                    "optimizer shard"])
def test_a_truncated_shard_or_index_is_refused_whole(saved, tmp_path, damage):
    folder = tmp_path / saved[1].name
    shutil.copytree(saved[1], folder)
    what, kind = damage.split()
    base = folder / "model" if what == "model" else folder
    target = (base / f"{what}.safetensors.index.json" if kind == "index"
              else sorted(base.glob(f"{what}-*-of-*.safetensors"))[1])
    target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])

    fresh = Run(tmp_path, resume=str(folder))
    before = fresh.engine.model_state_dict()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(fresh.engine, fresh.model, fresh.data, fresh.settings)
    message = str(err.value)
    assert "\n" not in message
    assert str(target) in message and "corrupt" in message
    after = fresh.engine.model_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert fresh.engine.step_count == 0


def test_a_crash_between_shards_keeps_the_last_checkpoint_and_training_goes_on(tmp_path,
                                                                             monkeypatch):
    run = Run(tmp_path)
    good = run.save()
    run.steps(1)
    calls = []
    save = shard_files.save_file

    def crash_on_the_third(tensors, path, **kw):
        calls.append(path)
        if len(calls) == 3:
            raise KeyboardInterrupt  # the process dies between two shards
        return save(tensors, path, **kw)

    monkeypatch.setattr(shard_files, "save_file", crash_on_the_third)
    with pytest.raises(KeyboardInterrupt) as died:
        run.save()
    assert died.tb is not None  # which holds the frames of the save, as a caller's may
    root = tmp_path / "ck"
    assert sorted(p.name for p in root.iterdir()) == [good.name]
    assert find_checkpoint(root) == good
    assert checkpoint.verify(good)["step"] == 0
    # The chunk being written when it died went back to disk: training goes on in budget.
    assert all(c.payload is None for c in run.engine.chunks if c.payload_on_disk)
    run.steps(1)
    assert run.within_host_budget()
