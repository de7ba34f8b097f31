"""The planner: what `plan` forecasts before a run is what the engine then measures.

Forecasts are checked against real engine steps on the simulated device (the device peak of
a steady step, the host chunk bytes, the working set), under each policy, precision, tight
budgets, margins and activation checkpointing; then the large-model answers, which must come
in seconds without allocating anything. (The host peak against real processes:
test_host_peak_fresh.py.)
"""

from __future__ import annotations

import json
import shutil
import time
from functools import cache

import psutil
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from engine import Engine, EngineConfig, StepStats, format_size
from engine.chunks.spill import ScratchTooSmall
from engine.models.zoo import BadCheckpoint, UnknownModel, build_model
from engine.placement import disk_rules, rules
from engine.planning import planner as planner_module
from engine.planning.host_memory import RUNTIME_BYTES
from engine.planning.planner import plan
from engine.step.engine import BudgetTooSmall

SHAPE = {"batch_size": 2, "seq_len": 64}
MiB = 2**20
# The forecast replays the engine's own rules on the engine's own layout, so it is exact up
# to a few bytes per layer norm (the meta device keeps their statistics in fp32, the CPU in
# the compute dtype). 2% leaves room for that and nothing else.
EXACT = 0.02


def engine_steps(
    model: torch.nn.Module,
    *,
    policy: str,
    precision: str,
    budget: int | str,
    margin: float = 0.0,
    steps: int = 2,
) -> tuple[StepStats, Engine]:
    """Run `steps` steps of SHAPE batches on the simulated device; the last step's stats."""
    engine = Engine(
        model,
        EngineConfig(
            policy=policy,
            margin_ratio=margin,
            device_budget=budget,
            precision=precision,
            simulate=True,
        ),
    )
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(
            0, model.config.vocab_size, (SHAPE["batch_size"], SHAPE["seq_len"]), generator=g
        )
        stats = engine.step({"input_ids": ids, "labels": ids})
    return stats, engine


def tiny_steps(**kwargs) -> tuple[StepStats, Engine]:
    return engine_steps(build_model("tiny"), **kwargs)


# --- the forecast is what the engine measures ---------------------------------------------


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("policy", ["cuda", "cpu", "auto"])
def test_tiny_device_peak_and_host_bytes_are_what_the_engine_measures(policy, precision):
    forecast = plan(
        "tiny", device_mem="6GiB", host_mem="64GiB", precision=precision, simulated=True, **SHAPE
    )
    stats, engine = tiny_steps(policy=policy, precision=precision, budget="6GiB")
    row = forecast.policies[policy]
    assert row.fits, row.reason
    assert row.device_peak == pytest.approx(stats.memory.device_peak, rel=EXACT)
    assert row.host_model == stats.memory.host_model  # same layout, same tensors: exact
    assert row.copied == stats.bytes_h2d + stats.bytes_d2h
    assert forecast.working_set == pytest.approx(engine.trace.working_set, rel=EXACT)
    assert forecast.non_model_peak == pytest.approx(engine.trace.non_model_peak, rel=EXACT)
    assert forecast.chunks == len(engine.chunks)
    assert forecast.chunk_size == engine.chunk_size


@pytest.mark.parametrize(
    ("policy", "margin"), [("cpu", 0.0), ("auto", 0.0), ("auto", 0.5), ("cpu", 1.0)]
)
def test_a_tight_budget_and_a_margin_are_forecast_like_the_engine_places_them(policy, margin):
    budget = 20 * MiB  # above the working set (about 15.5 MiB), far below the whole model
    forecast = plan(
        "tiny",
        device_mem=budget,
        host_mem="64GiB",
        precision="bf16",
        simulated=True,
        margin_ratio=margin,
        **SHAPE,
    )
    stats, _ = tiny_steps(policy=policy, precision="bf16", budget=budget, margin=margin)
    row = forecast.policies[policy]
    assert row.fits, row.reason
    assert row.device_peak == pytest.approx(stats.memory.device_peak, rel=EXACT)
    assert row.device_peak <= budget
    assert row.host_model == stats.memory.host_model
    assert row.copied == stats.bytes_h2d + stats.bytes_d2h


