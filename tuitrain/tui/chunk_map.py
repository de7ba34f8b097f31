"""ChunkMap: one cell per chunk, showing where it lives (the device, the host, or the disk
under a host budget), whether it is in use right now, and whether it is frozen (a LoRA
run's base weights: payload only, no gradients or optimizer state)."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from engine.chunks.state import TensorState
from engine.telemetry import ChunkInfo
from tuitrain.tui.fitting import KEEP, Item, fit_line

# Glyphs differ as well as colours, so the map reads without colour too.
DEVICE = ("■", "green")
HOST = ("□", "dodger_blue2")
DISK = ("▤", "tan")  # its payload is in the scratch folder
IN_USE = ("◆", "bold yellow")
LOCATED = {"device": DEVICE, "host": HOST, "disk": DISK}
# A frozen chunk: the smaller glyph of its location, in the same colour.
FROZEN = {"device": ("▪", "green"), "host": ("▫", "dodger_blue2"), "disk": ("▫", "tan")}


def cell_for(chunk: ChunkInfo) -> tuple[str, str]:
    if chunk.state == TensorState.COMPUTE.value:
        return IN_USE
    if chunk.frozen:
        return FROZEN.get(chunk.location, FROZEN["host"])
    return LOCATED.get(chunk.location, HOST)


class ChunkMap(VerticalScroll):
    """The chunk grid under a legend; wraps to the width and scrolls past its height.

    Cells are spaced while they fit in the visible area and packed tightly beyond that,
    so a few dozen chunks read as a grid and a thousand still fit on a laptop screen.
    """

    DEFAULT_CSS = """
    ChunkMap {
        height: 1fr;
        border: round $primary-muted;
        border-title-color: $text-primary;
        scrollbar-size-vertical: 1;
    }
    ChunkMap > #chunk-legend {
        height: 1;
    }
    ChunkMap > #chunk-cells {
        height: auto;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Chunks"
        self.can_focus = False
        self.chunks: list[ChunkInfo] = []

    def compose(self) -> ComposeResult:
        yield Static(self._legend(), id="chunk-legend")
        yield Static("waiting for the first step…", id="chunk-cells")

    def show(self, chunks: list[ChunkInfo]) -> None:
        """Draw these chunks (in index order) if they differ from what is drawn."""
        if chunks == self.chunks:
            return
        self.chunks = list(chunks)
        self._redraw()

    def on_resize(self) -> None:
        if self.chunks:
            self._redraw()

    @property
    def cell_count(self) -> int:
        """Cells drawn, one per chunk."""
        glyphs = {glyph for glyph, _ in (DEVICE, HOST, DISK, IN_USE, *FROZEN.values())}
        return sum(self.cells_text.count(glyph) for glyph in glyphs)

    @property
    def cells_text(self) -> str:
        return self._cells().plain

    def _redraw(self) -> None:
        self.query_one("#chunk-legend", Static).update(self._legend())
        self.query_one("#chunk-cells", Static).update(self._cells())

    def _legend(self) -> Text:
        """Chunks per location (the disk only when some are there), and those in use."""
        count = {loc: sum(c.location == loc for c in self.chunks) for loc in ("device", "disk")}
        host = len(self.chunks) - count["device"] - count["disk"]
        in_use = sum(cell_for(c) == IN_USE for c in self.chunks)
        total = f"· {len(self.chunks)} chunks"
        frozen = sum(c.frozen for c in self.chunks)
        if frozen:
            total += f", {frozen} frozen ▪▫"
        if count["disk"]:
            # A fourth key: the total goes first when the panel is too narrow for it.
            items = [Item(((glyph, style), (f" {label}", "")), rank=KEEP)
                     for (glyph, style), label in (
                         (DEVICE, f"device {count['device']}"), (HOST, f"host {host}"),
                         (DISK, f"disk {count['disk']}"), (IN_USE, f"in use {in_use}"))]
            items.append(Item(((total, "dim"),), rank=1))
            return fit_line(items, self.scrollable_content_region.width or 40, seps=("  ", " "))
        return Text.assemble(
            (DEVICE[0], DEVICE[1]),
            f" device {count['device']}  ",
            (HOST[0], HOST[1]),
            f" host {host}  ",
            (IN_USE[0], IN_USE[1]),
            f" in use {in_use}  ",
            (total, "dim"),
        )

    def _cells(self) -> Text:
        width = max(1, self.scrollable_content_region.width or 40)
        rows = max(1, (self.scrollable_content_region.height or 8) - 1)
        step = 2 if 2 * len(self.chunks) <= width * rows else 1
        per_line = max(1, width // step)
        text = Text(no_wrap=True, overflow="crop")
        for i, chunk in enumerate(sorted(self.chunks, key=lambda c: c.index)):
            if i and i % per_line == 0:
                text.append("\n")
            glyph, style = cell_for(chunk)
            text.append(glyph, style=style)
            if step == 2:
                text.append(" ")
        return text
