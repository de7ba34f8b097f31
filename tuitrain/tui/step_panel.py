"""StepPanel: where the last step's time went, the bytes it moved (to the disk and back too,
under a host budget), its activation peak, and the loss so far."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import Static

from engine.telemetry import StepStats
from tuitrain.formatting import format_seconds, format_size
from tuitrain.tui.axes import step_ticks
from tuitrain.tui.downsample import downsample, mean
from tuitrain.tui.sized_plot import SizedPlot

LOSS_HISTORY = 2000  # losses kept for the curve
BAR_WIDTH = 12
PHASES = (
    ("forward", "green"),
    ("backward", "cyan"),
    ("optimizer", "magenta"),
    ("transfer", "yellow"),
)


def uses_disk(stats: StepStats) -> bool:
    """Whether the step had chunk bytes on disk or moved any there or back."""
    return bool(stats.memory.disk_model or stats.bytes_disk_read or stats.bytes_disk_written)


def disk_lines(stats: StepStats) -> list[Text]:
    """The disk tier in the step: bytes read and written, the time the step waited for
    them, and the rate they moved at over the whole step."""
    moved = stats.bytes_disk_read + stats.bytes_disk_written
    rate = moved / stats.seconds if stats.seconds > 0 else 0.0
    # Against the disk measured at start: the share of the step its reads and writes would
    # keep the disk busy at full speed.
    memory = stats.memory
    full_speed = sum(nbytes / bandwidth for nbytes, bandwidth in (
        (stats.bytes_disk_read, memory.disk_read_bandwidth),
        (stats.bytes_disk_written, memory.disk_write_bandwidth)) if bandwidth > 0)
    busy = ([Text.assemble(("disk busy ", "dim"), (f"{full_speed / stats.seconds:.0%}", "bold"),
                           (" at full speed", "dim"))]
            if full_speed and stats.seconds > 0 else [])
    return [
        Text.assemble(
            ("disk read ", "dim"),
            (format_size(stats.bytes_disk_read), "bold"),
            ("  write ", "dim"),
            (format_size(stats.bytes_disk_written), "bold"),
        ),
        Text.assemble(
            ("disk wait ", "dim"),
            (format_seconds(stats.disk_wait), "bold"),
            ("  at ", "dim"),
            (f"{format_size(int(rate))}/s", "bold"),
        ),
        *busy,
    ]


def step_breakdown(stats: StepStats | None, held_out: tuple[int, float] | None = None) -> Text:
    """The step's loss (and the latest held-out loss), the time split as a small table with
    bars, the bytes moved each way (and to and from the disk when the run has one), and the
    peak of non-model data (activations, workspace) on the device.

    The loss is the first line, so that a small screen, which has no room for the curve,
    still shows it."""
    if stats is None:
        return Text("waiting for the first step…", style="dim")
    total = stats.seconds if stats.seconds > 0 else 1.0
    lines = [
        Text.assemble(
            ("step ", "dim"),
            (str(stats.step), "bold"),
            ("  took ", "dim"),
            (format_seconds(stats.seconds), "bold"),
            ("  loss ", "dim"),
            (f"{stats.loss:.4f}", "bold cyan"),
        )
    ]
    if held_out is not None:
        lines.append(Text.assemble(
            ("held-out loss ", "dim"), (f"{held_out[1]:.4f}", "bold"),
            (f" after step {held_out[0]}", "dim")))
    for name, colour in PHASES:
        seconds = getattr(stats, name)
        share = seconds / total
        filled = round(share * BAR_WIDTH)
        lines.append(
            Text.assemble(
                f"{name:<10}",
                (f"{format_seconds(seconds):>9}", "bold"),
                f" {share:>4.0%} ",
                ("█" * filled, colour),
                ("·" * (BAR_WIDTH - filled), "dim"),
            )
        )
    lines.append(
        Text.assemble(
            ("h2d ", "dim"),
            (format_size(stats.bytes_h2d), "bold"),
            ("  d2h ", "dim"),
            (format_size(stats.bytes_d2h), "bold"),
        )
    )
    if uses_disk(stats):
        lines.extend(disk_lines(stats))
    lines.append(
        Text.assemble(
            ("non-model peak ", "dim"),
            (format_size(stats.memory.device_non_model_peak), "bold"),
            ("  lr ", "dim"),
            (f"{stats.lr:.1e}", "bold"),
        )
    )
    if stats.skipped:
        lines.append(
            Text(f"update skipped (fp16 overflow), scale {stats.loss_scale:g}", style="yellow")
        )
    return Text("\n").join(lines)


class StepPanel(Horizontal):
    """The time split on the left, the loss curve on the right."""

    DEFAULT_CSS = """
    StepPanel {
        border: round $primary-muted;
        border-title-color: $text-primary;
        height: 1fr;
    }
    StepPanel > #step-times {
        width: 38;
        padding: 0 1 0 0;
    }
    StepPanel > #loss-plot {
        width: 1fr;
    }
    """

    def __init__(self, *, history: int = LOSS_HISTORY, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Step"
        self.losses: deque[tuple[int, float]] = deque(maxlen=history)
        self.evals: deque[tuple[int, float]] = deque(maxlen=history)  # held-out losses
        self.latest: StepStats | None = None

    def compose(self) -> ComposeResult:
        yield Static(step_breakdown(None), id="step-times")
        yield SizedPlot(self.redraw_loss, id="loss-plot")

    def on_mount(self) -> None:
        self.query_one(SizedPlot).plt.title("loss")

    def record(self, stats: StepStats) -> None:
        """Keep one step's loss; cheap, so every step can be recorded."""
        self.losses.append((stats.step, stats.loss))
        self.latest = stats

    def record_eval(self, step: int, loss: float) -> None:
        """Keep a held-out loss, drawn as the curve's second line."""
        self.evals.append((step, loss))

    @property
    def times_text(self) -> str:
        """The time split as drawn (or what the panel says while it waits)."""
        content = self.query_one("#step-times", Static).content
        return content.plain if isinstance(content, Text) else str(content)

    def reset(self) -> None:
        """Forget the run shown (a restart begins a new one)."""
        self.losses.clear()
        self.evals.clear()
        self.latest = None
        self.redraw_breakdown()
        plot = self.query_one(SizedPlot)
        plot.plt.clear_data()  # the curve of the run before is not this one's
        plot.plt.title("loss")
        plot.refresh()

    def show_waiting(self, message: str) -> None:
        """What the panel says until the first step arrives."""
        if self.latest is None:
            self.query_one("#step-times", Static).update(Text(message, style="dim"))

    def show_first_step(self, *, paused: bool) -> None:
        """Before the first step, what the run is doing (a no-op once a step has come)."""
        self.show_waiting(
            "paused before the first step: space resumes" if paused
            else "first step running: it also records the order the chunks are used in, "
            "so it takes longer than the rest…"
        )

    def redraw_breakdown(self) -> None:
        """Draw the latest step's split; cheap."""
        held_out = self.evals[-1] if self.evals else None
        self.query_one("#step-times", Static).update(step_breakdown(self.latest, held_out))

    @property
    def lines(self) -> int:
        """Rows the step's numbers take (the app gives the panel that many on a small
        screen)."""
        return len(self.times_text.splitlines())

    def redraw_loss(self) -> None:
        """Draw the loss curve; costs a plotext build, so the app calls it less often."""
        plot = self.query_one(SizedPlot)
        if not self.losses or not plot.laid_out:
            return  # drawn when it has its size (SizedPlot)
        plt = plot.plt
        plt.clear_data()
        # The numbers are the breakdown's (its first line): drawn on another timer, a value
        # here would be another step's beside it.
        plt.title("loss")
        steps = [s for s, _ in self.losses]
        # Two braille dots per column; a group's mean smooths the loss instead of hiding it.
        xs, ys = downsample(
            steps, [v for _, v in self.losses], max(1, 2 * plot.size.width), reduce=mean
        )
        plt.plot(xs, ys, color="cyan", marker="braille")
        if self.evals:
            plt.plot([s for s, _ in self.evals], [v for _, v in self.evals], color="orange",
                     marker="dot", label="held-out")
        plt.xticks(step_ticks(steps))
        plot.refresh()
