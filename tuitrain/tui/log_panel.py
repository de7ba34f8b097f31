"""LogPanel: what the worker said and what happened to the user's changes, newest last."""

from __future__ import annotations

from collections import deque

from rich.text import Text
from textual import events
from textual.widgets import RichLog

MAX_LINES = 500  # older lines scroll off; the worker's full log is in its log file
LEVEL_STYLES = {"info": "", "warning": "yellow", "error": "bold red", "change": "green"}


class LogPanel(RichLog):
    """A bounded, scrolling log. Lines carry the step they refer to, not the wall clock.

    RichLog keeps its lines as wrapped at the width they were written at; this keeps each
    entry too and wraps them all again when the width changes, so that a line written
    before the terminal shrank is not cut at its edge.
    """

    DEFAULT_CSS = """
    LogPanel {
        height: 6;
        border: round $primary-muted;
        border-title-color: $text-primary;
        scrollbar-size-vertical: 1;
    }
    LogPanel.-short {
        height: 4;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        # min_width: RichLog's default (78) wraps wider than an 80-column panel shows.
        super().__init__(id=id, max_lines=MAX_LINES, wrap=True, markup=False, min_width=1)
        self.border_title = "Log"
        self.can_focus = False
        self.messages: deque[str] = deque(maxlen=MAX_LINES)
        self.entries: deque[Text] = deque(maxlen=MAX_LINES)  # as written, before wrapping
        self._wrapped_at: int | None = None  # the width the lines on screen were wrapped at
        self.step: int | None = None  # the latest step a line was stamped with, this run

    def shorten(self, short: bool) -> None:
        """Two lines instead of four, to leave rows to a panel shown above."""
        self.set_class(short, "-short")
        self.scroll_end(animate=False)

    def new_run(self) -> None:
        """The lines that follow are a new run's, whose steps count from 1 again."""
        self.step = None

    def add(self, message: str, *, level: str = "info", step: int | None = None) -> None:
        prefix = f"[{step:>5}] " if step is not None else "        "
        if step is not None:
            self.step = step if self.step is None else max(self.step, step)
        self.messages.append(message)
        entry = Text.assemble((prefix, "dim"), (message, LEVEL_STYLES.get(level, "")))
        self.entries.append(entry)
        self.write(entry)

    def on_resize(self, event: events.Resize) -> None:
        width = event.size.width
        if self._wrapped_at is not None and width != self._wrapped_at:
            self.clear()
            for entry in self.entries:
                self.write(entry, scroll_end=False)
            self.scroll_end(animate=False, immediate=False, x_axis=False)
        self._wrapped_at = width
