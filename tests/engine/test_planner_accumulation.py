"""The plan's bytes copied per step are what a run with `grad_accum` micro-batches copies:
each micro-batch fetches what it needs (after the first, bf16/fp16 from the fp32 master,
the gradients being home), and the gradients of every micro-batch add up where they are.
Byte for byte against the engine's own counters on a settled step, as for one micro-batch
(test_planner.py); and the time forecast prices those bytes once."""

from __future__ import annotations

import pytest
import torch

from engine import Engine, EngineConfig, StepStats
from engine.models.zoo import build_model
from engine.placement import disk_rules
from engine.planning.planner import plan
from engine.planning.time_model import step_times
from tests.calibrations import fixed_calibration

SHAPE = {"batch_size": 2, "seq_len": 64}  # one micro-batch's
MiB = 2**20


def settled_step(*, accum: int, steps: int = 3, **config) -> StepStats:
    """The last of `steps` steps of tiny, each of `accum` micro-batches of SHAPE."""
    engine = Engine(build_model("tiny"), EngineConfig(simulate=True, grad_accum=accum,
                                                      **config))
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        ids = torch.randint(0, 512, (accum * SHAPE["batch_size"], SHAPE["seq_len"]),
                            generator=g)
        stats = engine.step({"input_ids": ids, "labels": ids})
    engine.close()
    return stats


@pytest.mark.parametrize("accum", [1, 2, 4])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(("policy", "budget"), [("cpu", 6 * 1024 * MiB), ("auto", 20 * MiB)])
def test_the_bytes_copied_are_every_micro_batchs(policy, budget, precision, accum):
    forecast = plan("tiny", device_mem=budget, host_mem="64GiB", precision=precision,
                    simulated=True, grad_accum=accum, **SHAPE)
    stats = settled_step(accum=accum, policy=policy, device_budget=budget,
                         precision=precision)
    row = forecast.policies[policy]
    assert row.fits, row.reason
    assert stats.micro_batches == accum
    assert row.copied == stats.bytes_h2d + stats.bytes_d2h


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_later_micro_batches_add_their_gradients_to_those_on_disk_byte_for_byte(
        tmp_path, monkeypatch, precision):
    """Payloads on disk: a later micro-batch's gradients go out beside those on disk and
    their sum comes back (Spill.add_grads), both copies counted."""
    monkeypatch.setattr(disk_rules, "DISK_PIECE", 2**14)
    host = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision=precision,
                simulated=True, **SHAPE).model_bytes
    host_budget = int(0.12 * host)  # every chunk's state and some payloads on disk
    forecast = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision=precision,
                    simulated=True, host_budget=host_budget, disk_dir=tmp_path,
                    grad_accum=2, **SHAPE)
    stats = settled_step(accum=2, policy="cpu", device_budget="6GiB", precision=precision,
                         host_budget=host_budget, disk_dir=tmp_path)
    assert forecast.cpu.fits, forecast.cpu.reason
    assert forecast.cpu.copied == stats.bytes_h2d + stats.bytes_d2h


def test_the_time_forecast_prices_the_steps_copies_once():
    """The fetches are the plan's, the whole step's, not a micro-batch's times their
    number; every micro-batch's gradients take the way home."""
    cal = fixed_calibration()  # copies at 1 GB/s both ways
    one = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision="bf16",
               simulated=True, **SHAPE)
    four = plan("tiny", device_mem="6GiB", host_mem="64GiB", precision="bf16",
                simulated=True, grad_accum=4, **SHAPE)
    grads = 2 * four.parameters  # bf16 gradients of every chunk, updated on the host
    assert four.cpu.copied > 4 * one.cpu.copied  # later fetches are fp32
    times = step_times(four, cal)["cpu"]
    assert times.copy_h2d == pytest.approx((four.cpu.copied - 4 * grads) / 1e9)
    assert times.copy_d2h == pytest.approx(4 * grads / 1e9)
    assert step_times(four, cal, grad_accum=4)["cpu"] == times


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_micro_batchs_gradients_come_home_and_are_counted(precision):
    """Under cpu every chunk's gradients go home in the first micro-batch, a parameter's
    once; a later one's are added to them on the host, each coming over from the device as
    it arrives (on a GPU a copy like theirs), counted as they were: tiny's embedding, tied
    to its output head, sends one gradient a use."""
    model = build_model("tiny")
    itemsize = 4 if precision == "fp32" else 2
    gradients = sum(p.numel() for p in model.parameters()) * itemsize
    tied = model.get_input_embeddings().weight
    assert tied is model.get_output_embeddings().weight
    one, two = (settled_step(accum=accum, policy="cpu", device_budget=6 * 1024 * MiB,
                             precision=precision) for accum in (1, 2))
    assert one.bytes_d2h == gradients
    assert two.bytes_d2h - one.bytes_d2h == gradients + tied.numel() * itemsize


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(("policy", "budget", "margin"),
                         [("cuda", 1024 * MiB, 0.0), ("auto", 30 * MiB, 1.0)])
def test_the_device_peak_is_the_highest_micro_batchs(policy, budget, margin, precision):
    """Resident chunks keep their gradients on the device from one micro-batch to the
    next, so a later micro-batch runs its forward beside them: the step's peak is there,
    and the plan says it."""
    forecast = plan("tiny", device_mem=budget, host_mem="64GiB", precision=precision,
                    simulated=True, grad_accum=2, margin_ratio=margin, **SHAPE)
    stats = settled_step(accum=2, policy=policy, device_budget=budget, margin_ratio=margin,
                         precision=precision)
    row = forecast.policies[policy]
    assert row.fits, row.reason
    assert row.device_peak == pytest.approx(stats.memory.device_peak, rel=1e-3)
