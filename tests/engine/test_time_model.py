"""The time model: a step's work counted on the meta device, its arithmetic in seconds, the
calibration it reads (measured once per machine and cached) and the hardware profiles."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time

import pytest
import torch

from engine.devices import device
from engine.devices.device import host_has_bf16
from engine.models.lora import Lora
from engine.models.zoo import count_parameters, model_config
from engine.planning import calibration as calibration_module
from engine.planning import clock as clock_module
from engine.planning import measurement as measurement_module
from engine.planning import probes as probes_module
from engine.planning import reference_decoder as reference_module
from engine.planning.calibration import (
    CORRECTION_BOUNDS,
    LEARNED_RUNS,
    calibration,
    calibration_path,
    fingerprint,
    learn,
    load_calibration,
    measure,
)
from engine.planning.flops import StepWork, _Counter, step_work
from engine.planning.hardware import HARDWARE, UnknownHardware, hardware_profile
from engine.planning.machine import busy, load_beside, quiet
from engine.planning.planner import plan
from engine.planning.time_model import Traffic, forecast, step_times
from tests.calibrations import GFLOP, fixed_calibration

# --- the work of a step -----------------------------------------------------------------


def test_a_forward_is_two_flops_per_parameter_and_token_and_a_backward_twice_that():
    tokens = 2 * 64
    work = step_work(model_config("tiny"), torch.float32, batch_size=2, seq_len=64,
                     checkpointing=False)
    dense = 2 * count_parameters("tiny") * tokens
    assert work.forward_flops == pytest.approx(dense, rel=0.1)
    assert work.backward_flops == pytest.approx(2 * work.forward_flops, rel=0.15)
    assert work.recompute_flops == 0 and work.recompute_bytes == 0
    assert work.forward_bytes > 0 and work.backward_bytes > 0
    assert work.ops > work.intervals > 0


def test_activation_checkpointing_recomputes_the_layers_forward_in_backward():
    shape = dict(batch_size=2, seq_len=64)
    plain = step_work(model_config("opt-125m"), torch.float32, checkpointing=False, **shape)
    ckpt = step_work(model_config("opt-125m"), torch.float32, checkpointing=True, **shape)
    assert ckpt.forward_flops == plain.forward_flops
    assert ckpt.backward_flops == pytest.approx(plain.backward_flops)
    # The 12 layers run again; the embeddings and the head do not.
    assert 0.5 * plain.forward_flops < ckpt.recompute_flops < plain.forward_flops
    assert ckpt.intervals > plain.intervals


def test_a_deep_stack_counts_as_its_layers_add_up():
    """opt-125m is counted one and two layers deep and extrapolated to its twelve: the
    extrapolation must match the layer count's own arithmetic (2 x params x tokens)."""
    work = step_work(model_config("opt-125m"), torch.float32, batch_size=1, seq_len=128,
                     checkpointing=False)
    assert work.forward_flops == pytest.approx(2 * count_parameters("opt-125m") * 128,
                                               rel=0.05)


def test_tensors_at_or_above_the_mapping_line_count_as_new_memory():
    """A run's steady heap maps every tensor of a MiB or more afresh; glibc's own line
    stops at 32 MiB; a kept heap maps nothing."""
    config, shape = model_config("opt-125m"), dict(batch_size=2, seq_len=128,
                                                   checkpointing=False)
    steady = step_work(config, torch.float32, mapped_from=2**20, **shape)
    glibc = step_work(config, torch.float32, mapped_from=32 * 2**20, **shape)
    kept = step_work(config, torch.float32, mapped_from=None, **shape)
    assert kept.forward_fresh == kept.backward_fresh == 0
    logits, head_grad = 2 * 128 * 50272 * 4, 50272 * 768 * 4  # both above either line
    assert logits <= glibc.forward_fresh < steady.forward_fresh
    assert head_grad <= glibc.backward_fresh < steady.backward_fresh
    assert steady.forward_flops == kept.forward_flops  # the rest of the work is the same
    ckpt = step_work(config, torch.float32, mapped_from=2**20, batch_size=2, seq_len=128,
                     checkpointing=True)
    assert 0 < ckpt.recompute_fresh < steady.forward_fresh
    assert ckpt.backward_fresh == pytest.approx(steady.backward_fresh)

    # A view is no new memory, whatever its schema says: `_unsafe_view` declares no alias.
    x, counter = torch.empty(1024, 512, device="meta"), _Counter(mapped_from=2**20)
    with counter:
        torch.ops.aten._unsafe_view(x, [512, 1024])
        assert counter.fresh == [0.0, 0.0]
        torch.ops.aten.add(x, 1)
    assert counter.fresh == [2 * 2**20, 0.0]


def test_dropout_draws_its_masks_in_forward_and_again_where_layers_recompute():
    """opt-125m's dropout (p=0.1) draws a mask over the activations it drops; backward
    reuses it, and activation checkpointing recomputes each layer's forward, masks
    included. A model without dropout draws none."""
    config, shape = model_config("opt-125m"), dict(batch_size=2, seq_len=128)
    plain = step_work(config, torch.float32, checkpointing=False, **shape)
    tokens = 2 * 128 * config.hidden_size
    # Each layer drops after attention and after its MLP.
    assert plain.forward_random == 2 * config.num_hidden_layers * tokens
    assert plain.backward_random == plain.recompute_random == 0
    ckpt = step_work(config, torch.float32, checkpointing=True, **shape)
    assert ckpt.recompute_random == 2 * config.num_hidden_layers * tokens
    assert ckpt.backward_random == 0
    config.dropout = 0.0
    assert step_work(config, torch.float32, checkpointing=False, **shape).forward_random == 0


# --- the arithmetic ---------------------------------------------------------------------

WORK = StepWork(forward_flops=10 * GFLOP, backward_flops=20 * GFLOP, recompute_flops=0.0,
                forward_bytes=1e9, backward_bytes=2e9, recompute_bytes=0.0, intervals=10,
                ops=1000, hidden=768)
TRAFFIC = Traffic(copied=3_000_000_000, updated_on_host=100_000_000, updated_on_device=0,
                  itemsize=4)


def test_on_the_simulated_device_every_part_adds_up():
    # fixed_calibration: 10 GFLOP/s, 1 GB/s for bytes, 100 M AdamW elements/s, 10 µs/op.
    t = forecast(WORK, TRAFFIC, fixed_calibration(), precision="fp32", simulated=True)
    assert t.forward == pytest.approx(1.0 + 1.0 + 1000 / 3 * 1e-5)
    assert t.backward == pytest.approx(2.0 + 2.0 + 2000 / 3 * 1e-5)
    assert t.copy_d2h == pytest.approx(0.4)  # the host-updated gradients: 100 M x 4 bytes
    assert t.copy_h2d == pytest.approx(2.6)  # the rest of the copies: fetches
    assert t.optimizer_host == pytest.approx(1.0) and t.optimizer_device == 0
    assert t.overlap == 0
    assert t.total == pytest.approx(t.compute + 3.0 + 1.0)
    assert t.parts()["total"] == t.total


