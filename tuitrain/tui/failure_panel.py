"""FailurePanel: why the run stopped, the end of its log, and what the user can do now."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from tuitrain.events import Failed

LOG_TAIL_LINES = 12  # the worker's last words; the rest is in its log file


def describe_failure(failed: Failed, *, log_path: str = "") -> Text:
    code = "" if failed.exitcode is None else f" (exit code {failed.exitcode})"
    lines = [Text.assemble(("Training failed", "bold red"), code, ": ", (failed.reason, "bold"))]
    for line in failed.log_tail[-LOG_TAIL_LINES:]:
        lines.append(Text(f"  {line}", style="dim"))
    if log_path:
        lines.append(Text(f"full log: {log_path}", style="dim"))
    lines.append(
        Text.assemble(
            ("c + -", "bold"),
            " change what the restart uses   ",
            ("r", "bold"),
            " restart   ",
            ("q", "bold"),
            " quit",
        )
    )
    return Text("\n").join(lines)


class FailurePanel(Static):
    """Hidden until the run fails; then shown above the log, and the app stays open."""

    DEFAULT_CSS = """
    FailurePanel {
        display: none;
        height: auto;
        max-height: 16;
        border: heavy $error;
        border-title-color: $error;
        padding: 0 1;
    }
    FailurePanel.-shown {
        display: block;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id)
        self.border_title = "Failed"
        self.failure: Failed | None = None

    def show_failure(self, failed: Failed, *, log_path: str = "") -> None:
        self.failure = failed
        self.update(describe_failure(failed, log_path=log_path))
        self.add_class("-shown")

    def hide(self) -> None:
        self.failure = None
        self.remove_class("-shown")

    @property
    def plain(self) -> str:
        content = self.content
        return content.plain if isinstance(content, Text) else str(content)
