"""TrialsTable: one row per setting the run has used, what each achieved, the best marked;
and, while the tuner searches (`a`), one row per setting it considers, with its forecast and
why it was not tried.

The rows come from tuitrain.trials (the same bookkeeping the headless runner prints) and
tuitrain.tune's trials. The cursor picks the row that `s` (or Enter) saves as a preset: it
stays on the setting in force until the user moves it to another row, and then stays on that
one. The table fits its width with no column scrolled off: the last column, a note (the
peaks of a measured row, why a candidate was not tried), takes what the others leave, and
what does not fit in it is cut.
"""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.widgets import DataTable

from tuitrain import tune
from tuitrain.formatting import format_rate, format_seconds, format_size, plural
from tuitrain.trials import BEST_MIN_SETTLED, Setting, Trial, best_trial, format_spread

BEST = ("★", "bold yellow")
OVER = ("!", "bold red")
IN_TRIAL = ("▶", "bold cyan")
NO_FIT = ("✗", "red")
IN_FORCE = " ●"  # after the policy of the setting in force
# (key, label, width): numbers are right-aligned in their width, whose first cell is the
# space between columns (no cell padding). With the note at its least, they make 77 cells:
# an 80-column table with its border and scrollbar.
COLUMNS = (
    ("mark", "", 2),
    ("policy", "policy", 6),
    ("margin", "margin", 7),
    ("budget", "budget", 7),
    ("accum", "μb", 3),
    ("steps", "steps", 6),
    ("forecast", "fcst", 9),
    ("seconds", "s/step", 9),
    ("spread", "±", 5),
    ("rate", "tok/s", 6),
    ("note", " note", 17),
)
NOTE_MIN = COLUMNS[-1][2]
FRAME = 3  # the border's two cells and the scrollbar's one
LEGEND = (
    f"★ fastest within budget ({BEST_MIN_SETTLED}+ settled steps) · ▶ in trial · ● in force · "
    "! over budget · ✗ does not fit · μb: micro-batches a step, c: checkpointing · "
    "Enter/s: save row"
)


def row_key(setting: Setting) -> str:
    return (f"{setting.policy}|{setting.margin_ratio}|{setting.device_budget}|"
            f"{setting.micro_batches}|{setting.activation_checkpointing}")


def candidate_setting(candidate: tune.Candidate) -> Setting:
    return Setting(candidate.policy, round(candidate.margin_ratio, 4), candidate.device_budget,
                   candidate.grad_accum, candidate.activation_checkpointing)


def short_size(nbytes: int) -> str:
    """A budget in a narrow column: 6.0G, 512.0M."""
    return format_size(nbytes).replace(" ", "").replace("iB", "")


def _number(text: str, style: str = "") -> Text:
    return Text(text, style=style, justify="right")


def candidate_note(trial: tune.Trial) -> str:
    """Why the tuner has not measured a candidate (or not to the end), in a few words; for
    one it measured, what the search decided by. That is its trial's own steps, while the
    row's s/step is the median of every settled step the run made with the setting (before
    the search, between its trials, after it), so the note names its figure."""
    status = trial.status
    if status == tune.DOES_NOT_FIT:
        return trial.forecast.over or f"{status}: {trial.reason}"
    if status == tune.SLOWER and trial.slower is not None:
        return f"fcst {trial.slower:+.0%} slower"
    if status == tune.STOPPED_EARLY and trial.slower is not None:
        # The search compares a stopped trial's fastest step with the best's median.
        return (f"stopped: {trial.slower:+.0%}, fastest of its "
                f"{plural(len(trial.steps), 'trial step')} {format_seconds(min(trial.steps))}")
    if status == tune.MEASURING:
        return f"measuring: {len(trial.steps)} steps"
    if status == tune.NOT_REACHED:
        return f"untried: {trial.reason}"
    if status == tune.PENDING:
        return "to try"
    if status == tune.MEASURED and trial.measured is not None:
        return (f"tune: {format_seconds(trial.measured)}, median of its "
                f"{plural(len(trial.steps), 'trial step')}")
    return f"{status}: {trial.reason}" if trial.reason else status