def test_on_the_simulated_device_fetches_ahead_of_use_hide_behind_compute():
    # Of TRAFFIC's 2.6 s of fetches, 2 GB (2 s at 1 GB/s) come ahead of use, on the copy
    # thread; the rest and the gradients' way home stay in line.
    ahead = dataclasses.replace(TRAFFIC, prefetched=2_000_000_000)
    t = forecast(WORK, ahead, fixed_calibration(), precision="fp32", simulated=True)
    assert t.copy_h2d == pytest.approx(2.6)
    assert t.overlap == pytest.approx(2.0)
    assert t.total == pytest.approx(t.compute + 0.6 + 0.4 + 1.0)
    # Never more than the step computes meanwhile.
    much = dataclasses.replace(TRAFFIC, copied=40_400_000_000, prefetched=40_000_000_000)
    t = forecast(WORK, much, fixed_calibration(), precision="fp32", simulated=True)
    assert t.overlap == pytest.approx(t.compute)
    # With torch's threads on every core the copy thread does not run: all in line.
    t = forecast(WORK, ahead, fixed_calibration(), precision="fp32", simulated=True,
                 copies_beside=False)
    assert t.overlap == 0


def test_on_cuda_copies_hide_behind_compute_up_to_its_length():
    cal = fixed_calibration()
    t = forecast(WORK, TRAFFIC, cal, precision="fp32", simulated=False)
    assert t.overlap == pytest.approx(3.0)  # all 3 s of copies, under 6 s of kernels
    assert t.total == pytest.approx(t.compute + t.optimizer_host)
    slow = Traffic(copied=30_000_000_000, updated_on_host=0, updated_on_device=100_000_000,
                   itemsize=4)
    t = forecast(WORK, slow, cal, precision="fp32", simulated=False)
    assert t.total == pytest.approx(30.0 + 0.25)  # the link is the bottleneck, + the update


def test_a_real_decoders_measured_cost_scales_the_compute_and_nothing_else():
    """The calibration's compute factor (a real decoder measured against what the rates
    forecast for it) multiplies the kernels' time; copies and the update are their own."""
    plain = forecast(WORK, TRAFFIC, fixed_calibration(), precision="fp32", simulated=True)
    cal = dataclasses.replace(fixed_calibration(), compute_factor=3.0)
    slow = forecast(WORK, TRAFFIC, cal, precision="fp32", simulated=True)
    assert slow.forward == pytest.approx(3 * (1.0 + 1.0) + 1000 / 3 * 1e-5)
    assert (slow.copy_h2d, slow.copy_d2h, slow.optimizer_host) == (
        plain.copy_h2d, plain.copy_d2h, plain.optimizer_host)


def test_a_half_precision_step_takes_its_own_factor_and_its_updates_casts():
    """bf16's decoder factor is its own (a CPU's bf16 matmuls gain more than the ops around
    them); its update reads each gradient into fp32 and writes the weights back in bf16: 12
    bytes an element beside AdamW's 28, on the simulated device as on a GPU: the fp32
    copies go into one buffer kept through the update (engine.step.optimizer.fp32_grads),
    not new memory for every gradient."""
    cal = dataclasses.replace(fixed_calibration(), compute_factor=2.0, half_factor=3.0)
    half = dataclasses.replace(TRAFFIC, itemsize=2)
    fp32 = forecast(WORK, TRAFFIC, cal, precision="fp32", simulated=True)
    bf16 = forecast(WORK, half, cal, precision="bf16", simulated=True)
    # 10 + 20 GFLOP at 40 GFLOP/s and 3 GB at 1 GB/s, x3; fp32's at 10 GFLOP/s, x2.
    assert bf16.forward + bf16.backward == pytest.approx(3 * (0.75 + 3.0) + 1000 * 1e-5)
    assert fp32.forward + fp32.backward == pytest.approx(2 * (3.0 + 3.0) + 1000 * 1e-5)
    adamw = 100_000_000 / 1e8
    assert fp32.optimizer_host == pytest.approx(adamw)
    assert bf16.optimizer_host == pytest.approx(adamw * (1 + 12 / 28))
    on_gpu = forecast(WORK, half, cal, precision="bf16", simulated=False)
    assert on_gpu.optimizer_host == pytest.approx(adamw * (1 + 12 / 28))
    unmeasured = dataclasses.replace(cal, half_factor=0.0)  # fp32's stands for it
    assert forecast(WORK, half, unmeasured, precision="bf16", simulated=True).forward == (
        pytest.approx(2 * (0.25 + 1.0) + 1000 / 3 * 1e-5))


def test_new_memory_costs_its_pages_on_the_simulated_device_only():
    """A GPU's caching allocator keeps what it hands out; the simulated device's tensors
    are host memory, new at every allocation above the heap's line."""
    fresh = dataclasses.replace(WORK, forward_fresh=5e8, recompute_fresh=2.5e8)
    cal = fixed_calibration()  # new memory at 250 MB/s
    for simulated, cost in ((True, 2.0), (False, 0.0)):
        plain = forecast(WORK, TRAFFIC, cal, precision="fp32", simulated=simulated)
        more = forecast(fresh, TRAFFIC, cal, precision="fp32", simulated=simulated)
        assert more.forward - plain.forward == pytest.approx(cost)
        assert more.recompute - plain.recompute == pytest.approx(cost / 2)


def test_activations_take_their_new_memory_at_the_decoders_rate_and_copies_at_the_probes():
    """A step's activations went into new pages faster than the probe writes them; the
    copies' new buffers are written by one copy each, as the probe's are."""
    fresh = dataclasses.replace(WORK, forward_fresh=5e8, backward_fresh=2.5e8)
    traffic = dataclasses.replace(TRAFFIC, fresh=5e8)
    cal = dataclasses.replace(fixed_calibration(), activation_pages=5e8)  # the probe: 2.5e8
    plain = forecast(WORK, TRAFFIC, cal, precision="fp32", simulated=True)
    more = forecast(fresh, traffic, cal, precision="fp32", simulated=True)
    assert more.forward - plain.forward == pytest.approx(1.0)
    assert more.backward - plain.backward == pytest.approx(0.5)
    assert more.copy_h2d - plain.copy_h2d == pytest.approx(2.0)
    # Not measured (no kept heap to compare with): the probe's rate for both.
    unmeasured = dataclasses.replace(cal, activation_pages=0.0)
    assert (forecast(fresh, traffic, unmeasured, precision="fp32", simulated=True).forward
            - plain.forward) == pytest.approx(2.0)


