"""Data-parallel checkpoints: every rank writes its own shard of the optimizer state, and a
checkpoint resumes at any world size.

A tiny OPT in fp32 on gloo ranks of one thread. One process writes a checkpoint after step
2 of 4, two ranks another, three ranks a third; each is resumed at other world sizes
(1 -> 2, 2 -> 2, 2 -> 3, 3 -> 1) and goes on with the losses of the run that never
stopped (torch.optim.AdamW(fused=True) on the same global batches), within 1e-5. While
saving, each rank writes exactly its shard's bytes, and the only state a rank receives is
the weights rank 0 writes into the model folder; while resuming, each rank reads from the
files exactly the elements its own shard holds. Damage the checksums cannot see (a rank
layout that disagrees with the files, a world size) and a missing rank file are refused
in one line, before anything changes; a rank dying mid-write leaves the previous
checkpoint the newest.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine" / "distributed"))
from dp_harness import (  # noqa: E402 - the data-parallel harness lives with the engine's tests
    COLLECTIVE_TIMEOUT,
    build,
    make_batches,
    rank_slice,
    reference_run,
    run_ranks,
)

from engine import Engine, EngineConfig  # noqa: E402
from engine.distributed.shards import overlap  # noqa: E402
from tuitrain import checkpoint, shard_files  # noqa: E402
from tuitrain.checkpoint import (  # noqa: E402
    CheckpointError,
    find_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from tuitrain.settings import Settings  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS, SAVED_AT = 4, 2
BATCH = 6  # global sequences per step: splits over 1, 2 and 3 ranks
TOL = 1e-5


def _engine(model: torch.nn.Module) -> Engine:
    return Engine(model, EngineConfig(policy="auto", device_budget="64MiB", precision="fp32",
                                      collective_timeout=COLLECTIVE_TIMEOUT))


def _settings(ck: str | None = None, resume: str | None = None) -> Settings:
    return Settings(model="tiny", checkpoint={"dir": ck, "resume": resume})


def _steps(engine: Engine, rank: int, world: int, first: int, last: int) -> list[float]:
    batches = make_batches(STEPS, batch_size=BATCH)
    return [engine.step(rank_slice(batches[i - 1], rank, world)).loss
            for i in range(first, last + 1)]


def _held(engine: Engine) -> tuple[int, int]:
    """(elements, parameters) this rank's shard holds of the model: all of them unsharded."""
    elements = parameters = 0
    for c in engine.chunks:
        for s in c.slots:
            lo, hi = (c.shard.lo, c.shard.hi) if c.shard is not None else (0, c.numel)
            part = overlap(s.offset, s.numel, lo, hi)
            if part is not None:
                elements, parameters = elements + part[1] - part[0], parameters + 1
    return elements, parameters


def _shard_bytes(engine: Engine) -> int:
    """What this rank's pieces of the optimizer state weigh: fp32 master and two moments of
    every element its shard holds, and a step count per parameter it holds a piece of."""
    elements, parameters = _held(engine)
    return 3 * 4 * elements + 4 * parameters


def _save_watched(engine: Engine, model: torch.nn.Module, ck: str) -> dict:
    """Save (every rank, as the app does), counting the bytes this rank writes into
    optimizer files and receives by gathers."""
    written: dict[str, int] = {}
    gathered = [0]
    save, gather = shard_files.save_file, engine.collectives.gather

    def recording(tensors, path, **kw):
        name = Path(path).name
        written[name] = sum(t.nbytes for t in tensors.values())
        return save(tensors, path, **kw)

    def counting(full, chunk):
        gathered[0] += full.nbytes
        return gather(full, chunk)

    def refused():
        raise AssertionError("the optimizer state was gathered")

    shard_files.save_file = recording
    engine.collectives.gather = counting
    engine.iter_optimizer_state = refused
    try:
        args = (engine, model, None, _settings(ck), engine.step_count)
        folder = save_checkpoint(*args)
    finally:
        shard_files.save_file = save
        del engine.collectives.gather, engine.iter_optimizer_state
    return {"folder": str(folder),
            "optimizer_bytes": sum(n for f, n in written.items() if f.startswith("optimizer")),
            "model_bytes_written": sum(n for f, n in written.items() if f.startswith("model")),
            "shard_bytes": _shard_bytes(engine), "gathered": gathered[0],
            "weights": sum(4 * c.numel for c in engine.chunks)}


