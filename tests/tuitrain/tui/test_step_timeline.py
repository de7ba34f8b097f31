"""The last step module by module, and what the memory chart draws per step from it."""

from __future__ import annotations

import dataclasses

import pytest

from engine.telemetry import TimelinePoint
from tests.tuitrain.fakeworker import GiB, MiB, fake_run, fake_stats, fake_timeline
from tuitrain.formatting import format_size
from tuitrain.tui.memory_chart import MemoryChart, peak_split
from tuitrain.tui.step_timeline import StepTimeline, columns, module_label, timeline_chart

from .helpers import make_app, settle

pytestmark = pytest.mark.anyio

BIG = dict(parameters=1_315_758_080, n_chunks=72, device_budget=3 * GiB)


def point(phase="forward", model=0, other=0, h2d=0, d2h=0, module="m"):
    return TimelinePoint(phase, module, model, other, h2d, d2h)


# --- the fake worker's timeline -------------------------------------------------------------


def test_the_fake_step_runs_forward_over_the_modules_then_backward_in_reverse():
    stats = fake_stats(3, policy="cpu", n_chunks=6)
    names = [p.module for p in stats.timeline]
    assert [p.phase for p in stats.timeline] == ["forward"] * 6 + ["backward"] * 6
    assert names[:6] == names[6:][::-1]
    assert names[0] == "model.decoder.embed_tokens" and names[5] == "lm_head"


def test_the_fake_timeline_agrees_with_the_steps_totals():
    for policy in ("cuda", "cpu", "auto"):
        stats = fake_stats(3, policy=policy, **BIG)
        timeline, memory = stats.timeline, stats.memory
        assert sum(p.bytes_h2d for p in timeline) == stats.bytes_h2d
        assert sum(p.bytes_d2h for p in timeline) == stats.bytes_d2h
        assert max(p.model_bytes + p.non_model_bytes for p in timeline) == memory.device_peak
        assert max(p.non_model_bytes for p in timeline) == memory.device_non_model_peak


def test_under_cpu_chunks_come_in_and_go_out_while_the_step_runs():
    stats = fake_stats(3, policy="cpu", **BIG)
    model = [p.model_bytes for p in stats.timeline]
    assert min(model) > 0 and max(model) < stats.memory.device_peak  # a few chunks at a time
    forward = [p for p in stats.timeline if p.phase == "forward"]
    assert all(p.bytes_h2d > 0 for p in forward[:-1])  # each brings the next one in
    assert stats.bytes_h2d == 2 * sum(c.nbytes for c in stats.memory.chunks)  # fwd and bwd
    assert all(p.bytes_d2h > 0 for p in stats.timeline if p.phase == "backward")
    cuda = fake_stats(3, policy="cuda", **BIG)
    assert {p.bytes_h2d + p.bytes_d2h for p in cuda.timeline} == {0}


def test_resident_chunks_are_not_fetched():
    timeline = fake_timeline([10, 10, 10], resident={0, 1, 2}, non_model=5)
    assert sum(p.bytes_h2d for p in timeline) == 0
    assert {p.model_bytes for p in timeline if p.phase == "forward"} == {30}


# --- drawing it ---------------------------------------------------------------------------


def test_a_layer_reads_as_its_number():
    assert module_label("model.decoder.layers.11") == "layer 11"
    assert module_label("model.decoder.layers.3.self_attn.q_proj") == "layer 3 self_attn.q_proj"
    assert module_label("transformer.h.7") == "layer 7"
    assert module_label("lm_head") == "lm_head"


def test_few_intervals_are_widened_and_many_grouped_without_losing_the_peak():
    few = [point(model=1), point(model=2, h2d=5)]
    assert [c.model_bytes for c in columns(few, 7)] == [1, 1, 1, 2, 2, 2]
    many = [point(model=i, other=100 if i == 37 else 0, h2d=1) for i in range(100)]
    grouped = columns(many, 10)
    assert len(grouped) == 10
    assert max(c.total for c in grouped) == 137
    assert sum(c.bytes_h2d for c in grouped) == 100


def test_the_chart_shows_the_budget_the_phases_and_the_copies():
    stats = fake_stats(5, policy="cpu", **BIG)
    text = timeline_chart(stats, 76, 12).plain
    lines = text.splitlines()
    assert len(lines) == 12
    assert lines[0].startswith("step 5")
    assert f"peak {format_size(stats.memory.device_peak)} in backward" in lines[0]
    assert any(line.lstrip().startswith("3.0 GiB ─") for line in lines)  # the budget
    copies = next(line for line in lines if line.lstrip().startswith("copies"))
    assert "▲" in copies and "◆" in copies  # in, then in and out in backward
    assert lines[-1].strip().startswith("forward") and "│backward" in lines[-1]