def test_random_numbers_cost_their_draws_beyond_their_bytes_where_measured():
    """Drawing dropout's masks costs what the calibration measured beyond the bytes they
    write, times the factor as every kernel; unmeasured (a GPU's profile), only the bytes."""
    drawn = dataclasses.replace(WORK, forward_random=2e8, recompute_random=1e8)
    cal = dataclasses.replace(fixed_calibration(), random=1e8, compute_factor=2.0)
    plain = forecast(WORK, TRAFFIC, cal, precision="fp32", simulated=True)
    more = forecast(drawn, TRAFFIC, cal, precision="fp32", simulated=True)
    assert more.forward - plain.forward == pytest.approx(2.0 * 2.0)
    assert more.recompute - plain.recompute == pytest.approx(2.0 * 1.0)
    unmeasured = dataclasses.replace(cal, random=0.0)
    assert forecast(drawn, TRAFFIC, unmeasured, precision="fp32", simulated=True).forward == (
        pytest.approx(plain.forward))
    assert hardware_profile("h100-80gb").calibration(cal).random == 0


def test_the_precision_picks_its_matmul_rate():
    fp32 = forecast(WORK, TRAFFIC, fixed_calibration(), precision="fp32", simulated=True)
    bf16 = forecast(WORK, TRAFFIC, fixed_calibration(), precision="bf16", simulated=True)
    assert fp32.forward - bf16.forward == pytest.approx(1.0 - 0.25)


def test_accumulation_repeats_forward_backward_and_copies_but_updates_once():
    one = forecast(WORK, TRAFFIC, fixed_calibration(), precision="fp32", simulated=True)
    # The bytes copied are the step's (the plan's): every micro-batch's fetches, here the
    # same again each time, and every micro-batch's gradients on their way home.
    later = 3 * TRAFFIC.updated_on_host * TRAFFIC.itemsize
    four = forecast(WORK, dataclasses.replace(TRAFFIC, copied=TRAFFIC.copied + later),
                    fixed_calibration(), precision="fp32", simulated=True, grad_accum=4)
    assert four.compute == pytest.approx(4 * one.compute)
    # Priced once, the fetches as fetches and the gradients as gradients.
    assert four.copy_h2d == pytest.approx(one.copy_h2d)
    assert four.copy_d2h == pytest.approx(4 * one.copy_d2h)
    assert four.optimizer_host == one.optimizer_host


DISK = Traffic(copied=0, updated_on_host=0, updated_on_device=0, itemsize=4,
               disk_read=20_000_000_000, disk_written=10_000_000_000)


def test_on_cuda_the_disk_tier_overlaps_the_step_and_shows_what_it_cannot_hide():
    t = forecast(WORK, DISK, fixed_calibration(), precision="fp32", simulated=False)
    assert t.disk == pytest.approx(30.0)
    assert t.total == pytest.approx(30.0)  # 30 s of disk, the ~6 s of compute beside it


# 5 s of disk at 1 GB/s each way: 1 s of accumulation's later reads, in line, and 3 GB the
# update reads and writes, 1.5 s at the 2 GB/s the disk does both ways at once: 2.5 s the
# step waits; the other 2.5 s (payloads read ahead, gradients written behind) beside the
# ~6 s of compute.
UPDATE = Traffic(copied=0, updated_on_host=0, updated_on_device=0, itemsize=4,
                 disk_read=3_000_000_000, disk_written=2_000_000_000,
                 disk_update=3_000_000_000, disk_later_read=1_000_000_000, update_beside=False)


def duplex_calibration():
    return dataclasses.replace(fixed_calibration(), disk_duplex=2e9)


def test_on_the_simulated_device_the_step_waits_for_the_updates_disk_io():
    """Reads ahead and writes behind run beside the compute; the update's reads and writes
    are waited for, at the rate the disk does both at once; accumulation's later reads in
    line, at the read rate."""
    for accum in (1, 4):
        t = forecast(WORK, UPDATE, duplex_calibration(), precision="fp32", simulated=True,
                     grad_accum=accum)
        assert t.disk == pytest.approx(5.0)
        assert t.overlap == pytest.approx(2.5)
        assert t.total == pytest.approx(t.compute + 2.5)
    # Not measured both ways at once: the update's bytes at the read rate.
    t = forecast(WORK, UPDATE, fixed_calibration(), precision="fp32", simulated=True)
    assert t.total == pytest.approx(t.compute + 4.0)
    # With little compute, what runs beside it hides no more than the compute's length.
    idle = dataclasses.replace(WORK, forward_flops=GFLOP / 10, backward_flops=GFLOP / 5,
                               forward_bytes=0, backward_bytes=0, ops=0)
    t = forecast(idle, UPDATE, duplex_calibration(), precision="fp32", simulated=True)
    assert t.overlap == pytest.approx(t.compute) and t.total == pytest.approx(5.0)


def test_the_update_of_the_state_on_disk_computes_inside_its_waits():
    """AdamW over the pieces whose state is on disk runs while the tier reads the next
    piece and writes the last: the step waits for the I/O or the update, not both."""
    plain = forecast(WORK, UPDATE, duplex_calibration(), precision="fp32", simulated=True)
    # 0.5 s of AdamW at the fixed calibration's rate, inside the 2.5 s of waits.
    on_disk = dataclasses.replace(UPDATE, updated_on_host=50_000_000,
                                  updated_on_disk=50_000_000)
    t = forecast(WORK, on_disk, duplex_calibration(), precision="fp32", simulated=True)
    assert t.optimizer_host == pytest.approx(0.5)
    assert t.total == pytest.approx(plain.total)
    # The same update with its state on the host: waited for after the I/O.
    on_host = dataclasses.replace(on_disk, updated_on_disk=0)
    t = forecast(WORK, on_host, duplex_calibration(), precision="fp32", simulated=True)
    assert t.total == pytest.approx(plain.total + 0.5)
    # An update longer than the waits shows what the waits do not cover.
    long = dataclasses.replace(on_disk, updated_on_host=800_000_000,
                               updated_on_disk=800_000_000)  # 8 s of AdamW
    t = forecast(WORK, long, duplex_calibration(), precision="fp32", simulated=True)
    assert t.total == pytest.approx(plain.total + 8.0 - 2.5)


