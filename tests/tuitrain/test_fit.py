"""The settings a run starts with, decided by the plan before anything is built: defaults
adapt until the run fits this machine (a simulated device shrinks, then a host budget sends
training state to disk), each choice said in one line; what the user chose and cannot fit
is refused in one line that says what would."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import os
from pathlib import Path

import pytest
import torch

from engine.config import format_size
from engine.planning.planner import plan
from tests.forked import adopt, context
from tuitrain import fit
from tuitrain.events import Failed, Log, Step, Stop
from tuitrain.settings import SIMULATED_DEVICE_BUDGET, Settings
from tuitrain.training_run import TrainingRun

MiB, GiB = 2**20, 2**30
simulated_only = pytest.mark.skipif(torch.cuda.is_available(),
                                    reason="the simulated device's bytes live in host memory")


def settings(model: str = "tiny", **engine) -> Settings:
    """A run whose policy the user chose (auto unless given): what adapts is the rest."""
    engine = {"precision": "fp32", "policy": "auto", **engine}
    return Settings.model_validate({"model": model, "engine": engine,
                                    "training": {"batch_size": 1, "seq_len": 64}})


def settled(monkeypatch, s: Settings, room: int) -> tuple[Settings, list[str]]:
    monkeypatch.setattr(fit, "host_room", lambda: room)
    said: list[str] = []
    return fit.settle(s, said.append), said


def planned(s: Settings, room: int):
    e = s.engine
    return plan(s.model, device_mem=s.device_budget_for(True), host_mem=room, precision="fp32",
                batch_size=1, seq_len=64, simulated=True,
                host_budget=e.host_budget.nbytes if e.host_budget else None,
                disk_dir=e.disk_dir)


def forecast(s: Settings, room: int):
    return planned(s, room).policies[s.engine.policy]


def test_a_run_that_fits_starts_as_asked_and_nothing_is_said(monkeypatch):
    s = settings(policy="cuda", device_budget="256MiB")
    assert settled(monkeypatch, s, 16 * GiB) == (s, [])


def test_a_run_that_fits_only_just_starts_as_asked_and_nothing_is_said(monkeypatch):
    s = settings(policy="cuda", device_budget="256MiB")
    peak = forecast(s, 64 * GiB).host_peak
    assert settled(monkeypatch, s, int(peak / 0.9)) == (s, [])


def test_a_chosen_policy_that_cannot_fit_is_refused_naming_what_would(monkeypatch):
    with pytest.raises(ValueError) as refused:
        settled(monkeypatch, settings(policy="cuda", device_budget="12MiB"), 16 * GiB)
    line = str(refused.value)
    assert "\n" not in line
    assert line.startswith("policy cuda will not fit: ") and "12.0 MiB" in line
    assert "policy auto would (--policy auto" in line


def test_a_chosen_budget_below_the_working_set_is_refused_with_the_minimum(monkeypatch):
    with pytest.raises(ValueError, match="minimum"):
        settled(monkeypatch, settings(policy="cpu", device_budget="1MiB"), 16 * GiB)


@simulated_only
def test_the_default_simulated_device_shrinks_to_whole_mib_beside_the_host_copies(monkeypatch):
    result = planned(settings("opt-125m", device_budget=SIMULATED_DEVICE_BUDGET), 64 * GiB)
    # Short of half what auto holds on the simulated device beyond the working set.
    room = result.auto.host_peak - (result.auto.device_peak - result.working_set) // 2
    s, said = settled(monkeypatch, settings("opt-125m"), room)
    budget = s.engine.device_budget.nbytes
    assert budget % MiB == 0 and budget < SIMULATED_DEVICE_BUDGET
    assert s.engine.host_budget is None  # the host holds the state: no disk
    assert forecast(s, room).fits and forecast(s, room).host_peak <= room
    assert len(said) == 1 and said[0].startswith(f"simulated device budget {budget // MiB}.0 MiB")


@simulated_only
def test_state_that_cannot_fit_the_host_goes_to_disk_under_a_chosen_host_budget(monkeypatch,
                                                                                 tmp_path):
    # opt-125m's fp32 state is about 1.9 GiB, and auto holds about 0.9 GiB on the simulated
    # device; this machine "has" 2.5 GiB for the run.
    room = 5 * GiB // 2
    s, said = settled(monkeypatch, settings("opt-125m", disk_dir=str(tmp_path)), room)
    chosen = forecast(s, room)
    assert s.engine.host_budget is not None and chosen.fits and chosen.disk_bytes > 0
    assert chosen.host_peak <= room
    assert len(said) == 1
    assert said[0].startswith(f"host budget {format_size(s.engine.host_budget.nbytes)}")
    assert "goes to disk under" in said[0]


@simulated_only
def test_a_chosen_host_budget_is_kept_and_one_too_small_is_refused(monkeypatch, tmp_path):
    s = settings("opt-125m", host_budget="1GiB", disk_dir=str(tmp_path))
    assert settled(monkeypatch, s, 16 * GiB) == (s, [])
    # The disk tier's I/O pieces shrink to the budget (804 KiB for opt-125m at the least).
    with pytest.raises(ValueError, match="host budget 256.0 KiB is below"):
        settled(monkeypatch, settings("opt-125m", host_budget="256KiB", disk_dir=str(tmp_path)),
                16 * GiB)


@simulated_only
def test_a_policy_left_unset_takes_the_plans_recommendation_and_a_chosen_one_is_kept(
        monkeypatch, tmp_path):
    unset = Settings.model_validate({"model": "opt-125m", "engine": {
        "precision": "fp32", "device_budget": "6GiB", "disk_dir": str(tmp_path)},
        "training": {"batch_size": 1, "seq_len": 64}})
    roomy = planned(unset, 64 * GiB)
    # Room for the least host peak of the policies (on the simulated device, cuda's: its
    # chunks live in the device's bytes alone), not for auto's: auto would send state to
    # disk, the plan's choice needs none.
    room = (min(p.host_peak for p in roomy.policies.values()) + roomy.auto.host_peak) // 2
    best = planned(unset, room).recommended.policy
    assert best not in (None, "auto")
    s, said = settled(monkeypatch, unset, room)
    assert s.engine.policy == best and s.engine.host_budget is None
    assert forecast(s, room).fits
    assert said[0].startswith(f"policy {best}: the plan's choice for this machine (")
    chosen = settings("opt-125m", device_budget="6GiB", disk_dir=str(tmp_path))
    kept, said = settled(monkeypatch, chosen, room)
    assert kept.engine.policy == "auto" and not any(line.startswith("policy") for line in said)


def test_a_policy_is_chosen_once_given_by_a_flag_or_a_preset_and_stays_chosen(tmp_path):
    from tuitrain.presets import load_preset, merge

    assert not merge(Settings(), {"engine.margin_ratio": 0.5}).policy_chosen
    assert merge(Settings(), {"engine.policy": "auto"}).policy_chosen
    preset = tmp_path / "p.yaml"
    preset.write_text("version: 1\nengine:\n  policy: cpu\n")
    assert merge(load_preset(preset), {"training.steps": 3}).policy_chosen
    preset.write_text("version: 1\nengine:\n  margin_ratio: 0.5\n")
    assert not merge(load_preset(preset), {"training.steps": 3}).policy_chosen


def ranks_settings(model: str = "tiny", batch_size: int = 4, **engine) -> Settings:
    engine = {"policy": "auto", **engine}  # chosen, as in `settings`
    return Settings.model_validate({"model": model, "engine": {"precision": "fp32", **engine},
                                    "training": {"batch_size": batch_size, "seq_len": 64}})


def test_data_parallel_ranks_settle_with_the_plan_of_one_rank(monkeypatch):
    """A budget below what one process needs for the global batch, but above what each of
    two ranks needs for half of it (and half of each chunk): refused for one process,
    kept for two."""
    one = plan("tiny", device_mem="6GiB", host_mem=16 * GiB, precision="fp32", batch_size=4,
               seq_len=64, simulated=True)
    two = plan("tiny", device_mem="6GiB", host_mem=16 * GiB, precision="fp32", batch_size=4,
               seq_len=64, simulated=True, nproc=2)
    budget = (one.working_set + two.working_set) // 2
    s = ranks_settings(policy="cpu", device_budget=budget)
    with pytest.raises(ValueError, match="minimum working set"):
        settled(monkeypatch, s, 16 * GiB)
    monkeypatch.setattr(fit, "host_room", lambda ranks=1: 16 * GiB)
    said: list[str] = []
    assert fit.settle(s, said.append, nproc=2) == s and said == []


def test_ranks_that_cannot_fit_are_refused_with_the_per_rank_numbers(monkeypatch):
    monkeypatch.setattr(fit, "host_room", lambda ranks=1: 16 * GiB)
    # Each rank's working set is about 15 MiB, and its shards with the working set 20 MiB.
    with pytest.raises(ValueError) as refused:
        fit.settle(ranks_settings(policy="cuda", device_budget="17MiB"), print, nproc=2)
    line = str(refused.value)
    assert line.startswith("policy cuda will not fit: needs ") and "model data shards" in line
    assert "\n" not in line and "17.0 MiB" in line
    assert "would (--policy " in line


@simulated_only
def test_the_simulated_device_of_every_rank_shrinks_beside_all_the_ranks_host_copies(
        monkeypatch):
    def per_rank(device: int, room: int):
        return plan("opt-125m", device_mem=device, host_mem=room, precision="fp32",
                    batch_size=2, seq_len=64, simulated=True, nproc=2)

    result = per_rank(SIMULATED_DEVICE_BUDGET, 64 * GiB)
    # Short of what auto holds on both ranks' simulated devices beyond the working set.
    room = result.auto.machine_host_peak - (result.auto.device_peak - result.working_set)
    assert result.auto.host_peak <= room  # one rank alone would fit
    monkeypatch.setattr(fit, "host_room", lambda ranks=1: room if ranks == 2 else 64 * GiB)
    said: list[str] = []
    s = fit.settle(ranks_settings("opt-125m", batch_size=2), said.append, nproc=2)
    budget = s.engine.device_budget.nbytes
    assert budget % MiB == 0 and budget < SIMULATED_DEVICE_BUDGET
    assert s.engine.host_budget is None  # the shrunk device is enough: nothing to disk
    chosen = per_rank(budget, room).auto
    assert chosen.fits and chosen.machine_host_peak <= room
    assert len(said) == 1
    assert said[0].startswith(f"simulated device budget {budget // MiB}.0 MiB per rank: ")
    assert said[0].endswith("beside the host's copies of 2 ranks")


@simulated_only
def test_ranks_on_other_machines_do_not_count_against_this_ones_memory(monkeypatch):
    """Two ranks, one per machine (torchrun --nnodes 2): each machine holds one rank's peak,
    which fits, where two ranks on one machine would not."""
    result = plan("opt-125m", device_mem=SIMULATED_DEVICE_BUDGET, host_mem=64 * GiB,
                  precision="fp32", batch_size=2, seq_len=64, simulated=True, nproc=2)
    # Short of what auto holds on both ranks' simulated devices beyond the working set.
    room = result.auto.machine_host_peak - (result.auto.device_peak - result.working_set)
    assert result.auto.host_peak < room  # one rank alone fits
    monkeypatch.setattr(fit, "host_room", lambda ranks=1: room)
    s = ranks_settings("opt-125m", batch_size=2)
    said: list[str] = []
    assert fit.settle(s, said.append, nproc=2, local=1) == s and said == []
    shrunk = fit.settle(s, said.append, nproc=2, local=2)
    assert shrunk.engine.device_budget.nbytes < SIMULATED_DEVICE_BUDGET
    assert said[0].endswith("beside the host's copies of 2 ranks")


@simulated_only
def test_ranks_whose_state_does_not_fit_this_machine_each_get_a_host_budget(monkeypatch,
                                                                           tmp_path):
    """Two ranks with their devices chosen, on a machine short of half their chunk bytes:
    each rank gets the same host budget, and its shard's rest goes to its own disk folder."""
    def per_rank(host_budget: int | None):
        return plan("opt-125m", device_mem="1GiB", host_mem=64 * GiB, precision="fp32",
                    batch_size=2, seq_len=64, simulated=True, nproc=2,
                    host_budget=host_budget, disk_dir=tmp_path)

    roomy = per_rank(None).auto
    room = roomy.machine_host_peak - roomy.host_model  # each rank short of half its chunks
    monkeypatch.setattr(fit, "host_room", lambda ranks=1: room)
    said: list[str] = []
    s = fit.settle(ranks_settings("opt-125m", batch_size=2, device_budget="1GiB",
                                  disk_dir=str(tmp_path)), said.append, nproc=2)
    budget = s.engine.host_budget.nbytes
    chosen = per_rank(budget).auto
    assert chosen.fits and chosen.disk_bytes > 0 and chosen.machine_host_peak <= room
    assert said[0].startswith(f"host budget {format_size(budget)} per rank: ")
    assert f"of training state per rank goes to disk under {tmp_path}" in said[0]