@pytest.mark.parametrize(("policy", "budget"), [("cpu", 6 * 1024 * MiB), ("auto", 20 * MiB)])
def test_the_fetches_ahead_of_use_are_the_replays_byte_for_byte(policy, budget):
    """What the simulated device's copy thread fetches beside the step, which the time
    model overlaps with compute, is what the plan's replay says."""
    forecast = plan("tiny", device_mem=budget, host_mem="64GiB", precision="bf16",
                    simulated=True, **SHAPE)
    _, engine = tiny_steps(policy=policy, precision="bf16", budget=budget)
    ahead = []
    copy_ahead = engine.device.copy_ahead

    def spy(dst, src, *, src_kept=False):
        if src_kept:
            ahead.append(src.nbytes)
        return copy_ahead(dst, src, src_kept=src_kept)

    engine.device.copy_ahead = spy
    ids = torch.randint(0, engine.model.config.vocab_size,
                        (SHAPE["batch_size"], SHAPE["seq_len"]), generator=torch.Generator())
    engine.step({"input_ids": ids, "labels": ids})
    engine.close()
    assert sum(ahead) == forecast.policies[policy].prefetched
    assert forecast.policies[policy].prefetched > 0


def test_activation_checkpointing_is_forecast_with_its_recomputation():
    forecast = plan(
        "tiny",
        device_mem="6GiB",
        host_mem="64GiB",
        precision="bf16",
        checkpointing=True,
        simulated=True,
        **SHAPE,
    )
    plain = plan(
        "tiny", device_mem="6GiB", host_mem="64GiB", precision="bf16", simulated=True, **SHAPE
    )
    model = build_model("tiny")
    model.activation_checkpointing_enable()  # what gradient_checkpointing_enable() does
    stats, engine = engine_steps(model, policy="auto", precision="bf16", budget="6GiB")
    assert forecast.auto.device_peak == pytest.approx(stats.memory.device_peak, rel=EXACT)
    assert forecast.working_set == pytest.approx(engine.trace.working_set, rel=EXACT)
    assert forecast.non_model_peak < plain.non_model_peak


def test_a_model_folder_of_another_architecture_is_forecast_from_its_config(tmp_path):
    """Llama: grouped-query attention, rotary embeddings, untied head, no biases."""
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    config.save_pretrained(tmp_path)  # the planner reads config.json alone
    forecast = plan(
        str(tmp_path),
        device_mem="6GiB",
        host_mem="64GiB",
        precision="fp32",
        simulated=True,
        **SHAPE,
    )
    torch.manual_seed(0)
    stats, engine = engine_steps(
        LlamaForCausalLM(config), policy="cpu", precision="fp32", budget="6GiB"
    )
    assert forecast.cpu.device_peak == pytest.approx(stats.memory.device_peak, rel=EXACT)
    assert forecast.working_set == pytest.approx(engine.trace.working_set, rel=EXACT)
    assert forecast.cpu.host_model == stats.memory.host_model


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_deep_model_is_planned_from_three_traced_layers_exactly(monkeypatch, checkpointing):
    """The inner layer repeated in the recording gives what tracing every layer gives."""
    kwargs = {
        "device_mem": "1GiB",
        "host_mem": "64GiB",
        "precision": "bf16",
        "simulated": True,
        "checkpointing": checkpointing,
        **SHAPE,
    }
    repeated = plan("opt-125m", **kwargs)
    monkeypatch.setattr(planner_module, "TRACE_LAYERS", 12)  # opt-125m has 12: trace them all
    traced = plan("opt-125m", **kwargs)
    assert repeated.to_dict() == traced.to_dict()


# --- will it fit --------------------------------------------------------------------------