def test_on_the_simulated_device_an_update_that_flies_hides_behind_one_forward():
    """Where the update flies beside the next step's first forward (state on disk, no
    payload there), its I/O hides behind one micro-batch's forward, however many a step
    has; a short update hides whole."""
    flies = dataclasses.replace(UPDATE, update_beside=True, disk_later_read=0,
                                disk_update=8_000_000_000, disk_read=6_000_000_000,
                                disk_written=4_000_000_000)  # 4 s of update, 6 beside
    for accum in (1, 4):
        t = forecast(WORK, flies, duplex_calibration(), precision="fp32", simulated=True,
                     grad_accum=accum)
        assert t.disk == pytest.approx(10.0)
        assert t.overlap == pytest.approx(6.0 + t.forward / accum)
        assert t.total == pytest.approx(t.compute + 4.0 - t.forward / accum)
    short = dataclasses.replace(flies, disk_update=2_000_000_000, disk_read=2_000_000_000,
                                disk_written=1_000_000_000)  # 1 s of update: within a forward
    t = forecast(WORK, short, duplex_calibration(), precision="fp32", simulated=True)
    assert t.total == pytest.approx(t.compute)


def test_the_planner_says_whether_the_update_flies():
    """Where payloads are on disk (fp32: the payload is the master, and goes there with
    it), the next forward would read what the update writes: the update does not fly
    beside it (engine.chunks.disk_side.overlap_update). In bf16 the state alone goes."""
    shape = dict(device_mem="1GiB", host_mem="16GiB", batch_size=2, seq_len=32,
                 simulated=True)
    for precision, beside in (("fp32", False), ("bf16", True)):
        whole = plan("tiny", precision=precision, **shape).model_bytes
        p = plan("tiny", precision=precision, host_budget=whole // 2, **shape)
        row = p.cpu
        assert row.disk_read > 0 and row.update_beside == beside
        assert 0 < row.disk_update <= row.disk_read + row.disk_written
        times = step_times(p, duplex_calibration())["cpu"]
        p.cpu = dataclasses.replace(row, disk_read=0, disk_written=0, disk_update=0,
                                    disk_later_read=0)
        without = step_times(p, duplex_calibration())["cpu"]
        waits = row.disk_update / 2e9
        hides = min(waits, times.forward) if beside else 0.0
        # The update of the state on disk (all of cpu's parameters update on the host)
        # computes inside what is left of the waits.
        inside = min(times.optimizer_host * min(1.0, row.disk_bytes / p.model_bytes),
                     waits - hides)
        assert 0 < inside < waits - hides or hides == waits  # bf16: all beside the forward
        assert times.total - without.total == pytest.approx(waits - hides - inside)


def test_a_plans_rows_get_their_own_traffic():
    p = plan("tiny", device_mem="1GiB", host_mem="16GiB", precision="fp32", batch_size=2,
             seq_len=32, simulated=True)
    times = step_times(p, fixed_calibration())
    cuda, cpu = times["cuda"], times["cpu"]
    assert cuda.copy_h2d == cuda.copy_d2h == 0
    assert cuda.optimizer_host == 0 and cuda.optimizer_device > 0
    assert cpu.optimizer_device == 0
    assert cpu.optimizer_host == pytest.approx(p.parameters / 1e8)
    # The bytes copied, and the host's fp32 gradient landing places, new every step.
    assert cpu.copy_h2d + cpu.copy_d2h == pytest.approx(p.cpu.copied / 1e9
                                                        + 4 * p.parameters / 2.5e8)
    assert cpu.compute == pytest.approx(cuda.compute)
    assert cpu.total > cuda.total



def test_the_hosts_gradient_landing_places_are_new_memory_once_a_step():
    """fp32 gradients land on the host in buffers made at the first landing and freed after
    the update (rules.grads_land_per_step): on the simulated device each is new memory once
    a step, however many micro-batches. Not with a disk tier, not in bf16 (they land in the
    payload), not on a GPU (pinned memory its allocator keeps)."""
    shape = dict(device_mem="1GiB", host_mem="16GiB", batch_size=2, seq_len=32)
    cal = fixed_calibration()  # new memory at 250 MB/s, copies at 1 GB/s
    p = plan("tiny", precision="fp32", simulated=True, **shape)
    homes = 4 * p.parameters / 2.5e8
    one = step_times(p, cal)["cpu"]
    assert one.copy_d2h == pytest.approx(4 * p.parameters / 1e9 + homes)
    four = step_times(plan("tiny", precision="fp32", simulated=True, grad_accum=4, **shape),
                      cal)["cpu"]
    assert four.copy_d2h == pytest.approx(4 * (4 * p.parameters / 1e9) + homes)
    assert step_times(p, cal)["cuda"].copy_d2h == 0  # nothing lands on the host
    gpu = plan("tiny", precision="fp32", simulated=False, **shape)
    half = plan("tiny", precision="bf16", simulated=True, **shape)
    tier = plan("tiny", precision="fp32", simulated=True, host_budget=p.model_bytes,
                **shape)
    for other, itemsize in ((gpu, 4), (half, 2), (tier, 4)):  # the bytes copied alone
        assert step_times(other, cal)["cpu"].copy_d2h == pytest.approx(
            min(other.cpu.copied, itemsize * other.parameters) / 1e9)


def test_the_decoders_offset_comes_once_a_micro_batch_and_never_below_half():
    """The calibration fits a factor and an offset on a decoder at two depths: forward and
    backward take factor x their kernels + the offset, shared between them by their
    kernels; the recomputed forward the factor alone. A model so small that the offset
    would take more than half its factor's time keeps that half."""
    cal = dataclasses.replace(fixed_calibration(), compute_factor=2.0, compute_offset=-1.0)
    assert cal.compute_seconds("fp32", 6.0) == pytest.approx(11.0)
    assert cal.compute_seconds("fp32", 0.5) == pytest.approx(0.5)  # half of 2 x 0.5
    plain = forecast(WORK, TRAFFIC, cal, precision="fp32", simulated=True)
    # WORK's kernels: 1 + 1 s forward, 2 + 2 s backward; 12 s at x2, 11 with the offset.
    ops = 1000 * 1e-5
    assert plain.forward + plain.backward == pytest.approx(11.0 + ops)
    assert plain.forward - ops / 3 == pytest.approx(11.0 / 3)
    four = forecast(WORK, TRAFFIC, cal, precision="fp32", simulated=True, grad_accum=4)
    assert four.forward + four.backward == pytest.approx(4 * (11.0 + ops))
    ckpt = dataclasses.replace(WORK, recompute_flops=10 * GFLOP, recompute_bytes=1e9)
    # No offset: 2 s of kernels at x2, and its share of the ops (10 of 40 GFLOP).
    assert forecast(ckpt, TRAFFIC, cal, precision="fp32", simulated=True).recompute == (
        pytest.approx(2.0 * 2.0 + 1000 * 10 / 40 * 1e-5))
    half = dataclasses.replace(cal, half_factor=3.0, half_offset=0.5)
    assert half.compute_seconds("bf16", 1.0) == pytest.approx(3.5)
    assert half.compute_seconds("fp32", 1.0) == pytest.approx(1.0)  # x2 - 1 = 1 = half

def test_a_lora_step_sends_back_and_updates_the_adapters_alone():
    """Frozen chunks get no gradient: nothing of theirs is copied out or updated, and
    backward computes the inputs' gradients through them, not the weights'."""
    shape = dict(device_mem="1GiB", host_mem="16GiB", precision="fp32", batch_size=2,
                 seq_len=32, simulated=True)
    full = plan("tiny", **shape)
    lora = plan("tiny", lora=Lora(rank=4), **shape)
    work = step_work(model_config("tiny"), torch.float32, batch_size=2, seq_len=32,
                     checkpointing=False, lora=Lora(rank=4))
    assert 0 < work.trainable < 0.1 * full.parameters
    cal = fixed_calibration()
    plain, adapted = step_times(full, cal)["cpu"], step_times(lora, cal)["cpu"]
    assert adapted.optimizer_host == pytest.approx(work.trainable / cal.adamw_host)
    assert adapted.copy_d2h == pytest.approx(work.trainable * 4 / cal.d2h
                                             + cal.fresh_seconds(work.trainable * 4))
    # Every frozen chunk is still fetched (forward and backward): the copies in stay, at
    # least every chunk's payload twice. (A trained tied embedding is fetched a third time,
    # for its own gradient after the head's: a frozen one needs no gradient of its own.)
    copied_in = lora.cpu.copied - work.trainable * 4
    assert adapted.copy_h2d == pytest.approx(copied_in / cal.h2d)
    assert copied_in >= 2 * 4 * lora.parameters
    assert plain.copy_h2d == pytest.approx((full.cpu.copied - 4 * full.parameters) / cal.h2d)
    assert plain.forward < adapted.forward < 1.3 * plain.forward  # the adapters' own ops
    assert adapted.backward < 0.75 * plain.backward
    assert step_times(lora, cal)["cuda"].optimizer_device == pytest.approx(
        work.trainable / cal.adamw_device)


# --- the calibration --------------------------------------------------------------------


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TUITRAIN_CACHE", str(tmp_path))
    return tmp_path


def test_the_calibration_is_measured_once_and_then_read_from_the_cache(empty_cache):
    measured, said = [], []

    def fake_measure():
        measured.append(1)
        return fixed_calibration(*fingerprint())

    first = calibration(say=said.append, measure_fn=fake_measure)
    again = calibration(say=said.append, measure_fn=fake_measure)
    assert measured == [1] and len(said) == 1 and "at most 30 s" in said[0]
    assert again == first
    assert calibration_path().parent.parent == empty_cache
    calibration(refresh=True, say=said.append, measure_fn=fake_measure)
    assert measured == [1, 1]


def test_figures_measured_on_busy_cores_are_measured_again_once_they_are_quiet(
        empty_cache, monkeypatch):
    """A calibration taken while other work held every core forecasts everything too slow:
    it is kept while the machine stays busy (measuring again then would be as wrong) and
    measured again, saying why, at the first forecast on a quiet machine."""
    cores = os.cpu_count() or 1
    measured, said = [], []

    def fake_measure():
        measured.append(1)
        cal = fixed_calibration(*fingerprint())
        cal.extra["load"] = load  # as measure() records it
        return cal

    load = 1.5 * cores
    monkeypatch.setattr(calibration_module, "load_average", lambda: load)
    calibration(say=said.append, measure_fn=fake_measure)
    assert calibration(say=said.append, measure_fn=fake_measure).extra["load"] == load
    assert measured == [1] and len(said) == 1  # still busy: the cached figures
    load = 0.25 * cores
    again = calibration(say=said.append, measure_fn=fake_measure)
    assert measured == [1, 1] and again.extra["load"] == load
    assert said[1].startswith(f"the cached one was measured while the machine was busy "
                              f"(load {1.5 * cores:.1f}); now it is quiet: calibrating")
    calibration(say=said.append, measure_fn=fake_measure)
    assert measured == [1, 1]  # measured when quiet: kept from then on
    assert busy(2.0 * cores) and not busy(None) and quiet(0.0) and not quiet(None)
    # Most of the cores taken is busy too: one core of two left to a measurement's two
    # threads slows its kernels by more than half.
    assert busy(0.9 * cores) and not busy(0.5 * cores) and quiet(0.5 * cores)


def test_a_real_measurement_records_the_load_it_was_taken_under(empty_cache, monkeypatch):
    monkeypatch.setattr(measurement_module, "load_average", lambda: 3.25)
    assert measure(simulate=True, limit=0.5, scale=0.01).extra["load"] == 3.25
    # Too short for the average to move: the higher of its start's and its end's.
    loads = iter([0.4, 1.7])
    monkeypatch.setattr(measurement_module, "load_average", lambda: next(loads))
    assert measure(simulate=True, limit=0.5, scale=0.01).extra["load"] == 1.7


def test_a_job_that_starts_with_a_measurement_makes_it_busy_though_the_start_read_quiet():
    """The 1-minute load average lags: read at a measurement's start it may not show a job
    that started a moment before. What the average moved during the measurement, beyond the
    measurement's own threads, is the others' load."""
    moved = 1 - math.exp(-12 / 60)
    quiet_end = 0.1 * (1 - moved) + 2 * moved  # 12 s of the measurement's 2 threads alone
    assert load_beside(0.1, quiet_end, 12.0, 2) == pytest.approx(0.1)
    beside_a_job = 0.9 * (1 - moved) + 4 * moved  # and 2 threads of another job
    assert load_beside(0.9, beside_a_job, 12.0, 2) == pytest.approx(2.0)
    assert load_beside(0.5, 0.7, 1.0, 2) == 0.7  # too short to tell: the higher
    assert load_beside(None, 0.7, 12.0, 2) == 0.7 and load_beside(0.5, None, 12.0, 2) == 0.5


def test_another_machine_or_an_outdated_file_is_measured_again(empty_cache, monkeypatch):
    key, words = fingerprint()
    calibration(measure_fn=lambda: fixed_calibration(key, words))
    assert load_calibration() is not None
    monkeypatch.setattr(calibration_module, "fingerprint", lambda: ("other", "another machine"))
    assert load_calibration() is None  # a new GPU or torch: a new fingerprint, no file
    monkeypatch.undo()
    monkeypatch.setenv("TUITRAIN_CACHE", str(empty_cache))
    data = json.loads(calibration_path().read_text())
    data["format"] = 0
    calibration_path().write_text(json.dumps(data))
    assert load_calibration() is None


def test_the_fingerprint_names_the_cpu_torch_and_gpu():
    key, words = fingerprint()
    assert len(key) == 16 and f"{torch.__version__}" in words and "cores" in words
    assert "no GPU (simulated device)" in words  # tests run on the simulated device
    # The CPU's vector instructions: one model name covers machines with and without bf16.
    assert f"({torch.backends.cpu.get_cpu_capability()})" in words


def test_a_cpu_with_other_vector_instructions_is_another_machine(monkeypatch):
    key, _ = fingerprint()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "OTHER")
    other, words = fingerprint()
    assert other != key and "(OTHER)" in words