def test_what_stands_above_the_budget_is_drawn_in_red():
    stats = fake_stats(5, policy="cuda", **BIG)  # 20 GiB of model on a 3 GiB budget
    chart = timeline_chart(stats, 60, 10)
    assert "peak 20.8 GiB" in chart.plain
    assert any("rgb(230,70,70)" in str(span.style) for span in chart.spans)


def test_a_step_without_a_timeline_says_so():
    stats = dataclasses.replace(fake_stats(5), timeline=[])
    text = timeline_chart(stats, 76, 12).plain
    assert "no timeline" in text and "memory chart" in text


async def test_the_step_view_of_a_small_screen_draws_the_last_step():
    app, _ = make_app(fake_run(4, policy="cpu", **BIG))
    async with app.run_test(size=(80, 24)) as pilot:
        await settle(app, pilot)
        await pilot.press("v", "v")  # run -> trials -> step
        await settle(app, pilot)
        view = app.query_one(StepTimeline)
        assert view.display and view.content_region.height >= 8
        text = view.plain
        assert text.startswith("step 4") and "forward" in text and "backward" in text
        assert "▲" in text


# --- the memory chart, per step -----------------------------------------------------------


def test_chunk_bytes_held_during_the_step_come_from_the_timeline():
    stats = fake_stats(5, policy="cpu", **BIG)
    chunks, other, estimated = peak_split(stats)
    top = max(stats.timeline, key=lambda p: p.model_bytes + p.non_model_bytes)
    assert not estimated and (chunks, other) == (top.model_bytes, top.non_model_bytes)
    assert chunks > stats.memory.device_model  # more than what stayed after the step


def test_the_stack_is_split_at_the_peaks_moment_and_never_draws_more_than_the_peak():
    """Chunks 405 MiB at the peak, the non-model peak 485 MiB at another moment (with fewer
    chunks beside it): the stack is the 699 MiB that happened, not 890 MiB."""
    stats = fake_stats(5, policy="auto", **BIG)
    timeline = [
        TimelinePoint("forward", "a", 405 * MiB, 294 * MiB, 0, 0),
        TimelinePoint("backward", "b", 200 * MiB, 485 * MiB, 0, 0),
    ]
    memory = dataclasses.replace(
        stats.memory, device_peak=699 * MiB, device_non_model_peak=485 * MiB,
        device_capacity=700 * MiB)
    stats = dataclasses.replace(stats, memory=memory, timeline=timeline)
    chart = MemoryChart()
    chart.record(stats)
    (sample,) = chart.samples
    assert (sample.chunk_peak, sample.other_at_peak) == (405 * MiB, 294 * MiB)
    assert sample.chunk_peak + sample.other_at_peak <= sample.device_capacity


def test_without_a_timeline_the_split_is_estimated_from_the_step_peaks():
    stats = fake_stats(5, policy="cpu", **BIG)
    memory = dataclasses.replace(
        stats.memory, device_model=0, device_peak=900 * MiB, device_non_model_peak=600 * MiB
    )
    chunks, other, estimated = peak_split(
        dataclasses.replace(stats, memory=memory, timeline=[]))
    assert estimated and (chunks, other) == (300 * MiB, 600 * MiB)


async def test_the_captions_name_the_stack_and_the_memory_the_engine_does_not_account_for():
    app, _ = make_app(fake_run(3, policy="cpu", **BIG))
    async with app.run_test(size=(120, 40)) as pilot:
        await settle(app, pilot)
        chart = app.query_one(MemoryChart)
        assert chart.simulated  # the device's bytes live in this process
        last = chart.samples[-1]
        device = chart.device_caption().plain
        assert f"chunks {format_size(last.chunk_peak)}" in device
        assert f"other {format_size(last.other_at_peak)}" in device
        assert "budget 3.0 GiB" in device
        host = chart.host_caption().plain
        untracked = last.process_rss - last.host_model - last.device_model
        assert "engine " in host and "RSS " in host
        assert f"untracked {untracked / GiB:.1f} GiB" in host
        chart.samples.append(last._replace(estimated=True))
        assert "chunks ≈" in chart.device_caption().plain
