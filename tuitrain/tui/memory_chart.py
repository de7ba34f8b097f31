"""MemoryChart: device and host memory over the last steps, drawn with plotext.

Device, per step, stacked: at the moment of the step's peak, the chunk bytes on the device
(parameters, gradients, optimizer state: what the placement decides) and on top of them
everything else (activations, workspace), against the budget line. Both parts are taken at
that one moment, so the stack is the peak and never a total that did not happen (the
non-model peak alone can come at another moment, with fewer chunks beside it). Between
steps the chunks may all be back on the host (cpu, or auto with no margin), so what the
device held *during* the step is what is drawn: from the step's timeline when the engine
reports one, else estimated from its peaks. Host: the bytes the engine keeps there (its
chunks and the disk tier's I/O buffers; on the simulated device, its device bytes too,
which live in this process) and the process's peak RSS in the step above them; the gap is
memory the engine does not account for. Under a host budget that sends chunks to disk, the
bytes on disk are a third line there.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import psutil
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

from engine.telemetry import StepStats
from tuitrain.formatting import format_size
from tuitrain.tui.axes import size_unit, step_ticks, value_ticks
from tuitrain.tui.downsample import downsample
from tuitrain.tui.fitting import KEEP, Item, fit_line
from tuitrain.tui.sized_plot import SizedPlot

HISTORY = 600  # steps kept for the charts; older samples scroll off

Colour = tuple[int, int, int]

# One colour per series, shared by the plot and its caption.
CHUNKS = (80, 200, 120)
OTHER = (255, 165, 0)
BUDGET = (230, 70, 70)
ENGINE_HOST = (90, 150, 255)
RSS = (210, 110, 230)
DISK = (215, 175, 135)  # tan, as the chunk map's chunks on disk
CAPTION_SEPS = ("  ", " ")


class MemorySample(NamedTuple):
    step: int
    chunk_peak: int  # chunk bytes on the device at the step's peak
    other_at_peak: int  # everything else on the device at that same moment
    device_peak: int  # all device bytes at their highest
    device_capacity: int
    estimated: bool  # no timeline: chunk_peak is estimated from the step's peaks
    host_model: int  # chunk bytes on the host after the step
    device_model: int  # chunk bytes on the device after the step
    process_rss: int
    host_io_buffers: int = 0  # the disk tier's buffers on the host
    disk_model: int = 0  # chunk bytes in the scratch folder after the step
    rss_exact: bool = True  # process_rss is the step's peak, not a sample at its end


def peak_split(stats: StepStats) -> tuple[int, int, bool]:
    """The device bytes at the step's peak, split: chunks, everything else, and whether the
    split is estimated.

    From the timeline when there is one: its highest interval's split, whose sum is that
    peak. Else the chunks are the more of what stayed on the device after the step and what
    the peak leaves beside the non-model peak, and the rest of the peak is the other part."""
    if stats.timeline:
        top = max(stats.timeline, key=lambda p: p.model_bytes + p.non_model_bytes)
        return top.model_bytes, top.non_model_bytes, False
    memory = stats.memory
    chunks = max(0, memory.device_model, memory.device_peak - memory.device_non_model_peak)
    chunks = min(chunks, memory.device_peak)
    return chunks, memory.device_peak - chunks, True


def host_total_bytes() -> int | None:
    """Total memory of this machine, or None where psutil cannot tell."""
    try:
        return int(psutil.virtual_memory().total)
    except Exception:  # an odd platform must not take the screen down
        return None


def _key(colour: Colour, label: str, *, rank: int = KEEP) -> Item:
    return Item((("━ ", "rgb({},{},{})".format(*colour)), (label, "")), rank=rank)


def _plain(label: str, *, style: str = "", rank: int = KEEP) -> Item:
    return Item(((label, style),), rank=rank)


class MemoryChart(Vertical):
    """Two stacked charts (device, host) over a bounded window of steps."""

    DEFAULT_CSS = """
    MemoryChart {
        border: round $primary-muted;
        border-title-color: $text-primary;
        height: 1fr;
    }
    MemoryChart > .caption {
        height: 1;
        text-wrap: nowrap;
        text-overflow: ellipsis;
    }
    MemoryChart > SizedPlot {
        height: 1fr;
        min-height: 3;
    }
    """

    def __init__(self, *, history: int = HISTORY, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Memory"
        self.samples: deque[MemorySample] = deque(maxlen=history)
        self.host_total = host_total_bytes()
        self.simulated = False  # the device's bytes live in this process too

    def compose(self) -> ComposeResult:
        yield Static("device: waiting for the first step…", id="device-caption", classes="caption")
        yield SizedPlot(self.redraw, id="device-plot")
        yield Static("host", id="host-caption", classes="caption")
        yield SizedPlot(self.redraw, id="host-plot")

    def on_mount(self) -> None:
        for plot in self.query(SizedPlot):
            # No box around the plots: on a small screen its two rows are half the chart.
            plot.plt.frame(False)

    def record(self, stats: StepStats) -> None:
        """Keep one step's numbers; cheap, so every step can be recorded."""
        mem = stats.memory
        chunks, other, estimated = peak_split(stats)
        self.samples.append(
            MemorySample(
                step=stats.step,
                chunk_peak=chunks,
                other_at_peak=other,
                device_peak=mem.device_peak,
                device_capacity=mem.device_capacity,
                estimated=estimated,
                host_model=mem.host_model,
                device_model=mem.device_model,
                process_rss=mem.process_rss,
                host_io_buffers=mem.host_io_buffers,
                disk_model=mem.disk_model,
                rss_exact=mem.process_rss_exact,
            )
        )

    def reset(self) -> None:
        """Forget the run shown (a restart begins a new one), its drawing too."""
        self.samples.clear()
        self.query_one("#device-caption", Static).update(self.device_caption())
        self.query_one("#host-caption", Static).update(self.host_caption())
        for plot in self.query(SizedPlot):
            plot.plt.clear_data()
            plot.refresh()

    def engine_host_bytes(self, sample: MemorySample) -> int:
        """What the engine accounts for in this process's memory."""
        own = sample.host_model + sample.host_io_buffers
        return own + (sample.device_model if self.simulated else 0)

    @property
    def uses_disk(self) -> bool:
        """Whether any step in the window had chunk bytes on disk."""
        return any(s.disk_model for s in self.samples)

    def _width(self) -> int:
        return self.query_one("#device-caption", Static).content_region.width or 200

    def device_caption(self) -> Text:
        if not self.samples:
            return Text("device: waiting for the first step…")
        last = self.samples[-1]
        estimated = "≈" if last.estimated else ""  # no timeline: see peak_split
        over = last.device_peak > last.device_capacity
        unit, _ = size_unit(max(last.device_peak, last.device_capacity))
        items = [
            _plain("device", style="bold"),
            _plain(f"({unit})", style="dim"),  # the scale's, on the left: at every width
            _key(CHUNKS, f"chunks {estimated}{format_size(last.chunk_peak)}"),
            _key(OTHER, f"other {estimated}{format_size(last.other_at_peak)}"),
            _key(BUDGET, f"budget {format_size(last.device_capacity)}", rank=3),
            _plain(f"peak {format_size(last.device_peak)}", style="red" if over else "", rank=2),
        ]
        return fit_line(items, self._width(), seps=CAPTION_SEPS)

    def host_caption(self) -> Text:
        if not self.samples:
            return Text("host")
        last = self.samples[-1]
        engine = self.engine_host_bytes(last)
        untracked = max(0, last.process_rss - engine)
        disk = self.uses_disk
        unit, _ = size_unit(max(engine, last.process_rss, last.disk_model if disk else 0))
        items = [
            _plain("host  ", style="bold"),
            _plain(f"({unit})", style="dim"),
            _key(ENGINE_HOST, f"engine {format_size(engine)}"),
            # The kernel's high-water mark over the step where it has one (Linux), said in
            # the border title; else a sample at the step's end, said here.
            _key(RSS, f"RSS {format_size(last.process_rss)}"
                 + ("" if last.rss_exact else " (sampled)")),
        ]
        if disk:
            items.append(_key(DISK, f"disk {format_size(last.disk_model)}"))
        items.append(_plain(f"untracked {format_size(untracked)}", style="bold", rank=3))
        if self.host_total is not None:
            items.append(_plain(f"of {format_size(self.host_total)}", style="dim", rank=1))
        return fit_line(items, self._width(), seps=CAPTION_SEPS)

    @staticmethod
    def _series(
        plot: SizedPlot,
        steps: list[int],
        values: list[float],
        colour: Colour,
        *,
        fill: bool = False,
    ) -> None:
        # Two braille dots per column: more points than that cost time and show nothing.
        xs, ys = downsample(steps, values, max(1, 2 * plot.size.width))
        plot.plt.plot(xs, ys, color=colour, marker="braille", fillx=fill)

    @staticmethod
    def _value_axis(plot: SizedPlot, top: float) -> None:
        ticks = value_ticks(top, plot.size.height)
        plot.plt.yticks(ticks, [f"{t:g}" for t in ticks])

    def redraw(self) -> None:
        """Draw the recorded window; called at the screen's refresh rate, not per step."""
        if not self.samples:
            return
        exact = self.samples[-1].rss_exact
        self.border_title = "Memory · host RSS: each step's peak" if exact else "Memory"
        self.query_one("#device-caption", Static).update(self.device_caption())
        self.query_one("#host-caption", Static).update(self.host_caption())
        if not all(plot.laid_out for plot in self.query(SizedPlot)):
            return  # the charts are drawn when they have their size (SizedPlot)
        samples = list(self.samples)
        steps = [s.step for s in samples]
        ticks = step_ticks(steps)

        stacked = [s.chunk_peak + s.other_at_peak for s in samples]
        top = max(max(stacked), max(s.device_peak for s in samples))
        top = max(top, max(s.device_capacity for s in samples))
        _, scale = size_unit(top)
        device = self.query_one("#device-plot", SizedPlot)
        plt = device.plt
        plt.clear_data()
        self._series(device, steps, [v / scale for v in stacked], OTHER, fill=True)
        self._series(device, steps, [s.chunk_peak / scale for s in samples], CHUNKS, fill=True)
        # The budget as a series drawn last, so that it shows over the filled areas.
        budget = [s.device_capacity / scale for s in samples]
        if len(steps) == 1:
            plt.plot([steps[0] - 0.5, steps[0] + 0.5], budget * 2, color=BUDGET, marker="hd")
        else:
            plt.plot(steps, budget, color=BUDGET, marker="hd")
        plt.ylim(0, top / scale * 1.05)
        self._value_axis(device, top / scale * 1.05)
        plt.xticks([])  # the host chart below labels the same steps: a row more for data
        device.refresh()

        engine = [self.engine_host_bytes(s) for s in samples]
        disk = [s.disk_model for s in samples] if self.uses_disk else []
        top = max(max(engine), max(s.process_rss for s in samples), max(disk, default=0), 1)
        _, scale = size_unit(top)
        host = self.query_one("#host-plot", SizedPlot)
        plt = host.plt
        plt.clear_data()
        self._series(host, steps, [v / scale for v in engine], ENGINE_HOST, fill=True)
        self._series(host, steps, [s.process_rss / scale for s in samples], RSS)
        if disk:
            self._series(host, steps, [v / scale for v in disk], DISK)
        plt.ylim(0, top / scale * 1.1)
        self._value_axis(host, top / scale * 1.1)
        plt.xticks(ticks)
        host.refresh()
