"""HelpScreen: every key and palette command, with what it does."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from tuitrain.tui.keys import KEYS, PALETTE_ONLY, STEERING_ACTIONS
from tuitrain.tui.layout import View

INTRO = (
    "Changes take effect between steps; each shows as pending until the worker\n"
    "reports the step it was applied at."
)
READ_ONLY_INTRO = "Read-only: this viewer watches the run and sends it nothing."


def help_table(
    views: tuple[View, ...] = (), shown: View | None = None, *, read_only: bool = False
) -> Table:
    """Every key and command; then the views of the screen's size, the one shown marked.
    A `read_only` viewer's table leaves out the keys that would change the run."""
    table = Table(box=None, show_header=False, padding=(0, 2, 0, 0))
    table.add_column(style="bold", justify="right", no_wrap=True)
    table.add_column()
    shown_keys: set[str] = set()
    for key in KEYS:  # a key with two actions (space) reads as one row
        if read_only and key.action in STEERING_ACTIONS:
            continue
        table.add_row("" if key.shown in shown_keys else key.shown, key.help)
        shown_keys.add(key.shown)
    table.add_row("ctrl+p", "command palette: the actions above that apply now, and:")
    for command in PALETTE_ONLY:
        if read_only and command.action in STEERING_ACTIONS:
            continue
        table.add_row("", Text.assemble((command.title, "italic"), f": {command.help}"))
    if not read_only:
        table.add_row("enter", "in the margin or budget field: ask for that value;")
    table.add_row("" if not read_only else "enter",
                  "in the trials table (tab to it, ↑ ↓ pick a row): save that row")
    table.add_row("escape", "leave a field, close a dialog")
    if len(views) > 1:
        table.add_row("", "")
        table.add_row("views", Text("at this size (v, or the palette's Show view)", style="dim"))
        for view in views:
            mark = "▸" if view == shown else ""
            table.add_row(mark, Text.assemble((view.name, "bold"), f": {view.about}"))
    return table


class HelpScreen(ModalScreen[None]):
    """A modal listing the keys and the views of this size; escape, ? or q closes it."""

    DEFAULT_CSS = """
    HelpScreen {
        align: center middle;
    }
    HelpScreen > VerticalScroll {
        width: 90;
        max-width: 100%;
        height: auto;
        max-height: 100%;
        border: round $primary;
        border-title-color: $text-primary;
        background: $surface;
        border-subtitle-color: $text-muted;
        padding: 0 1;
    }
    HelpScreen #help-intro {
        margin-bottom: 1;
    }
    HelpScreen #help-footer {
        margin-top: 1;
        color: $text-muted;
    }
    """
    CLOSING = "escape, ? or q closes"

    BINDINGS = [
        Binding("escape,question_mark,q", "close", "Close", show=False),
    ]

    def __init__(
        self, views: tuple[View, ...] = (), shown: View | None = None, *, read_only: bool = False
    ) -> None:
        super().__init__()
        self.views = views
        self.shown = shown
        self.read_only = read_only

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box") as box:
            box.border_title = "Keys"
            # On the frame, so that how to scroll and close is in sight at any size.
            box.border_subtitle = f"↑ ↓ scroll · {self.CLOSING}"
            yield Static(READ_ONLY_INTRO if self.read_only else INTRO, id="help-intro")
            yield Static(help_table(self.views, self.shown, read_only=self.read_only),
                         id="help-keys")
            yield Static(f"{self.CLOSING} this screen", id="help-footer")

    def on_mount(self) -> None:
        # Focused at once: the arrows scroll it without a Tab first.
        self.query_one("#help-box").focus()

    def action_close(self) -> None:
        self.dismiss(None)