def test_the_compute_factor_takes_new_memory_off_but_never_all_of_the_run():
    factor = reference_module._factor
    assert factor(run=1.0, fresh=0.2, kernels=0.5) == pytest.approx(1.6)
    # A new-memory probe slower than the whole run: half the run stays the kernels'.
    assert factor(run=1.0, fresh=3.0, kernels=0.5) == pytest.approx(1.0)
    assert factor(run=1.0, fresh=0.0, kernels=0.0) == 1.0


def test_a_quick_real_measurement_gives_a_rate_for_everything(empty_cache):
    cal = measure(simulate=True, limit=0.5, scale=0.01)
    rates = [cal.elementwise, cal.h2d, cal.d2h, cal.adamw_host, cal.adamw_device, cal.random,
             *(r for table in cal.matmul.values() for r in table.values())]
    assert all(math.isfinite(r) and r > 0 for r in rates)
    assert set(cal.matmul) == {"fp32", "bf16", "fp16"}
    assert cal.op_overhead >= 0 and cal.source == "this machine's calibration"
    assert math.isfinite(cal.compute_factor) and cal.compute_factor > 0
    assert math.isfinite(cal.compute_offset)
    # bf16's own factor where runs here compute in it; none where they run in fp32.
    assert (cal.half_factor > 0) == host_has_bf16()
    # The disk and memory's speeds in two windows each, both kept beside the rates.
    assert len(cal.extra["disk windows"]) == len(cal.extra["memory windows"]) == 2
    assert cal.disk_read > 0 and cal.disk_write > 0
    # Each way, both windows' bytes over both windows' seconds.
    assert [cal.disk_write, cal.disk_read, cal.disk_duplex] == [
        pytest.approx(2 / (1 / a + 1 / b)) for a, b in zip(*cal.extra["disk windows"],
                                                         strict=True)]
    assert not any(empty_cache.glob("scratch/.calibrate-*"))  # the disk probe cleaned up


