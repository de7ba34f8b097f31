"""MemoryChart: device and host memory over the last steps, drawn with plotext.

Device: model data (chunks and the optimizer state kept there) and the step's peak, which
adds the non-model data (activations, workspace), against the budget line; the non-model
peak alone is in the step panel. Host: model data kept there and the whole process's RSS,
against the machine's total memory.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

import psutil
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static
from textual_plotext import PlotextPlot

from engine.telemetry import StepStats
from tuitrain.formatting import format_size
from tuitrain.tui.axes import size_unit, step_ticks
from tuitrain.tui.downsample import downsample

HISTORY = 600  # steps kept for the charts; older samples scroll off

Colour = tuple[int, int, int]

# One colour per series, shared by the plot line and its caption.
MODEL = (80, 200, 120)
PEAK = (255, 165, 0)
BUDGET = (230, 70, 70)
HOST_MODEL = (90, 150, 255)
RSS = (210, 110, 230)


class MemorySample(NamedTuple):
    step: int
    device_model: int
    device_non_model: int
    device_peak: int
    device_capacity: int
    host_model: int
    process_rss: int


def host_total_bytes() -> int | None:
    """Total memory of this machine, or None where psutil cannot tell."""
    try:
        return int(psutil.virtual_memory().total)
    except Exception:  # an odd platform must not take the screen down
        return None


def _key(colour: Colour, label: str) -> Text:
    return Text.assemble(("━ ", "rgb({},{},{})".format(*colour)), label, " ")


class MemoryChart(Vertical):
    """Two stacked line charts (device, host) over a bounded window of steps."""

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
    MemoryChart > PlotextPlot {
        height: 1fr;
    }
    """

    def __init__(self, *, history: int = HISTORY, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Memory"
        self.samples: deque[MemorySample] = deque(maxlen=history)
        self.host_total = host_total_bytes()

    def compose(self) -> ComposeResult:
        yield Static("device: waiting for the first step…", id="device-caption", classes="caption")
        yield PlotextPlot(id="device-plot")
        yield Static("host", id="host-caption", classes="caption")
        yield PlotextPlot(id="host-plot")

    def record(self, stats: StepStats) -> None:
        """Keep one step's numbers; cheap, so every step can be recorded."""
        mem = stats.memory
        self.samples.append(
            MemorySample(
                step=stats.step,
                device_model=mem.device_model,
                device_non_model=mem.device_non_model_peak,
                device_peak=mem.device_peak,
                device_capacity=mem.device_capacity,
                host_model=mem.host_model,
                process_rss=mem.process_rss,
            )
        )

    def device_caption(self) -> Text:
        if not self.samples:
            return Text("device: waiting for the first step…")
        last = self.samples[-1]
        unit, _ = size_unit(max(last.device_peak, last.device_capacity))
        # The peak line is model + non-model data; its caption names the total it is drawn
        # at, which keeps the line within the chart's width at 120 columns.
        return Text.assemble(
            ("device ", "bold"),
            (f"{unit} ", "dim"),
            _key(MODEL, f"model {format_size(last.device_model)}"),
            _key(PEAK, f"peak {format_size(last.device_peak)}"),
            _key(BUDGET, f"budget {format_size(last.device_capacity)}"),
        )

    def host_caption(self) -> Text:
        if not self.samples:
            return Text("host")
        last = self.samples[-1]
        unit, _ = size_unit(max(last.host_model, last.process_rss))
        total = "N/A" if self.host_total is None else format_size(self.host_total)
        return Text.assemble(
            ("host   ", "bold"),
            (f"{unit} ", "dim"),
            _key(HOST_MODEL, f"model {format_size(last.host_model)}"),
            _key(RSS, f"RSS {format_size(last.process_rss)}"),
            (f"of {total}", "dim"),
        )

    @staticmethod
    def _line(plot: PlotextPlot, steps: list[int], values: list[float], colour: Colour) -> None:
        # Two braille dots per column: more points than that cost time and show nothing.
        xs, ys = downsample(steps, values, max(1, 2 * plot.size.width))
        plot.plt.plot(xs, ys, color=colour, marker="braille")

    def redraw(self) -> None:
        """Draw the recorded window; called at the screen's refresh rate, not per step."""
        if not self.samples:
            return
        self.query_one("#device-caption", Static).update(self.device_caption())
        self.query_one("#host-caption", Static).update(self.host_caption())
        steps = [s.step for s in self.samples]
        ticks = step_ticks(steps)

        top = max(max(s.device_peak, s.device_capacity) for s in self.samples)
        _, scale = size_unit(top)
        device = self.query_one("#device-plot", PlotextPlot)
        plt = device.plt
        plt.clear_data()
        self._line(device, steps, [s.device_peak / scale for s in self.samples], PEAK)
        self._line(device, steps, [s.device_model / scale for s in self.samples], MODEL)
        plt.hline(self.samples[-1].device_capacity / scale, BUDGET)
        plt.ylim(0, top / scale * 1.05)
        plt.xticks([])  # the host chart below labels the same steps: a row more for data
        device.refresh()

        top = max(max(s.host_model, s.process_rss) for s in self.samples)
        _, scale = size_unit(top)
        host = self.query_one("#host-plot", PlotextPlot)
        plt = host.plt
        plt.clear_data()
        self._line(host, steps, [s.process_rss / scale for s in self.samples], RSS)
        self._line(host, steps, [s.host_model / scale for s in self.samples], HOST_MODEL)
        plt.ylim(0, top / scale * 1.1)
        plt.xticks(ticks)
        host.refresh()