def test_a_budget_below_the_working_set_fits_no_policy_and_says_the_numbers():
    forecast = plan(
        "tiny", device_mem="4MiB", host_mem="64GiB", precision="bf16", simulated=True, **SHAPE
    )
    for row in forecast.policies.values():
        assert not row.fits
        assert "4.0 MiB" in row.reason
    for row in (forecast.cpu, forecast.auto):
        assert "working set" in row.reason
        assert format_size(forecast.working_set) in row.reason
        assert row.device_peak >= forecast.working_set  # what it would need
    assert "on the device" in forecast.cuda.reason
    assert forecast.recommended.policy is None
    assert "nothing fits" in forecast.recommended.why
    with pytest.raises(BudgetTooSmall):  # and the engine agrees
        tiny_steps(policy="cpu", precision="bf16", budget=4 * MiB, steps=1)


def test_cuda_is_refused_when_the_whole_model_does_not_fit_beside_the_activations():
    budget = 20 * MiB
    forecast = plan(
        "tiny", device_mem=budget, host_mem="64GiB", precision="bf16", simulated=True, **SHAPE
    )
    assert not forecast.cuda.fits
    assert "needs" in forecast.cuda.reason and "20.0 MiB" in forecast.cuda.reason
    assert forecast.cuda.device_peak > budget
    assert forecast.cpu.fits and forecast.auto.fits
    with pytest.raises(BudgetTooSmall):
        tiny_steps(policy="cuda", precision="bf16", budget=budget, steps=1)


def test_too_little_host_memory_is_reported_with_what_it_takes():
    forecast = plan(
        "tiny", device_mem="6GiB", host_mem="100MiB", precision="bf16", simulated=True, **SHAPE
    )
    for row in forecast.policies.values():
        assert not row.fits
        assert "host memory" in row.reason and "100.0 MiB" in row.reason
        assert row.host_peak > RUNTIME_BYTES
    assert forecast.recommended.policy is None


def test_on_the_simulated_device_its_bytes_count_as_host_memory():
    """Longer sequences mean more activations: host memory too when the device is simulated."""
    common = {"device_mem": "6GiB", "host_mem": "64GiB", "precision": "bf16", "batch_size": 2}
    short_sim = plan("tiny", seq_len=64, simulated=True, **common)
    long_sim = plan("tiny", seq_len=256, simulated=True, **common)
    short_real = plan("tiny", seq_len=64, simulated=False, **common)
    long_real = plan("tiny", seq_len=256, simulated=False, **common)
    grown = long_sim.auto.device_peak - short_sim.auto.device_peak
    assert grown > 0
    assert long_sim.auto.host_peak - short_sim.auto.host_peak >= grown
    assert long_real.auto.host_peak == short_real.auto.host_peak
    # A GPU's allocator sees the gradients in flight too; the simulated count does not.
    assert long_real.auto.device_peak > long_sim.auto.device_peak
    assert (
        "simulated device"
        in plan("tiny", seq_len=64, simulated=True, **{**common, "host_mem": "1MiB"}).cpu.reason
    )


# --- the recommendation -------------------------------------------------------------------


def test_a_model_that_fits_whole_is_recommended_cuda():
    forecast = plan("tiny", device_mem="6GiB", host_mem="64GiB", simulated=True, **SHAPE)
    assert forecast.recommended.policy == "cuda"
    assert forecast.recommended.margin_ratio == 0.0


def test_between_the_working_set_and_the_whole_model_auto_gets_a_margin_that_runs():
    budget = 20 * MiB
    forecast = plan(
        "tiny", device_mem=budget, host_mem="64GiB", precision="bf16", simulated=True, **SHAPE
    )
    rec = forecast.recommended
    assert rec.policy == "auto"
    assert 0.0 < rec.margin_ratio <= 1.0
    assert "chunks on the device" in rec.why
    stats, _ = tiny_steps(policy="auto", precision="bf16", budget=budget, margin=rec.margin_ratio)
    assert stats.memory.device_peak <= budget
    assert stats.memory.host_model < forecast.auto.host_model  # optimizer state moved over
    assert stats.bytes_h2d + stats.bytes_d2h < forecast.auto.copied  # and it copies less


