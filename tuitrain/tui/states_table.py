"""StatesTable: how many parameters are in each TensorState, on the device and on the host,
and on the disk when a host budget sends chunks there."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from engine.chunks.state import TensorState
from engine.telemetry import MemorySnapshot
from tuitrain.formatting import format_size

LOCATIONS = ("device", "host")
WITH_DISK = ("device", "host", "disk")
# Columns per location: two fill the side panel (52 wide), and so do three.
LOCATION_WIDTH = {2: 15, 3: 9}
BYTES_ROW = "param bytes"  # the chunks' parameter payload; the memory chart adds the rest


def locations_of(memory: MemorySnapshot) -> tuple[str, ...]:
    """The locations a snapshot reports: the disk's only when the run has a disk tier."""
    return WITH_DISK if "disk" in memory.states else LOCATIONS


class StatesTable(DataTable):
    """One row per TensorState (parameters per location) and a row of parameter bytes; a
    "disk" column appears when the run reports one."""

    DEFAULT_CSS = """
    StatesTable {
        height: auto;
        border: round $primary-muted;
        border-title-color: $text-primary;
        scrollbar-size: 0 0;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="none", zebra_stripes=True, show_cursor=False)
        self.border_title = "Tensor states (parameters)"
        self.can_focus = False  # nothing to select: the table is read, not navigated
        self.locations: tuple[str, ...] = ()

    def on_mount(self) -> None:
        self._build(LOCATIONS)

    def _build(self, locations: tuple[str, ...]) -> None:
        """Columns for `locations`, every cell "-" until a step reports counts (0 would be
        a count)."""
        self.clear(columns=True)
        self.locations = locations
        self.add_column("state", key="state", width=14)
        for location in locations:
            self.add_column(Text(location, justify="right"), key=location,
                            width=LOCATION_WIDTH[len(locations)])
        empty = ["-"] * len(locations)
        for state in TensorState:
            self.add_row(state.value, *self._cells(empty), key=state.value)
        self.add_row(Text(BYTES_ROW, style="italic"), *self._cells(empty), key=BYTES_ROW)

    def show(self, memory: MemorySnapshot) -> None:
        """Fill the cells from one snapshot; missing states count as zero."""
        if locations_of(memory) != self.locations:
            self._build(locations_of(memory))
        for state in TensorState:
            counts = [memory.states.get(loc, {}).get(state.value, 0) for loc in self.locations]
            self._update_row(state.value, self._cells(counts))
        nbytes = [sum(c.nbytes for c in memory.chunks if c.location == loc)
                  for loc in self.locations]
        self._update_row(BYTES_ROW, self._cells(nbytes, sizes=True))

    def _update_row(self, row: str, cells: list[Text]) -> None:
        for location, cell in zip(self.locations, cells, strict=True):
            if self.get_cell(row, location) != cell:  # an unchanged cell costs no repaint
                self.update_cell(row, location, cell)

    def cell(self, state: str, location: str) -> str:
        """The text of one cell, e.g. cell("COMPUTE", "device") or cell("param bytes", "host")."""
        value = self.get_cell(state, location)
        return value.plain if isinstance(value, Text) else str(value)

    @staticmethod
    def _cells(values: list, *, sizes: bool = False) -> list[Text]:
        cells = []
        for value in values:
            if isinstance(value, str):
                text = value
            elif sizes:
                text = format_size(value)
            else:
                text = f"{value:,}"
            style = "dim" if value in (0, "-") else ""
            cells.append(Text(text, style=style, justify="right"))
        return cells