def _resume(rank: int, world: int, ck: str) -> list[float]:
    """Resume `ck` on this rank and train to the end: the losses. Asserts that the rank
    read from the files the elements of optimizer state its own shard holds, no more."""
    model = build()
    engine = _engine(model)
    read = [0]
    whole = shard_files.ShardedTensors.read

    def counting(self, key, lo, hi):
        part = whole(self, key, lo, hi)
        if not key.startswith("step/"):
            read[0] += part.nbytes
        return part

    shard_files.ShardedTensors.read = counting
    try:
        assert load_checkpoint(engine, model, None, _settings(resume=ck)) == SAVED_AT
    finally:
        shard_files.ShardedTensors.read = whole
    assert read[0] == 3 * 4 * _held(engine)[0], (ck, rank)
    losses = _steps(engine, rank, world, SAVED_AT + 1, STEPS)
    engine.close()
    return losses


def train_save_resume(rank: int, world: int, *, ck: str, resume: list[str]) -> dict:
    """On every rank: resume each checkpoint in `resume` (written by another world size),
    then train from scratch, saving after step 2 into `ck`, and go on to the end; then
    resume that checkpoint at this same world size."""
    out = {"resumed": {path: _resume(rank, world, path) for path in resume}}
    model = build()
    engine = _engine(model)
    losses = _steps(engine, rank, world, 1, SAVED_AT)
    out["save"] = _save_watched(engine, model, ck)
    losses += _steps(engine, rank, world, SAVED_AT + 1, STEPS)
    engine.close()
    out["losses"] = losses
    out["same_world"] = _resume(rank, world, ck)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The checkpoints of one process, two ranks and three (after step 2 of 4), each resumed
    at other world sizes, and the uninterrupted run's losses: two launches of ranks."""
    tmp = tmp_path_factory.mktemp("ranks")
    expected, _ = reference_run(build(), make_batches(STEPS, batch_size=BATCH))
    ck1, ck2, ck3 = (str(tmp / f"ck{n}") for n in (1, 2, 3))
    model = build()
    engine = _engine(model)
    single_losses = _steps(engine, 0, 1, 1, SAVED_AT)
    single = save_checkpoint(engine, model, None, _settings(ck1), SAVED_AT)
    engine.close()
    two = run_ranks(2, "test_checkpoint_ranks.train_save_resume", tmp / "two",
                    ck=ck2, resume=[ck1])
    three = run_ranks(3, "test_checkpoint_ranks.train_save_resume", tmp / "three",
                      ck=ck3, resume=[ck2])
    return {"expected": expected, "single": single, "single_losses": single_losses,
            "two": two, "three": three, "three_to_one": _resume(0, 1, ck3),
            "ck": {1: ck1, 2: ck2, 3: ck3}}


def test_checkpoints_resume_at_any_world_size_with_the_losses_of_the_unstopped_run(runs):
    expected, ck = runs["expected"], runs["ck"]
    after = expected[SAVED_AT:]
    assert runs["single_losses"] == pytest.approx(expected[:SAVED_AT], rel=TOL)
    for world in (2, 3):
        got = runs["two" if world == 2 else "three"]
        assert got[0]["losses"] == pytest.approx(expected, rel=TOL), world
        assert got[0]["same_world"] == pytest.approx(after, rel=TOL), f"{world} -> {world}"
        # Every rank has the whole batch's loss: the ranks agree.
        assert all(r["losses"] == got[0]["losses"] for r in got)
        assert all(r["same_world"] == got[0]["same_world"] for r in got)
    assert runs["two"][0]["resumed"][ck[1]] == pytest.approx(after, rel=TOL), "1 -> 2"
    assert runs["three"][0]["resumed"][ck[2]] == pytest.approx(after, rel=TOL), "2 -> 3"
    assert runs["three_to_one"] == pytest.approx(after, rel=TOL), "3 -> 1"


def test_one_process_keeps_its_format_and_ranks_write_one_file_each(runs):
    single = runs["single"]
    assert (single / "optimizer.safetensors").is_file()
    assert not list(single.glob("optimizer-rank*"))
    assert "ranks" not in json.loads((single / "state.json").read_text())

    for world in (2, 3):
        root = Path(runs["ck"][world])
        assert sorted(p.name for p in root.iterdir()) == ["step-000002"]  # nothing left over
        folder = root / "step-000002"
        names = sorted(json.loads((folder / "manifest.json").read_text())["files"])
        assert [n for n in names if n.startswith("optimizer")] == [
            *(f"optimizer-rank-{r:05d}-of-{world:05d}.safetensors" for r in range(world)),
            "optimizer-ranks.json"]
        assert "model/model.safetensors" in names and "model/config.json" in names
        layout = json.loads((folder / "optimizer-ranks.json").read_text())
        assert layout["world"] == world
        pieces = layout["tensors"]["master/model.decoder.embed_tokens.weight"]
        assert pieces["numel"] == 256 * 64
        assert len({r for r, _, _ in pieces["pieces"]}) > 1  # the embedding is cut