# --- large models: seconds, nothing allocated -----------------------------------------------


def test_opt_30b_is_planned_in_seconds_without_allocating():
    before = psutil.Process().memory_info().rss
    # CPU time of this process: other processes sharing the machine do not count.
    start = time.process_time()
    forecast = plan(
        "opt-30b", device_mem="24GiB", host_mem="64GiB", precision="bf16", simulated=False
    )
    elapsed = time.process_time() - start
    grown = psutil.Process().memory_info().rss - before
    assert elapsed < 10, f"{elapsed:.1f} s"
    assert grown < 512 * MiB, format_size(grown)
    n = forecast.parameters
    assert 29e9 < n < 31e9
    # 14 bytes per parameter in bf16 (payload, fp32 master, two moments) live on the host.
    assert 14 * n <= forecast.cpu.host_peak <= 16 * n
    assert not forecast.cpu.fits and "host memory" in forecast.cpu.reason
    assert forecast.cpu.device_peak < 24 * 2**30  # the device side alone would fit
    assert not forecast.cuda.fits and "on the device" in forecast.cuda.reason
    assert forecast.cuda.device_peak >= 16 * n  # resident: payload, gradients, fp32 state
    assert forecast.recommended.policy is None


# --- bad input ----------------------------------------------------------------------------


def test_bad_input_raises_the_errors_the_command_line_reports():
    with pytest.raises(UnknownModel):
        plan("opt-9b", device_mem="6GiB", host_mem="8GiB")
    with pytest.raises(ValueError, match="not a size"):
        plan("tiny", device_mem="six", host_mem="8GiB")
    with pytest.raises(ValueError, match="precision"):
        plan("tiny", device_mem="6GiB", host_mem="8GiB", precision="fp4")
    with pytest.raises(ValueError, match="positions"):
        plan("tiny", device_mem="6GiB", host_mem="8GiB", seq_len=4096)
    with pytest.raises(ValueError, match="margin_ratio"):
        plan("tiny", device_mem="6GiB", host_mem="8GiB", margin_ratio=1.5)


def test_a_folder_whose_config_is_not_a_language_model_is_a_bad_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vit"}))
    with pytest.raises(BadCheckpoint):
        plan(str(tmp_path), device_mem="6GiB", host_mem="8GiB")


# --- the disk tier: a host budget ------------------------------------------------------------

# Elements per piece of disk I/O for tiny: small enough that its I/O buffers leave room for
# a host budget below its chunks (at the default 4M elements they alone outweigh tiny),
# and that its chunks go in several pieces.
TINY_PIECE = 2**14


@pytest.fixture
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(disk_rules, "DISK_PIECE", TINY_PIECE)
    return TINY_PIECE


@cache  # a plan each time otherwise, for the same answer
def host_state(model: str, precision: str) -> int:
    """Chunk bytes on the host with no budget and nothing resident."""
    return plan(model, device_mem="6GiB", host_mem="64GiB", precision=precision,
                simulated=True, **SHAPE).model_bytes


def disk_steps(model: torch.nn.Module, *, policy: str, precision: str, budget: int | str,
               host_budget: int, disk_dir, margin: float = 0.0, steps: int = 3
               ) -> tuple[StepStats, Engine, tuple[int, int]]:
    """Like engine_steps, under a host budget; also the bytes the disk tier read and wrote
    in the last step, counted on the tier once its update is done (a step's own counters
    miss what an update overlapping the next step issues between the two)."""
    engine = Engine(model, EngineConfig(
        policy=policy, margin_ratio=margin, device_budget=budget, precision=precision,
        host_budget=host_budget, disk_dir=disk_dir, simulate=True))
    spill = engine.manager.spill  # none under cuda: every chunk lives on the device

    def moved() -> tuple[int, int]:
        return (spill.tier.bytes_read, spill.tier.bytes_written) if spill else (0, 0)

    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size,
                            (SHAPE["batch_size"], SHAPE["seq_len"]), generator=g)
        before = moved()
        stats = engine.step({"input_ids": ids, "labels": ids})
        engine.manager.flight.wait()
    after = moved()
    return stats, engine, (after[0] - before[0], after[1] - before[1])