def _settle_as_rank(rank: int, store: str, out: str, rooms: list[int],
                    environ: dict[str, str]) -> None:
    """A rank that joined the others, whose reading of the machine's room is its own.
    Forked from the tests' server (tests/forked.py), with the test's environment."""
    adopt(environ)
    torch.set_num_threads(1)
    import torch.distributed as dist

    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=len(rooms), timeout=datetime.timedelta(seconds=60))
        fit.host_room = lambda ranks=1: rooms[rank]
        said: list[str] = []
        s = fit.settle(ranks_settings("opt-125m", batch_size=2), said.append, nproc=len(rooms))
        result = {"budget": s.engine.device_budget.nbytes, "said": said}
        dist.destroy_process_group()
    except BaseException as error:  # noqa: BLE001 - reported to the test
        result = {"error": repr(error)}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    os._exit(0)


@simulated_only
def test_ranks_that_found_different_room_settle_alike_on_the_least(monkeypatch, tmp_path):
    result = plan("opt-125m", device_mem=SIMULATED_DEVICE_BUDGET, host_mem=64 * GiB,
                  precision="fp32", batch_size=2, seq_len=64, simulated=True, nproc=2)
    least = result.auto.machine_host_peak - (result.auto.device_peak - result.working_set)
    rooms = [least + 64 * MiB, least]  # read at other moments, other processes coming and going
    procs = [context().Process(target=_settle_as_rank,
                               args=(r, str(tmp_path / "store"), str(tmp_path), rooms,
                                     dict(os.environ))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        if p.is_alive():
            p.kill()
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert all("error" not in g for g in got), got
    monkeypatch.setattr(fit, "host_room", lambda ranks=1: least)
    alone = fit.settle(ranks_settings("opt-125m", batch_size=2), print, nproc=2)
    assert got[0] == got[1]
    assert got[0]["budget"] == alone.engine.device_budget.nbytes < SIMULATED_DEVICE_BUDGET


class Sink(list):
    def put(self, event) -> None:
        self.append(event)


def test_every_run_keeps_the_heap_steady_however_much_memory_is_free(tmp_path, monkeypatch):
    """So that its host peak is the plan's (engine.devices.host_memory), and nothing is
    said of it: the simulated device's kept buffers make it cost nothing measurable."""
    calls: list[int] = []
    monkeypatch.setattr("engine.devices.host_memory.steady_heap", lambda: calls.append(1))
    commands, sender = multiprocessing.Pipe(duplex=False)
    sender.send(Stop(id=1))
    sink = Sink()
    run = TrainingRun(settings=settings(policy="cpu", device_budget="256MiB"),
                      log_path=str(tmp_path / "log"), commands=commands, outbox=sink)
    run.execute()
    assert calls == [1]
    assert not any("steady" in e.message for e in sink if isinstance(e, Log))


def test_a_run_that_cannot_fit_is_refused_before_its_model_is_built(tmp_path):
    commands, sender = multiprocessing.Pipe(duplex=False)
    sender.send(Stop(id=1))
    s = settings(policy="cuda", device_budget="12MiB")
    s.logging.metrics = str(tmp_path / "m.jsonl")
    sink = Sink()
    run = TrainingRun(settings=s, log_path=str(tmp_path / "log"), commands=commands,
                      outbox=sink)
    assert run.execute() == 2
    said = [e.message for e in sink if isinstance(e, Log)]
    assert not any(m.startswith("building") for m in said), said
    assert not (tmp_path / "m.jsonl").exists()  # nothing written either


def run_cuda_with_micro_batches(tmp_path, short: int) -> tuple[int, Sink]:
    """A run of tiny under cuda in two micro-batches, given `short` bytes less than the
    plan's figure: the second micro-batch's peak, whose forward runs beside every gradient
    of the first."""
    need = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision="fp32", batch_size=1,
                seq_len=64, grad_accum=2, simulated=True).cuda.device_peak
    s = Settings.model_validate({
        "model": "tiny",
        "engine": {"precision": "fp32", "policy": "cuda", "device_budget": need - short},
        "training": {"batch_size": 1, "seq_len": 64, "grad_accum": 2, "steps": 2}})
    commands, _ui = multiprocessing.Pipe(duplex=False)
    sink = Sink()
    run = TrainingRun(settings=s, log_path=str(tmp_path / "log"), commands=commands,
                      outbox=sink)
    return run.execute(), sink


def test_cuda_with_micro_batches_trains_in_the_budget_the_plan_gives(tmp_path):
    status, sink = run_cuda_with_micro_batches(tmp_path, 0)
    assert (status, [e for e in sink if isinstance(e, Failed)]) == (0, [])
    assert [e.stats.micro_batches for e in sink if isinstance(e, Step)] == [2, 2]


def test_cuda_with_micro_batches_a_byte_short_is_refused_before_anything_is_built(tmp_path):
    """In one line, with what would fit, and never a run that fails in its first step."""
    status, sink = run_cuda_with_micro_batches(tmp_path, 1)
    assert status == 2
    (refusal,) = [e for e in sink if isinstance(e, Failed)]
    assert "\n" not in refusal.reason
    assert refusal.reason.startswith("policy cuda will not fit: ")
    assert "policy auto would (--policy auto" in refusal.reason
    said = [e.message for e in sink if isinstance(e, Log)]
    assert not any(m.startswith("building") for m in said), said