def test_each_rank_writes_its_own_shard_and_receives_only_the_weights(runs):
    for world in (2, 3):
        saves = [r["save"] for r in runs["two" if world == 2 else "three"]]
        for rank, save in enumerate(saves):
            # Exactly its shard's bytes: no rank writes (or was sent) another's state.
            assert save["optimizer_bytes"] == save["shard_bytes"], (world, rank)
            # What crosses between ranks is the weights, gathered once for the model folder.
            assert save["gathered"] == save["weights"], (world, rank)
            assert (save["model_bytes_written"] > 0) == (rank == 0)
        whole = sum(s["shard_bytes"] for s in saves)
        assert all(s["shard_bytes"] < 1.2 * whole / world for s in saves)


def _refused(folder: Path, match: str) -> None:
    """Loading `folder` in one process raises one line matching `match`, changing nothing."""
    model = build()
    engine = _engine(model)
    before = engine.model_state_dict()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(engine, model, None, _settings(resume=str(folder)))
    assert "\n" not in str(err.value)
    assert match in str(err.value), str(err.value)
    after = engine.model_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert engine.step_count == 0
    engine.close()


def test_a_missing_rank_file_is_refused_naming_it(runs, tmp_path):
    folder = tmp_path / "step-000002"
    shutil.copytree(Path(runs["ck"][2]) / "step-000002", folder)
    (folder / "optimizer-rank-00001-of-00002.safetensors").unlink()
    _refused(folder, "optimizer-rank-00001-of-00002.safetensors is missing")


def _rewrite(folder: Path, name: str, change) -> None:
    """Change file `name` and its manifest entry alike: damage checksums cannot see."""
    path = folder / name
    path.write_text(json.dumps(change(json.loads(path.read_text()))))
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["files"][name] = checkpoint._entry(path)
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_a_rank_layout_that_disagrees_with_the_files_is_refused(runs, tmp_path):
    saved = Path(runs["ck"][2]) / "step-000002"
    key = "exp_avg/model.decoder.embed_tokens.weight"

    def shift(layout: dict) -> dict:
        pieces = layout["tensors"][key]["pieces"]
        pieces[0][2] -= 1  # rank 0's piece one element shorter than its file holds
        pieces[1][1] -= 1
        return layout

    folder = tmp_path / "shifted" / "step-000002"
    shutil.copytree(saved, folder)
    _rewrite(folder, "optimizer-ranks.json", shift)
    _refused(folder, "optimizer-rank-00000-of-00002 holds")

    folder = tmp_path / "world" / "step-000002"
    shutil.copytree(saved, folder)
    _rewrite(folder, "state.json", lambda state: {**state, "ranks": 3})
    _refused(folder, "state.json says 3 ranks wrote it, optimizer-ranks.json 2")


def dies_mid_write(rank: int, world: int, *, ck: str) -> dict:
    """Save after step 1; after step 2 rank 1 dies (as with SIGKILL) while writing its
    shard. Rank 0 returns what its save raised and what the checkpoint folder holds."""
    import os

    model = build()
    engine = _engine(model)
    _steps(engine, rank, world, 1, 1)
    save = save_checkpoint
    save(engine, model, None, _settings(ck), 1)
    _steps(engine, rank, world, 2, 2)
    if rank == 1:
        shard_files.save_file = lambda *args, **kw: os._exit(9)
    started = time.monotonic()
    try:
        save(engine, model, None, _settings(ck), 2)
    except Exception as err:  # noqa: BLE001 - what the test looks at
        return {"error": f"{type(err).__name__}: {err}", "seconds": time.monotonic() - started,
                "left": sorted(p.name for p in Path(ck).iterdir())}
    return {"error": None}


def test_a_rank_dying_mid_write_leaves_the_previous_checkpoint_the_newest(tmp_path):
    ck = tmp_path / "ck"
    survivor, dead = run_ranks(2, "test_checkpoint_ranks.dies_mid_write", tmp_path / "two",
                               may_die=(1,), ck=str(ck))
    assert dead is None
    assert survivor["error"] is not None and survivor["error"].startswith("CollectiveError: "
                                                                          "rank 0 of 2")
    assert survivor["seconds"] < COLLECTIVE_TIMEOUT + 5
    assert survivor["left"] == ["step-000001"]  # rank 0 removed the unfinished folder
    assert find_checkpoint(ck) == ck / "step-000001"
    assert _resume_step(ck) == 1


def _resume_step(ck: Path) -> int:
    model = build()
    engine = _engine(model)
    try:
        return load_checkpoint(engine, model, None, _settings(resume=str(ck)))
    finally:
        engine.close()