def levels(engine: Engine) -> set[int]:
    return {c.disk_level for c in engine.chunks}


# Host budgets as a share of the chunks' host bytes: "state" sends optimizer state of some
# chunks to disk, "payload" every chunk's state and some payloads too (the state is 8 of
# fp32's 16 B/param, 12 of bf16's 14).
SHARE = {"state": 0.8, "payload": 0.12}


@pytest.mark.parametrize(
    ("precision", "policy", "level", "device", "margin"),
    [
        ("fp32", "cpu", "state", "6GiB", 0.0),
        ("fp32", "cpu", "payload", "6GiB", 0.0),
        ("bf16", "cpu", "state", "6GiB", 0.0),
        ("bf16", "cpu", "payload", "6GiB", 0.0),
        ("bf16", "auto", "payload", 20 * MiB, 0.0),  # evictions, prefetches from disk
        ("fp32", "auto", "payload", 20 * MiB, 0.5),  # the margin keeps some chunks resident
        ("fp32", "cuda", "payload", "6GiB", 0.0),  # nothing on the host, nothing on disk
    ],
)
def test_the_disk_tier_is_forecast_byte_for_byte(small_pieces, tmp_path, precision, policy,
                                                 level, device, margin):
    host_budget = int(SHARE[level] * host_state("tiny", precision))
    forecast = plan("tiny", device_mem=device, host_mem="64GiB", precision=precision,
                    simulated=True, margin_ratio=margin, host_budget=host_budget,
                    disk_dir=tmp_path, **SHAPE)
    stats, engine, (read, written) = disk_steps(
        build_model("tiny"), policy=policy, precision=precision, budget=device,
        host_budget=host_budget, disk_dir=tmp_path, margin=margin)
    if policy != "cuda":
        if level == "state":
            assert 1 in levels(engine) and 2 not in levels(engine)
        else:
            assert 2 in levels(engine)
    row, memory = forecast.policies[policy], stats.memory
    assert row.fits, row.reason
    assert row.disk_bytes == memory.disk_model  # what the scratch folder holds, exactly
    assert row.host_model == memory.host_model
    assert row.io_buffers == memory.host_io_buffers
    assert row.host_model + row.io_buffers <= host_budget
    assert (row.disk_read, row.disk_written) == (read, written)
    assert row.copied == stats.bytes_h2d + stats.bytes_d2h
    assert row.device_peak == pytest.approx(memory.device_peak, rel=EXACT)
    # What the engine checks the folder's free space against, whatever the policy.
    assert forecast.disk_needed == engine.manager.disk_placement(set()).disk_bytes > 0
    assert forecast.disk_free > forecast.disk_needed
    if policy == "cuda":
        assert row.disk_bytes == row.disk_read == row.disk_written == 0
        assert engine.manager.spill is None and not any(tmp_path.iterdir())
    else:
        assert row.disk_bytes > 0 and row.disk_read > 0 and row.disk_written > 0
    engine.close()