def trial_cells(trial: Trial | None, *, best: bool, in_force: bool,
                candidate: tune.Trial | None = None, tokens: int | None = None,
                setting: Setting | None = None) -> list[Text]:
    """The cells of one row, in COLUMNS order: a setting the run used (`trial`), one the
    tuner considers (`candidate`, with the run's `tokens` per step), or both."""
    if setting is None:
        assert trial is not None or candidate is not None
        setting = trial.setting if trial is not None else candidate_setting(candidate.candidate)
    if best:
        mark = Text(BEST[0], style=BEST[1])
    elif trial is not None and not trial.within_budget:
        mark = Text(OVER[0], style=OVER[1])
    elif candidate is not None and candidate.status == tune.MEASURING:
        mark = Text(IN_TRIAL[0], style=IN_TRIAL[1])
    elif candidate is not None and candidate.status == tune.DOES_NOT_FIT:
        mark = Text(NO_FIT[0], style=NO_FIT[1])
    else:
        mark = Text("")
    waiting = "…"  # no settled step yet: the medians come with the next one
    fits = candidate is not None and candidate.forecast.fits
    forecast = format_seconds(candidate.forecast.seconds) if fits else ""
    policy = Text(setting.policy + (IN_FORCE if in_force else ""),
                  style="bold" if in_force else "")
    strong = "bold" if best else ""
    if trial is None:  # a candidate the run has not used: its forecast rate, dimmed
        rate = (_number(format_rate(tokens / candidate.forecast.seconds), "dim italic")
                if fits and tokens and candidate.forecast.seconds > 0 else _number(""))
        cells = [_number(""), _number(""), _number(""), rate]
        note = candidate_note(candidate)
    else:
        seconds = waiting if trial.step_seconds is None else format_seconds(trial.step_seconds)
        measured_rate = trial.tokens_per_second
        cells = [
            _number(str(trial.steps)),
            _number(seconds, strong),
            _number(format_spread(trial.step_seconds_spread) or waiting, "dim"),
            _number(waiting if measured_rate is None else format_rate(measured_rate), strong),
        ]
        note = measured_note(trial)
        if candidate is not None and candidate.status != tune.PENDING:
            note = f"{candidate_note(candidate)}; {note}"
    peak_style = "bold red" if trial is not None and not trial.within_budget else ""
    return [
        mark,
        policy,
        _number(f"{setting.margin_ratio:.2f}"),
        _number(short_size(setting.device_budget)),
        _number(f"{setting.micro_batches}{'c' if setting.activation_checkpointing else ''}"),
        cells[0],
        _number(forecast, "dim"),
        *cells[1:],
        Text(" " + note, style=peak_style, no_wrap=True, overflow="ellipsis"),
    ]


def measured_note(trial: Trial) -> str:
    """The peaks of a measured row, most telling first (the device peak says why a row is
    over its budget)."""
    parts = [f"peak {format_size(trial.device_peak)}", f"RSS {format_size(trial.process_rss)}"]
    if trial.bytes_copied is not None:
        parts.append(f"{format_size(trial.bytes_copied)} copied")
    return ", ".join(parts)


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
        # The tuner's candidates, by row key, and the run's tokens per step (for their
        # forecast tokens/s).
        self.candidates: dict[str, tune.Trial] = {}
        self.tokens: int | None = None

    def on_mount(self) -> None:
        for key, label, width in COLUMNS:
            justify = "left" if key in ("mark", "policy", "note") else "right"
            self.add_column(Text(label, justify=justify), key=key, width=width)

    def on_resize(self, event: events.Resize) -> None:
        """The note takes the width the other columns leave."""
        fixed = sum(width for _, _, width in COLUMNS[:-1])
        column = self.columns.get("note")  # type: ignore[call-overload]
        width = max(NOTE_MIN, event.size.width - fixed - FRAME)  # the size with its border
        if column is not None and column.width != width:
            column.width = width
            self._require_update_dimensions = True
            self.refresh()

    def show(self, trials: list[Trial], in_force: Setting | None) -> None:
        """Draw these rows (in order, new ones appended), the best marked."""
        if len(trials) < len(self.trials):  # a new run: start over
            self.clear()
        self.trials = list(trials)
        self.in_force = in_force
        self._draw()
        if self.following and in_force is not None:
            self._place_cursor(in_force)

    def show_candidate(self, trial: tune.Trial, tokens: int | None = None) -> None:
        """A candidate of the tuner's search, as it changes: its forecast, the mark while
        it is in trial, why it was not tried."""
        self.candidates[row_key(candidate_setting(trial.candidate))] = trial
        self.tokens = tokens if tokens is not None else self.tokens
        self._draw()

    def forget_candidates(self) -> None:
        """A new search: the previous one's rows go, but for the settings the run used."""
        used = {row_key(t.setting) for t in self.trials}
        for key in self.candidates:
            if key not in used and key in self.rows:
                self.remove_row(key)
        self.candidates.clear()

    def _draw(self) -> None:
        best = best_trial(self.trials)
        rows: dict[str, tuple[Trial | None, tune.Trial | None]] = {
            row_key(t.setting): (t, self.candidates.get(row_key(t.setting)))
            for t in self.trials}
        for key, candidate in self.candidates.items():
            rows.setdefault(key, (None, candidate))
        for key, (trial, candidate) in rows.items():
            setting = (trial.setting if trial is not None
                       else candidate_setting(candidate.candidate))  # type: ignore[union-attr]
            cells = trial_cells(
                trial,
                best=best is not None and setting == best.setting,
                in_force=setting == self.in_force,
                candidate=candidate, tokens=self.tokens, setting=setting,
            )
            if key in self.rows:
                for (column, _, _), cell in zip(COLUMNS, cells, strict=True):
                    if self.get_cell(key, column) != cell:
                        self.update_cell(key, column, cell)
            else:
                self.add_row(*cells, key=key)

    def reset(self) -> None:
        self.clear()
        self._placed.clear()
        self.trials = []
        self.candidates.clear()
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