def test_a_cpu_without_bf16_units_is_not_timed_in_bf16(empty_cache, monkeypatch):
    """It would run bf16 several times slower than fp32 and spend the calibration's time
    limit on a precision its runs do not use."""
    monkeypatch.setattr(device, "host_has_bf16", lambda: False)
    cal = measure(simulate=True, limit=0.5, scale=0.01)
    assert cal.half_factor == 0.0 and cal.factor("bf16") == cal.compute_factor


def test_new_memory_costs_more_than_writing_memory_already_resident():
    rate = probes_module._fresh_pages_rate(clock_module._Clock(0.5, 1), 16 * 2**20)
    assert 0 < rate < math.inf


def test_a_kernel_is_timed_at_its_best_and_the_reference_decoder_at_its_median():
    durations = iter([9.0, 1.0, 5.0, 2.0, 4.0, 3.0, 8.0])  # the first run warms up
    now = [0.0]

    def run():
        now[0] += next(durations)

    # A minute's limit shared so finely that each measurement's share is spent at once.
    clock = clock_module._Clock(60.0, 10**9, timer=lambda: now[0])
    assert clock.rate(10.0, run, lambda: None) == pytest.approx(10.0 / 1.0)  # 1, 5, 2
    clock = clock_module._Clock(60.0, 10**9, timer=lambda: now[0])
    durations = iter([9.0, 1.0, 5.0, 2.0, 4.0, 3.0, 8.0])
    # At least five runs whatever the share: 1, 5, 2, 4, 3, whose median is 3.
    assert clock.rate(6.0, run, lambda: None, typical=True, runs=5) == pytest.approx(2.0)


def test_memorys_rates_are_medians_in_two_windows_and_the_slower_window_counts():
    """Memory here runs at one of two speeds, the faster in spells of a second or so: a
    probe that falls in one must not price every later step's copies and updates."""
    fast, slow = [100.0, 15.0, 40.0, 4.0], [50.0, 20.0, 21.0, 2.5]  # the h2d copy: window 1
    readings, how = iter(fast + slow), []

    class Clock:
        def rate(self, work, run, sync, *, typical=False, runs=3, shares=1.0):
            run()  # each probe runs, at a small scale
            how.append((typical, shares))
            return next(readings)

    simulated = device.make_device(2**30, simulate=True)
    try:
        memory = probes_module._MemorySpeeds(Clock(), simulated, lambda: None, 0.001)
        memory.time()
        memory.time()
    finally:
        simulated.close()
    assert memory.speeds() == {"elementwise": 50.0, "h2d": 15.0, "d2h": 21.0,
                               "adamw_host": 2.5}
    assert how == [(True, 0.5)] * 8  # medians; two windows make one share


def test_a_run_the_threads_clock_did_not_see_whole_is_not_the_fastest():
    """A parallel kernel's thread 0 asleep at its end while another thread finishes: its
    clock read 1 s of a run the wall clock saw take 3 s. The fastest whole run is taken;
    where no run is whole (a busy machine throughout), the thread's clock still is."""
    thread = iter([9.0, 2.0, 1.0, 2.5, 3.0])
    wall = iter([9.0, 2.1, 3.0, 2.6, 3.1])
    clocks = {"thread": 0.0, "wall": 0.0}

    def run():
        clocks["thread"] += next(thread)
        clocks["wall"] += next(wall)

    clock = clock_module._Clock(60.0, 10**9, timer=lambda: clocks["thread"],
                                wall=lambda: clocks["wall"])
    assert clock.rate(10.0, run, lambda: None, runs=4) == pytest.approx(10.0 / 2.0)
    assert clock_module.whole_runs([1.0, 2.0], [3.0, 4.0]) == [1.0, 2.0]
    assert clock_module.whole_runs([1.0, 2.0], [1.0, 4.0]) == [1.0]


def test_the_reference_decoder_is_timed_at_two_depths_in_turn_in_two_windows():
    """A slow spell that fills one window is one window of two, and it slows both depths
    alike: each window runs the shallow decoder and the deep one in turn (the first pair
    warms up), and each depth is judged by its median run over both windows."""
    durations = iter([9.0, 9.0, 1.0, 4.0, 1.0, 4.0, 1.0, 4.0,   # a slow spell's window...
                      9.0, 9.0, 2.0, 5.0, 2.0, 5.0, 2.0, 5.0])  # ...and a quiet one
    now = [0.0]
    reference = reference_module._Reference(torch.device("cpu"), lambda: None, scale=0.01)
    assert [c.num_hidden_layers for c in reference.configs] == [1, 6]
    reference._run = lambda model: now.__setitem__(0, now[0] + next(durations))
    clock = clock_module._Clock(60.0, 10**9, timer=lambda: now[0])
    reference.time(clock)
    reference.time(clock)
    assert reference.runs == ([1.0, 1.0, 1.0, 2.0, 2.0, 2.0], [4.0, 4.0, 4.0, 5.0, 5.0, 5.0])


