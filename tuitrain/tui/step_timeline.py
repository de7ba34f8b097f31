"""StepTimeline: the last step's device memory across its module boundaries.

Forward then backward, one column per interval between the engine's points (a point opens
each run of modules that share their chunks, engine.placement.rules.joins_run; several
intervals per column when they outnumber the columns): chunk bytes at the bottom, everything
else stacked on them, the budget as a line across, and under the chart where chunks were
copied in (▲, host to device) and out (▼). Drawn with block characters, each cell split in
two halves, so that columns line up exactly with the copies row and the phases below.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from rich.text import Text
from textual.widget import Widget

from engine.telemetry import StepStats, TimelinePoint
from tuitrain.formatting import format_size
from tuitrain.tui.fitting import KEEP, Item, fit_line

GUTTER = 10  # columns left of the chart, for the scale: "999.9 MiB" and a space
CHUNKS = "rgb(80,200,120)"
OTHER = "rgb(255,165,0)"
OVER = "rgb(230,70,70)"  # what stands above the budget, and the budget line itself
COPY_IN = "rgb(90,150,255)"
COPY_OUT = "rgb(210,110,230)"
CAPTION_SEPS = ("  ", " ")
_LAYER = re.compile(r"(?:^|\.)(?:layers|layer|h|blocks|block)\.(\d+)(?:\.(.+))?$")


def module_label(module: str) -> str:
    """A module as the view names it: "layer 3" (plus what inside it), else its last name."""
    match = _LAYER.search(module)
    if match:
        inside = f" {match.group(2)}" if match.group(2) else ""
        return f"layer {match.group(1)}{inside}"
    return module.rsplit(".", 1)[-1] or module


@dataclass(frozen=True)
class Column:
    """One drawn column: the intervals it stands for, at their highest, and their copies."""

    phase: str
    model_bytes: int
    non_model_bytes: int
    bytes_h2d: int
    bytes_d2h: int

    @property
    def total(self) -> int:
        return self.model_bytes + self.non_model_bytes


def columns(points: Sequence[TimelinePoint], width: int) -> list[Column]:
    """At most `width` columns: intervals widened to fill it when few, grouped when many.

    A group keeps the highest chunk bytes and the highest total of its intervals (so the
    peak is never lost), adds up their copies, and takes the phase of its peak.
    """
    if not points or width < 1:
        return []
    if len(points) <= width:
        repeat = width // len(points)
        out: list[Column] = []
        for p in points:
            column = Column(p.phase, p.model_bytes, p.non_model_bytes, p.bytes_h2d, p.bytes_d2h)
            out += [column] * repeat
        return out
    out = []
    n = len(points)
    for bucket in range(width):
        group = points[bucket * n // width : (bucket + 1) * n // width]
        if not group:
            continue
        peak = max(group, key=lambda p: p.model_bytes + p.non_model_bytes)
        model = max(p.model_bytes for p in group)
        out.append(
            Column(
                phase=peak.phase,
                model_bytes=model,
                non_model_bytes=max(0, peak.model_bytes + peak.non_model_bytes - model),
                bytes_h2d=sum(p.bytes_h2d for p in group),
                bytes_d2h=sum(p.bytes_d2h for p in group),
            )
        )
    return out


def _half(index: int, chunks: int, total: int, budget_half: int) -> str:
    """The colour of half-cell `index` (from the bottom) of a column, "" when empty."""
    if index >= total:
        return ""
    if index >= budget_half:
        return OVER
    return CHUNKS if index < chunks else OTHER


def _cell(lower: str, upper: str) -> tuple[str, str]:
    if not lower and not upper:
        return " ", ""
    if lower == upper:
        return "█", lower
    if not upper:
        return "▄", lower
    if not lower:
        return "▀", upper
    return "▄", f"{lower} on {upper}"


def timeline_chart(stats: StepStats, width: int, height: int) -> Text:
    """The whole view for `stats` in `width` x `height` cells (caption, chart, copies,
    phases); a line of explanation when the step has no timeline."""
    points = stats.timeline
    budget = stats.memory.device_capacity
    if not points:
        return Text(
            f"step {stats.step}: the engine reported no timeline for this step (it records "
            "one interval per module boundary once it is wired); the memory chart shows the "
            "step's peaks.",
            style="dim",
        )
    cols = columns(points, max(1, width - GUTTER))
    rows = max(1, height - 3)
    peak_point = max(points, key=lambda p: p.model_bytes + p.non_model_bytes)
    peak = peak_point.model_bytes + peak_point.non_model_bytes
    top = max(peak, budget, 1) * 1.05
    halves = 2 * rows
    budget_half = int(budget / top * halves)
    budget_row = min(rows - 1, budget_half // 2)
    # The peak is labelled on the row it reaches, never on a row that stands for more.
    peak_row = min(rows - 1, int(peak / top * halves) // 2)

    lines = [caption(stats, peak_point, width)]
    for row in reversed(range(rows)):
        if row == budget_row:
            label = format_size(budget)
        elif row == peak_row and row != 0 and format_size(peak) != format_size(budget):
            label = format_size(peak)
        elif row == 0:
            label = "0"
        else:
            label = ""
        line = Text(f"{label:>{GUTTER - 1}} ", style="dim")
        for column in cols:
            chunks = round(column.model_bytes / top * halves)
            total = round(column.total / top * halves)
            glyph, style = _cell(
                _half(2 * row, chunks, total, budget_half),
                _half(2 * row + 1, chunks, total, budget_half),
            )
            if glyph == " " and row == budget_row:
                glyph, style = ("─" if budget_half % 2 else "▁"), OVER
            line.append(glyph, style=style)
        lines.append(line)
    lines.append(_copies_row(cols))
    lines.append(_phases_row(cols))
    return Text("\n").join(lines)


def caption(stats: StepStats, peak: TimelinePoint, width: int) -> Text:
    h2d = sum(p.bytes_h2d for p in stats.timeline)
    d2h = sum(p.bytes_d2h for p in stats.timeline)
    total = peak.model_bytes + peak.non_model_bytes
    over = total > stats.memory.device_capacity
    items = [
        Item(((f"step {stats.step}", "bold"),), rank=KEEP),
        Item(((f"peak {format_size(total)}", "bold red" if over else "bold"),), rank=KEEP),
        # Where the peak was outranks the split (the memory chart shows that too): the
        # module's name is cut only once nothing else is left to drop.
        Item(((f"in {peak.phase} {module_label(peak.module)}", ""),), rank=6, shrink=True),
        Item(
            (
                ("█ ", CHUNKS),
                (f"chunks {format_size(peak.model_bytes)} ", ""),
                ("█ ", OTHER),
                (f"other {format_size(peak.non_model_bytes)}", ""),
            ),
            rank=5,
        ),
        Item((("▲ ", COPY_IN), (f"in {format_size(h2d)}", "")), rank=2),
        Item((("▼ ", COPY_OUT), (f"out {format_size(d2h)}", "")), rank=1),
    ]
    return fit_line(items, width, seps=CAPTION_SEPS)


def _copies_row(cols: list[Column]) -> Text:
    line = Text(f"{'copies':>{GUTTER - 1}} ", style="dim")
    for column in cols:
        if column.bytes_h2d and column.bytes_d2h:
            line.append("◆", style=COPY_IN)
        elif column.bytes_h2d:
            line.append("▲", style=COPY_IN)
        elif column.bytes_d2h:
            line.append("▼", style=COPY_OUT)
        else:
            line.append("·", style="dim")
    return line


def _phases_row(cols: list[Column]) -> Text:
    """ "forward──────│backward─────" under the columns of each phase."""
    line = Text(" " * GUTTER)
    start = 0
    while start < len(cols):
        phase = cols[start].phase
        end = start
        while end < len(cols) and cols[end].phase == phase:
            end += 1
        span = end - start
        label = phase if span > len(phase) else phase[:span]
        line.append("│" if start else "", style="dim")
        body = label + "─" * max(0, span - len(label) - (1 if start else 0))
        line.append(body[: span - (1 if start else 0)], style="dim")
        start = end
    return line


class StepTimeline(Widget):
    """The last step's device memory, interval by interval (see timeline_chart)."""

    DEFAULT_CSS = """
    StepTimeline {
        border: round $primary-muted;
        border-title-color: $text-primary;
        width: 1fr;
        height: 1fr;
        min-height: 7;
        padding: 0 1;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Last step, module by module"
        self.latest: StepStats | None = None

    def show(self, stats: StepStats) -> None:
        self.latest = stats
        self.refresh()

    def reset(self) -> None:
        self.latest = None
        self.refresh()

    @property
    def plain(self) -> str:
        return self.render().plain

    def render(self) -> Text:
        if self.latest is None:
            return Text("waiting for the first step…", style="dim")
        region = self.content_region
        return timeline_chart(self.latest, region.width or 80, region.height or 12)
