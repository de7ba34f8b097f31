"""StatesTable: how many parameters are in each TensorState, on the device and on the host."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from engine.chunks.state import TensorState
from engine.telemetry import MemorySnapshot
from tuitrain.formatting import format_size

LOCATIONS = ("device", "host")
BYTES_ROW = "param bytes"  # the chunks' parameter payload; the memory chart adds the rest


class StatesTable(DataTable):
    """One row per TensorState (parameters per location) and a row of parameter bytes."""

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

    def on_mount(self) -> None:
        self.add_column("state", key="state", width=14)
        for location in LOCATIONS:
            self.add_column(Text(location, justify="right"), key=location, width=15)
        for state in TensorState:  # "-" until a step reports counts: 0 would be a count
            self.add_row(state.value, *self._cells(["-", "-"]), key=state.value)
        self.add_row(Text(BYTES_ROW, style="italic"), *self._cells(["-", "-"]), key=BYTES_ROW)

    def show(self, memory: MemorySnapshot) -> None:
        """Fill the cells from one snapshot; missing states count as zero."""
        for state in TensorState:
            counts = [memory.states.get(loc, {}).get(state.value, 0) for loc in LOCATIONS]
            self._update_row(state.value, self._cells(counts))
        nbytes = [sum(c.nbytes for c in memory.chunks if c.location == loc) for loc in LOCATIONS]
        self._update_row(BYTES_ROW, self._cells(nbytes, sizes=True))

    def _update_row(self, row: str, cells: list[Text]) -> None:
        for location, cell in zip(LOCATIONS, cells, strict=True):
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