class _Kept:
    """A kept decoder that answers each round with the next of `answers` (None: failed)."""

    def __init__(self, answers):
        self.answers = iter(answers)

    def run(self):
        return next(self.answers)


def test_the_kept_decoder_runs_beside_each_round_and_each_window_keeps_its_pairs():
    durations = iter([9.0, 9.0, 5.0, 8.0, 5.0, 7.0, 5.0, 6.0])
    now = [0.0]
    reference = reference_module._Reference(torch.device("cpu"), lambda: None, scale=0.01,
                                            kept=_Kept([[9.0, 9.0], [1.0, 4.0], [1.0, 4.5],
                                                        [1.0, 4.0]]))
    assert reference.shares == 2 * reference_module.REFERENCE_SHARES  # two runs a round
    reference._run = lambda model: now.__setitem__(0, now[0] + next(durations))
    reference.time(clock_module._Clock(60.0, 10**9, timer=lambda: now[0]))
    assert reference.runs == ([5.0, 5.0, 5.0], [8.0, 7.0, 6.0])
    assert reference.kept == ([1.0, 1.0, 1.0], [4.0, 4.5, 4.0])
    assert reference.beyond == [[4.0, 2.5, 2.0]]
    # A kept decoder that fails: this process's runs are fitted alone from then on.
    durations = iter([9.0] * 8)
    reference.kept_decoder = _Kept([None])
    reference.time(clock_module._Clock(60.0, 10**9, timer=lambda: now[0]))
    assert reference.kept == ([], []) and reference.beyond == []
    assert reference.kept_decoder is None and reference.shares > 0


def test_the_activations_price_is_the_last_windows_pairs_within_bounds_of_the_probe(
        monkeypatch):
    """In the first window, seconds after the models were built, this process's runs took
    up to twice what they took later: the last window's pairs set the price."""
    reference = reference_module._Reference(torch.device("cpu"), lambda: None, scale=0.01)
    work = dataclasses.replace(WORK, forward_fresh=3e8, backward_fresh=1e8)
    monkeypatch.setattr(reference, "_works", lambda: [WORK, work])
    cal = fixed_calibration()  # the probe: 2.5e8 bytes a second
    assert reference.activation_pages(cal) == 0.0  # no kept decoder ran: the probe's
    reference.beyond = [[9.0, 9.0], [0.8, 1.0, 1.2]]
    assert reference.activation_pages(cal) == pytest.approx(4e8 / 1.0)
    low, high = reference_module.ACTIVATION_BOUNDS
    reference.beyond = [[0.8], [-0.1, 0.0]]  # a slow spell on a kept run
    assert reference.activation_pages(cal) == pytest.approx(high * 2.5e8)
    reference.beyond = [[0.8], [10.0]]
    assert reference.activation_pages(cal) == pytest.approx(low * 2.5e8)


def test_beside_a_kept_decoder_the_factor_is_fitted_on_its_runs_alone(monkeypatch):
    """The kept decoder's runs take no new memory: the factor and offset are its kernels',
    whatever this process's runs (their new memory) took."""
    reference = reference_module._Reference(torch.device("cpu"), lambda: None, scale=0.01)
    reference.runs = ([9.0], [9.0])
    reference.kept = ([1.5, 1.0, 2.0], [4.0, 4.5, 5.0])
    given = iter([1.0, 2.5])
    monkeypatch.setattr(reference_module, "_kernels", lambda *_: next(given))
    factor, offset = reference.fit(fixed_calibration())
    assert factor == pytest.approx((4.5 - 1.5) / (2.5 - 1.0))
    assert offset == pytest.approx(1.5 - factor * 1.0)


def test_the_kept_decoder_is_a_process_of_its_own_that_maps_nothing_afresh(monkeypatch):
    kept = reference_module._KeptDecoder.start(reference_module.REFERENCE, 0.01)
    assert kept is not None
    try:
        assert kept.ready(time.perf_counter() + 120) is kept
        for _ in range(2):
            seconds = kept.run()
            assert len(seconds) == 2 and all(s > 0 for s in seconds)
    finally:
        kept.close()
    assert kept.process.returncode == 0
    # A process that keeps its heap itself has nothing to compare the kept decoder with.
    monkeypatch.setattr(reference_module, "mapped_from", lambda: None)
    assert reference_module._KeptDecoder.start(reference_module.REFERENCE, 0.01) is None


def _fitted(monkeypatch, runs, kernels, fresh=(0.0, 0.0)):
    """The reference's fit to `runs` (shallow, deep), its depths' kernels forecast at
    `kernels` seconds and their new memory at `fresh`."""
    reference = reference_module._Reference(torch.device("cpu"), lambda: None, scale=0.01)
    reference.runs = runs
    given = {"kernels": iter(kernels), "fresh": iter(fresh)}
    monkeypatch.setattr(reference_module, "_kernels", lambda *_: next(given["kernels"]))
    monkeypatch.setattr(reference_module, "_fresh", lambda *_: next(given["fresh"]))
    return reference.fit(fixed_calibration())


def test_the_compute_factor_is_the_slope_between_the_depths_and_the_rest_an_offset(
        monkeypatch):
    """Each layer costs what the deep decoder's extra layers took per second of their
    forecast; the shallow decoder's rest is what every micro-batch takes beyond that."""
    factor, offset = _fitted(monkeypatch, ([1.0, 2.0, 1.5], [4.5, 4.0, 5.0]), (1.0, 2.5))
    assert factor == pytest.approx((4.5 - 1.5) / (2.5 - 1.0))  # 2.0
    assert offset == pytest.approx(1.5 - 2.0 * 1.0)
    # New memory is priced apart, taken off each depth's run (at most down to its half).
    factor, offset = _fitted(monkeypatch, ([1.5], [4.5]), (1.0, 2.5), fresh=(0.1, 0.5))
    assert factor == pytest.approx((4.0 - 1.4) / 1.5)
    assert offset == pytest.approx(1.4 - factor * 1.0)
    _, halved = _fitted(monkeypatch, ([1.5], [4.5]), (1.0, 2.5), fresh=(9.0, 0.0))
    assert halved == pytest.approx(0.75 - 2.5 * 1.0)  # the shallow run's half stays