@pytest.mark.parametrize(("precision", "accum"), [("fp32", 2), ("bf16", 3)])
def test_accumulation_under_a_host_budget_is_forecast_byte_for_byte(
        small_pieces, tmp_path, precision, accum):
    """The memory of one micro-batch whatever their number, the host budget's included;
    the disk traffic of all of them: later micro-batches fetch from the master and add
    their gradients to those on disk."""
    host_budget = int(SHARE["payload"] * host_state("tiny", precision))
    forecast = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision=precision,
                    simulated=True, host_budget=host_budget, disk_dir=tmp_path,
                    grad_accum=accum, **SHAPE)
    engine = Engine(build_model("tiny"), EngineConfig(
        policy="cpu", device_budget="6GiB", precision=precision, host_budget=host_budget,
        disk_dir=tmp_path, simulate=True, grad_accum=accum))
    assert 2 in levels(engine)
    tier, peak = engine.manager.spill.tier, [0]
    inner = engine.manager.on_change

    def sample() -> None:
        peak[0] = max(peak[0], engine.manager.host_bytes + engine.manager.io_buffer_bytes)
        inner()

    engine.manager.on_change = sample
    # The bytes moved from the update's start (what the step waits for, less the state read
    # ahead while it ran) to its end.
    update_started = []
    make_pipeline = engine.manager.update_pipeline

    def pipeline(chunks):
        made = make_pipeline(chunks)
        start = made.start

        def started() -> None:
            update_started.append((tier.bytes_read, tier.bytes_written))
            start()

        made.start = started
        return made

    engine.manager.update_pipeline = pipeline
    # What the tier reads from the second micro-batch's start to the update's.
    later_started: list[int] = []
    begin = engine.runner.begin

    def began(shape, **how):
        if how.get("accumulate") and len(later_started) < len(update_started) + 1:
            later_started.append(tier.bytes_read)
        return begin(shape, **how)

    engine.runner.begin = began
    g = torch.Generator().manual_seed(0)
    for _ in range(2):
        ids = torch.randint(0, 512, (accum * SHAPE["batch_size"], SHAPE["seq_len"]),
                            generator=g)
        before = tier.bytes_read, tier.bytes_written
        stats = engine.step({"input_ids": ids, "labels": ids})
        engine.manager.flight.wait()
    update = tier.bytes_read + tier.bytes_written - sum(update_started[-1])
    row = forecast.cpu
    assert forecast.grad_accum == forecast.to_dict()["grad_accum"] == accum
    assert row.fits, row.reason
    assert row.host_model + row.io_buffers <= host_budget
    assert 0 < peak[0] <= host_budget
    assert row.host_model == stats.memory.host_model
    assert (row.disk_read, row.disk_written) == (tier.bytes_read - before[0],
                                                 tier.bytes_written - before[1])
    assert row.disk_update == update > 0
    # The later micro-batches read what the first sent to disk: masters, or gradients, and
    # the payloads of chunks holding gradients, which are not read ahead; under cpu every
    # chunk holds them, so they read nothing beside: all of it in line.
    assert 0 < row.disk_later_read < row.disk_read
    assert row.disk_later_read == update_started[-1][0] - later_started[-1]
    engine.close()


@pytest.mark.parametrize("level", ["state", "payload"])
def test_a_small_opt_model_folder_is_forecast_byte_for_byte_under_a_host_budget(
        small_pieces, tmp_path, level):
    config = OPTConfig(vocab_size=256, hidden_size=128, num_hidden_layers=8,
                       num_attention_heads=4, ffn_dim=512, max_position_embeddings=128,
                       word_embed_proj_dim=128, dropout=0.0, attention_dropout=0.0)
    folder = tmp_path / "opt-small"
    config.save_pretrained(folder)
    host_budget = int(SHARE[level] * host_state(str(folder), "fp32"))
    forecast = plan(str(folder), device_mem="6GiB", host_mem="64GiB", precision="fp32",
                    simulated=True, host_budget=host_budget, disk_dir=tmp_path / "scratch",
                    **SHAPE)
    torch.manual_seed(0)
    stats, engine, (read, written) = disk_steps(
        OPTForCausalLM(config), policy="cpu", precision="fp32", budget="6GiB",
        host_budget=host_budget, disk_dir=tmp_path / "scratch")
    row = forecast.cpu
    assert row.fits, row.reason
    assert (row.disk_bytes, row.host_model, row.io_buffers) == (
        stats.memory.disk_model, stats.memory.host_model, stats.memory.host_io_buffers)
    assert (row.disk_read, row.disk_written) == (read, written)
    assert row.device_peak == pytest.approx(stats.memory.device_peak, rel=EXACT)
    engine.close()


