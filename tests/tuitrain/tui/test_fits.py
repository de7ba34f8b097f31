"""Screens that fit: a small screen shows the loss, the start-up and the whole step panel;
help scrolls with the keys at once; axes skip no value and name their unit at every width;
the module chart labels its rows truly; paths break at their separators."""

from __future__ import annotations

import dataclasses

import pytest

from tests.tuitrain.fakeworker import GiB, MiB, fake_run, fake_stats
from tuitrain.settings import Settings
from tuitrain.tui.axes import value_ticks
from tuitrain.tui.fitting import wrap_at_separators
from tuitrain.tui.help_screen import HelpScreen
from tuitrain.tui.memory_chart import MemoryChart
from tuitrain.tui.step_panel import StepPanel
from tuitrain.tui.step_timeline import GUTTER, timeline_chart

from .helpers import make_app, settle

pytestmark = pytest.mark.anyio
SMALL = (80, 24)


async def test_a_small_screen_shows_the_loss_in_its_main_view():
    app, _ = make_app(fake_run(3))
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        step = app.query_one(StepPanel)
        assert step.display
        assert f"loss {app.latest.loss:.4f}" in step.times_text


async def test_a_small_screen_shows_every_line_of_a_step_that_uses_the_disk():
    run = dict(parameters=1_315_758_080, n_chunks=72, device_budget=3 * GiB, policy="cpu")
    settings = Settings(model="opt-1.3b")
    settings.engine.policy = "cpu"
    app, _ = make_app(fake_run(3, host_budget=2 * GiB, **run), settings=settings)
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        step = app.query_one(StepPanel)
        times = step.query_one("#step-times")
        assert "disk read" in step.times_text and step.lines > 7
        assert times.content_region.height >= step.lines


async def test_help_fits_a_small_screen_or_scrolls_with_the_arrows_at_once():
    app, _ = make_app(fake_run(1))
    async with app.run_test(size=SMALL) as pilot:
        await settle(app, pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        box = app.screen.query_one("#help-box")
        assert box.region.bottom <= SMALL[1]
        assert "closes" in box.border_subtitle  # in sight however far it is scrolled
        if box.max_scroll_y > 0:
            await pilot.press("end")  # no Tab first
            await pilot.pause()
            assert box.scroll_y == box.max_scroll_y


def test_value_axis_labels_are_evenly_spaced_and_none_is_skipped():
    for top, rows in ((398.9 * 1.1, 8), (6.3, 5), (0.9, 3), (1000.0, 20), (42.0, 11)):
        ticks = value_ticks(top, rows)
        assert ticks[0] == 0 and ticks[-1] <= top and len(ticks) >= 2
        gaps = {round(b - a, 6) for a, b in zip(ticks, ticks[1:], strict=False)}
        assert len(gaps) == 1, ticks  # none skipped
        assert len(ticks) - 1 <= rows // 2  # a row between labels: plotext drops none
        assert top - ticks[-1] < gaps.pop()  # and the top is labelled near


async def test_the_device_axis_names_its_unit_at_every_width():
    for size in ((80, 24), (120, 40), (200, 60)):
        app, _ = make_app(fake_run(3))
        async with app.run_test(size=size) as pilot:
            await settle(app, pilot)
            chart = app.query_one(MemoryChart)
            assert "(MiB)" in chart.device_caption().plain or "(GiB)" in (
                chart.device_caption().plain), size


def row_labels(chart: str) -> list[str]:
    return [line[: GUTTER - 1].strip() for line in chart.splitlines()[1:-2]]


def test_the_module_charts_rows_never_label_less_than_a_row_below_them():
    """A 6 GiB budget over a step that peaked at 998 MiB: the top row stands for more than
    the budget, so it is not labelled 998.0 MiB."""
    stats = fake_stats(5, policy="cpu", parameters=125_239_296, n_chunks=24,
                       device_budget=6 * GiB)
    assert stats.memory.device_peak < 1 * GiB
    labels = [label for label in row_labels(timeline_chart(stats, 100, 60).plain) if label]
    sizes = [_bytes(label) for label in labels]
    assert sizes == sorted(sizes, reverse=True), labels
    assert labels[0] == "6.0 GiB"


def _bytes(label: str) -> float:
    if label == "0":
        return 0.0
    value, unit = label.split()
    return float(value) * {"KiB": 2**10, "MiB": MiB, "GiB": GiB}[unit]


def test_a_long_module_name_is_kept_whole_where_the_split_can_go_instead():
    stats = fake_stats(5, policy="cpu", parameters=125_239_296, n_chunks=24)
    top = max(stats.timeline, key=lambda p: p.model_bytes + p.non_model_bytes)
    renamed = [dataclasses.replace(p, module="model.decoder.layers.3.self_attn.out_proj")
               if p is top else p for p in stats.timeline]
    stats = dataclasses.replace(stats, timeline=renamed)
    caption = timeline_chart(stats, 60, 12).plain.splitlines()[0]
    assert "layer 3 self_attn.out_proj" in caption, caption


def test_paths_break_after_a_separator_not_mid_word():
    text = "saved preset /home/user/.config/tuitrain/presets/tiny-auto.yaml"
    lines = wrap_at_separators(text, 38).splitlines()
    assert all(len(line) <= 38 for line in lines)
    assert lines[-1] == "tuitrain/presets/tiny-auto.yaml"
    assert "".join(lines).replace(" ", "") == text.replace(" ", "")