def test_a_slope_from_a_slow_spell_stays_within_bounds_of_the_deep_decoders_own(
        monkeypatch):
    """Depths that ran alike (a slow spell on the shallow one) would make a layer cost
    nothing: the factor keeps at least half the deep decoder's own, and the offset is
    what the shallow run then leaves."""
    low, high = reference_module.SLOPE_BOUNDS
    factor, offset = _fitted(monkeypatch, ([4.0], [4.5]), (1.0, 2.5))
    assert factor == pytest.approx(low * 4.5 / 2.5)
    assert offset == pytest.approx(4.0 - factor * 1.0)
    factor, _ = _fitted(monkeypatch, ([0.1], [9.0]), (2.0, 2.5))  # a slope of 17.8
    assert factor == pytest.approx(high * 9.0 / 2.5)
    # Depths the rates forecast alike (a model of one layer kind too small to tell): the
    # deep decoder's own factor, and no offset.
    assert _fitted(monkeypatch, ([1.0], [2.0]), (1.0, 1.0)) == (pytest.approx(2.0), 0.0)


def test_a_models_width_between_measured_ones_interpolates():
    cal = fixed_calibration()
    cal.matmul["fp32"] = {256: 1.0, 1024: 4.0}
    assert cal.matmul_rate("fp32", 512) == pytest.approx(2.0)
    assert cal.matmul_rate("fp32", 64) == 1.0 and cal.matmul_rate("fp32", 8192) == 4.0


# --- hardware profiles ------------------------------------------------------------------


def test_the_shipped_profiles_cover_laptops_desktops_and_datacentre_gpus():
    assert {"laptop-6gb", "laptop-8gb", "desktop-12gb", "desktop-24gb", "a100-40gb",
            "a100-80gb", "h100-80gb"} <= set(HARDWARE)
    for p in HARDWARE.values():
        assert p.memory > 0 and p.tflops["bf16"] >= p.tflops["fp32"] > 0
        assert p.pcie_generation in (3, 4, 5) and p.pcie_lanes in (4, 8, 16)


def test_a_profile_keeps_this_hosts_cpu_figures_and_says_it_is_an_estimate():
    host = fixed_calibration()
    cal = hardware_profile("h100-80gb").calibration(host)
    assert cal.adamw_host == host.adamw_host and cal.disk_read == host.disk_read
    assert cal.matmul_rate("bf16", 4096) == pytest.approx(989e12 * 0.6)
    assert cal.h2d == pytest.approx(3.938e9 * 16 * 0.8)
    assert "the published specs of H100 80 GB (SXM), an estimate" in cal.source
    assert "x0.6" in cal.source  # the derating is said
    with pytest.raises(UnknownHardware, match="known: laptop-6gb"):
        hardware_profile("tpu")


def test_a_cache_that_cannot_be_written_still_gives_a_calibration(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("")
    monkeypatch.setenv("TUITRAIN_CACHE", str(blocked))
    said = []
    cal = calibration(say=said.append, measure_fn=lambda: fixed_calibration(*fingerprint()))
    assert cal.h2d == 1e9
    assert len(said) == 2 and said[1].startswith("calibration not cached (")


# --- what runs teach it -----------------------------------------------------------------


def test_a_runs_measured_steps_correct_the_next_forecast_on_this_machine(empty_cache):
    key, words = fingerprint()
    cal = calibration(measure_fn=lambda: fixed_calibration(key, words))
    before = forecast(WORK, TRAFFIC, cal, precision="fp32", simulated=True)
    learn(cal, 2.0)  # its steps took twice their forecast
    taught = load_calibration()
    assert (taught.correction, taught.learned_from) == (pytest.approx(2.0), 1)
    after = forecast(WORK, TRAFFIC, taught, precision="fp32", simulated=True)
    assert after.total == pytest.approx(2 * before.total)
    assert after.forward == pytest.approx(2 * before.forward)  # the parts still add up
    # A later run is one voice beside the earlier ones: the median of their ratios
    # against the uncorrected model (here 2 and 0.75 x 2), within the bounds.
    learn(taught, 0.75)
    assert load_calibration().correction == pytest.approx((2.0 + 1.5) / 2)
    assert learn(load_calibration(), 1e4).learned_from == 2  # a wild ratio teaches nothing
    # A profile of another GPU keeps none of it; a new measurement starts over.
    assert hardware_profile("a100-40gb").calibration(load_calibration()).correction == 1.0
    calibration(refresh=True, measure_fn=lambda: dataclasses.replace(
        fixed_calibration(key, words), measured_at="2026-02-01T00:00:00+00:00"))
    assert load_calibration().correction == 1.0
    assert "correction" not in json.loads(calibration_path().read_text())


def test_each_precision_learns_its_own_correction(empty_cache):
    """The model's error is not the same in each precision (on a CPU with bf16 units, bf16
    steps took 1.37x their forecast where fp32's took about theirs): what bf16 tunes
    measured corrects bf16's forecasts alone."""
    key, words = fingerprint()
    cal = calibration(measure_fn=lambda: fixed_calibration(key, words), precision="bf16")
    assert cal.taught_for == "bf16"
    learn(cal, 1.5)
    learn(load_calibration(precision="fp32"), 0.9)
    bf16, fp32 = (load_calibration(precision=p) for p in ("bf16", "fp32"))
    assert (bf16.correction, bf16.learned_from) == (pytest.approx(1.5), 1)
    assert (fp32.correction, fp32.learned_from) == (pytest.approx(0.9), 1)
    assert load_calibration(precision="fp16").correction == 1.0
    assert calibration(precision="bf16").correction == pytest.approx(1.5)  # the cached one
    half = dataclasses.replace(TRAFFIC, itemsize=2)
    plain = dataclasses.replace(bf16, correction=1.0)
    assert forecast(WORK, half, bf16, precision="bf16", simulated=True).total == (
        pytest.approx(1.5 * forecast(WORK, half, plain, precision="bf16", simulated=True).total))


def test_a_run_on_a_loaded_machine_cannot_swing_the_correction(empty_cache):
    """Steps that waited for cores (x12 their forecast, seen at a load of 30 on 2 cores)
    are one voice among the last runs', and no correction goes beyond its bounds."""
    key, words = fingerprint()
    cal = calibration(measure_fn=lambda: fixed_calibration(key, words))
    for ratio in (1.10, 0.95, 1.05):
        cal = learn(cal, ratio / cal.correction)  # measured against the corrected forecast
    assert cal.correction == pytest.approx(1.05)
    cal = learn(cal, 12.0 / cal.correction)
    assert load_calibration().correction == pytest.approx((1.05 + 1.10) / 2)
    low, high = CORRECTION_BOUNDS
    for _ in range(LEARNED_RUNS):  # every run disturbed: bounded all the same
        cal = learn(cal, 12.0 / cal.correction)
    assert load_calibration().correction == high and len(cal.learned) == LEARNED_RUNS
    for _ in range(LEARNED_RUNS):
        cal = learn(cal, 0.01 / cal.correction)
    assert load_calibration().correction == low
    assert load_calibration().learned_from == 3 + 1 + 2 * LEARNED_RUNS