def test_a_host_budget_that_holds_every_chunk_sends_nothing_to_disk(tmp_path):
    forecast = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision="bf16",
                    simulated=True, host_budget="1GiB", disk_dir=tmp_path, **SHAPE)
    plain = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision="bf16",
                 simulated=True, **SHAPE)
    assert not forecast.uses_disk and forecast.disk_free is None
    for name, row in forecast.policies.items():
        assert (row.disk_bytes, row.io_buffers, row.disk_read, row.disk_written) == (0, 0, 0, 0)
        assert row.host_peak == plain.policies[name].host_peak
    assert not tmp_path.joinpath("scratch").exists() and not any(tmp_path.iterdir())


def test_a_host_budget_below_the_minimum_is_refused_like_the_engine_refuses_it(tmp_path):
    # Below even the smallest I/O buffers (rules.MIN_DISK_PIECE) with every part on disk.
    with pytest.raises(rules.HostBudgetTooSmall, match=r"host budget 512\.0 KiB is below") as e:
        plan("tiny", device_mem="6GiB", host_mem="64GiB", precision="bf16", simulated=True,
             host_budget="512KiB", disk_dir=tmp_path, **SHAPE)
    with pytest.raises(rules.HostBudgetTooSmall) as engine_error:
        Engine(build_model("tiny"), EngineConfig(
            policy="cpu", device_budget="6GiB", precision="bf16", host_budget="512KiB",
            disk_dir=tmp_path, simulate=True))
    assert str(e.value) == str(engine_error.value)  # the same rule, the same numbers


def test_a_scratch_folder_without_room_fits_no_policy_and_says_needed_and_free(
        small_pieces, tmp_path, monkeypatch):
    """No policy that puts anything on disk: cuda keeps every chunk on the device, and
    needs no room there (test_full_disk_cuda.py)."""
    host_budget = int(0.3 * host_state("tiny", "bf16"))
    usage = shutil.disk_usage(tmp_path)
    free = 2 * MiB  # below what the budget sends to disk
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage._replace(free=free))
    forecast = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision="bf16",
                    simulated=True, host_budget=host_budget, disk_dir=tmp_path, **SHAPE)
    assert forecast.disk_free == free < forecast.disk_needed
    for row in (forecast.cpu, forecast.auto):
        assert not row.fits
        assert format_size(forecast.disk_needed) in row.reason and "2.0 MiB free" in row.reason
    assert forecast.cuda.fits and forecast.cuda.disk_bytes == 0
    assert forecast.recommended.policy == "cuda"
    with pytest.raises(ScratchTooSmall):  # and the engine refuses it before the first step
        Engine(build_model("tiny"), EngineConfig(
            policy="cpu", device_budget="6GiB", precision="bf16", host_budget=host_budget,
            disk_dir=tmp_path, simulate=True))


def test_a_scratch_folder_that_cannot_be_made_fits_no_policy(small_pieces, tmp_path):
    """No policy that puts anything on disk: cuda makes no scratch folder."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    host_budget = int(0.3 * host_state("tiny", "bf16"))
    forecast = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision="bf16",
                    simulated=True, host_budget=host_budget, disk_dir=blocker / "scratch",
                    **SHAPE)
    for row in (forecast.cpu, forecast.auto):
        assert not row.fits and "cannot be created" in row.reason
    assert forecast.cuda.fits
    with pytest.raises(ValueError, match="cannot be created"):
        Engine(build_model("tiny"), EngineConfig(
            policy="cpu", device_budget="6GiB", precision="bf16", host_budget=host_budget,
            disk_dir=blocker / "scratch", simulate=True))
