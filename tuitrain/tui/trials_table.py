"""TrialsTable: one row per setting the run has used, what each achieved, the best marked.

The rows come from tuitrain.trials (the same bookkeeping the headless runner prints). The
cursor picks the row that `s` (or Enter) saves as a preset: it stays on the setting in
force until the user moves it to another row, and then stays on that one.
"""

from __future__ import annotations

from rich.text import Text
from textual.widgets import DataTable

from tuitrain.formatting import format_rate, format_seconds, format_size
from tuitrain.trials import BEST_MIN_SETTLED, Setting, Trial, best_trial, format_spread

BEST = ("★", "bold yellow")
OVER = ("!", "bold red")
IN_FORCE = " ●"  # after the policy of the setting in force
# (key, label, width): numbers are right-aligned in their width, whose first cell is the
# space between columns (no cell padding, so the table fits in 80 columns).
COLUMNS = (
    ("mark", "", 2),
    ("policy", "policy", 7),
    ("margin", "margin", 7),
    ("budget", "budget", 10),
    ("steps", "steps", 6),
    ("seconds", "s/step", 9),
    ("spread", "±", 5),
    ("rate", "tok/s", 7),
    ("peak", "peak", 10),
    ("copied", "copied", 10),
    ("rss", "RSS", 10),
)
LEGEND = (
    f"★ fastest within budget ({BEST_MIN_SETTLED}+ settled steps) · ● in force · "
    "! over budget · Enter/s: save row"
)


def row_key(setting: Setting) -> str:
    return f"{setting.policy}|{setting.margin_ratio}|{setting.device_budget}"


def trial_cells(trial: Trial, *, best: bool, in_force: bool) -> list[Text]:
    """The cells of one row, in COLUMNS order."""
    if best:
        mark = Text(BEST[0], style=BEST[1])
    elif not trial.within_budget:
        mark = Text(OVER[0], style=OVER[1])
    else:
        mark = Text("")
    waiting = "…"  # no settled step yet: the medians come with the next one

    def number(text: str, style: str = "") -> Text:
        return Text(text, style=style, justify="right")

    policy = Text(trial.policy + (IN_FORCE if in_force else ""), style="bold" if in_force else "")
    seconds = waiting if trial.step_seconds is None else format_seconds(trial.step_seconds)
    rate = waiting if trial.tokens_per_second is None else format_rate(trial.tokens_per_second)
    copied = waiting if trial.bytes_copied is None else format_size(trial.bytes_copied)
    return [
        mark,
        policy,
        number(f"{trial.margin_ratio:.2f}"),
        number(format_size(trial.device_budget)),
        number(str(trial.steps)),
        number(seconds, "bold" if best else ""),
        number(format_spread(trial.step_seconds_spread) or waiting, "dim"),
        number(rate, "bold" if best else ""),
        number(format_size(trial.device_peak), "" if trial.within_budget else "bold red"),
        number(copied),
        number(format_size(trial.process_rss)),
    ]


class TrialsTable(DataTable):
    """The trials of this run; the highlighted row is the one a save writes."""

    DEFAULT_CSS = """
    TrialsTable {
        height: 1fr;
        border: round $primary-muted;
        border-title-color: $text-primary;
        border-subtitle-color: $text-muted;
        scrollbar-size: 0 1;
    }
    TrialsTable:focus {
        border: round $primary;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=True, cell_padding=0)
        self.border_title = "Trials: one row per setting (medians of settled steps, ± spread)"
        self.border_subtitle = LEGEND
        self.trials: list[Trial] = []
        self.in_force: Setting | None = None
        # The cursor follows the setting in force while it is on its row; a row the user
        # moves it to stays selected.
        self.following = True
        self._placed: list[str] = []  # rows the cursor was moved to here, not by the user

    def on_mount(self) -> None:
        for key, label, width in COLUMNS:
            justify = "left" if key in ("mark", "policy") else "right"
            self.add_column(Text(label, justify=justify), key=key, width=width)

    def show(self, trials: list[Trial], in_force: Setting | None) -> None:
        """Draw these rows (in order, new ones appended), the best marked."""
        if len(trials) < len(self.trials):  # a new run: start over
            self.clear()
        best = best_trial(trials)
        self.trials = list(trials)
        self.in_force = in_force
        for trial in trials:
            key = row_key(trial.setting)
            cells = trial_cells(
                trial,
                best=best is not None and trial.setting == best.setting,
                in_force=trial.setting == in_force,
            )
            if key in self.rows:
                for (column, _, _), cell in zip(COLUMNS, cells, strict=True):
                    if self.get_cell(key, column) != cell:
                        self.update_cell(key, column, cell)
            else:
                self.add_row(*cells, key=key)
        if self.following and in_force is not None:
            self._place_cursor(in_force)

    def reset(self) -> None:
        self.clear()
        self._placed.clear()
        self.trials = []
        self.in_force = None
        self.following = True

    def follow_in_force(self) -> None:
        """Put the cursor back on the setting in force, and keep it there."""
        self.following = True
        if self.in_force is not None:
            self._place_cursor(self.in_force)

    @property
    def selected(self) -> Trial | None:
        """The trial under the cursor; None before the first step."""
        if not self.trials or not self.row_count:
            return None
        key = self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value
        return next((t for t in self.trials if row_key(t.setting) == key), None)

    def select(self, setting: Setting) -> None:
        """Move the cursor to `setting`'s row, as the user would."""
        self._place_cursor(setting)
        self.following = setting == self.in_force

    def _place_cursor(self, setting: Setting) -> None:
        key = row_key(setting)
        if key in self.rows:
            index = self.get_row_index(key)
            if index != self.cursor_row:
                self._placed.append(key)
                self.move_cursor(row=index, animate=False)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        key = event.row_key.value
        if event.data_table is not self or self.in_force is None:
            return
        if key in self._placed:  # the answer to a move made here, maybe a while ago
            self._placed.remove(key)
            return
        if event.cursor_row != self.cursor_row:
            # Stale: the cursor moved on before this message was handled (the first row's
            # highlight can arrive after the cursor followed a new setting).
            return
        self.following = key == row_key(self.in_force)

    def cell_text(self, setting: Setting, column: str) -> str:
        value = self.get_cell(row_key(setting), column)
        return value.plain if isinstance(value, Text) else str(value)
