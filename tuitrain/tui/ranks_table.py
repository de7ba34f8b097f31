"""RanksTable: in a data-parallel run, one row per rank with its own memory.

Each rank holds a shard of every chunk and gathers chunks whole while it uses them, so its
device peak and its host bytes are its own; the rest of the screen shows rank 0. Hidden in
a single-process run.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from engine.telemetry import StepStats
from tuitrain.formatting import format_size

# (key, label, width): numbers right-aligned in their width.
COLUMNS = (
    ("rank", "rank", 5),
    ("step", "step", 7),
    ("peak", "device peak", 12),
    ("budget", "budget", 10),
    ("device", "chunks dev", 11),
    ("host", "chunks host", 12),
    ("rss", "RSS", 10),
)


def rank_cells(rank: int, stats: StepStats | None) -> list[Text]:
    """One row's cells, in COLUMNS order; "-" until the rank reports a step."""
    if stats is None:
        return [Text(str(rank))] + [Text("-", style="dim", justify="right")] * (len(COLUMNS) - 1)
    m = stats.memory
    over = m.device_peak > stats.device_budget

    def number(text: str, style: str = "") -> Text:
        return Text(text, style=style, justify="right")

    return [
        Text(str(rank), style="bold" if rank == 0 else ""),
        number(str(stats.step)),
        number(format_size(m.device_peak), "bold red" if over else ""),
        number(format_size(stats.device_budget)),
        number(format_size(m.device_model)),
        number(format_size(m.host_model)),
        number(format_size(m.process_rss)),
    ]


class RanksTable(DataTable):
    """The latest step each rank reported, and its memory in it."""

    DEFAULT_CSS = """
    RanksTable {
        display: none;
        height: auto;
        max-height: 10;
        border: round $primary-muted;
        border-title-color: $text-primary;
        scrollbar-size: 0 1;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="none", zebra_stripes=True, show_cursor=False)
        self.border_title = "Ranks (each its own shards; the panels show rank 0)"
        self.can_focus = False
        self.world = 1
        self.latest: dict[int, StepStats] = {}
        self._stale = False

    def on_mount(self) -> None:
        for key, label, width in COLUMNS:
            justify = "left" if key == "rank" else "right"
            self.add_column(Text(label, justify=justify), key=key, width=width)

    def start(self, world: int) -> None:
        """A run of `world` ranks started: a row each, empty until its first step."""
        self.world = world
        self.latest.clear()
        self.clear()
        for rank in range(world):
            self.add_row(*rank_cells(rank, None), key=str(rank))

    def record(self, rank: int, stats: StepStats) -> None:
        """Rank `rank` finished a step; drawn at the next `redraw`."""
        self.latest[rank] = stats
        self._stale = True

    def redraw(self) -> None:
        if not self._stale:
            return
        self._stale = False
        for rank, stats in self.latest.items():
            if str(rank) not in self.rows:
                continue
            for (key, _, _), cell in zip(COLUMNS, rank_cells(rank, stats), strict=True):
                if self.get_cell(str(rank), key) != cell:
                    self.update_cell(str(rank), key, cell)

    def cell(self, rank: int, column: str) -> str:
        value = self.get_cell(str(rank), column)
        return value.plain if isinstance(value, Text) else str(value)
