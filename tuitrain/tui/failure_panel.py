"""FailurePanel: why the run stopped, the end of its log, and what the user can do now; and
how the app, once closed, tells the failure it showed."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from tuitrain.errors import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from tuitrain.events import Failed

LOG_TAIL_LINES = 5  # the worker's last words; the rest is in its log file


def describe_failure(failed: Failed, *, log_path: str = "", restartable: bool = True) -> Text:
    """The reason, what the user can do now, where the log is, then the log's last lines.
    Only the keys that work are named: a run this app cannot restart (attached, or shown
    again from its metrics) offers quitting alone.

    The panel's height is bounded, so whatever is cut off is the oldest log lines, never
    the reason or the keys. A mistake in the input (the worker's EXIT_BAD_INPUT) is told by
    its reason alone: the traceback behind it says nothing more to the user.
    """
    bad_input = failed.exitcode == EXIT_BAD_INPUT
    if bad_input:
        title, code = "Cannot train", ""
    else:
        title = "Training failed"
        if failed.rank is not None:
            title += f" on rank {failed.rank}"
        code = "" if failed.exitcode is None else f" (exit code {failed.exitcode})"
    lines = [Text.assemble((title, "bold red"), code, ": ", (failed.reason, "bold"))]
    restart = (("c + -", "bold"), " or the fields above change what the restart uses   ",
               ("r", "bold"), " restart   ") if restartable else ()
    lines.append(Text.assemble(*restart, ("q", "bold"), " quit"))
    if not bad_input:  # a mistake's log holds nothing more, and is not kept (worker.py)
        if log_path:
            lines.append(Text(f"full log: {log_path}", style="dim"))
        for line in failed.log_tail[-LOG_TAIL_LINES:]:
            lines.append(Text(f"  {line}", style="dim"))
    return Text("\n").join(lines)


def exit_status(failure: Failed | None) -> int:
    """The app's exit status, as the headless runner's: 0; 1 for a failed run, 2 for one
    that failed on a mistake in the input."""
    if failure is None:
        return EXIT_OK
    return EXIT_BAD_INPUT if failure.exitcode == EXIT_BAD_INPUT else EXIT_FAILED


def failure_line(failed: Failed, *, log_path: str = "") -> str:
    """The failure in one line, for the terminal once the screen that showed it is gone."""
    if failed.exitcode == EXIT_BAD_INPUT:
        return f"tuitrain: error: {failed.reason}"
    where = f" (log: {log_path})" if log_path else ""
    rank = "" if failed.rank is None else f" on rank {failed.rank}"
    return f"training failed{rank}: {failed.reason}{where}"


class FailurePanel(Static):
    """Hidden until the run fails; then shown above the log, and the app stays open."""

    DEFAULT_CSS = """
    FailurePanel {
        display: none;
        height: auto;
        max-height: 11;  /* reason, keys, log path, the tail: the charts keep some room */
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

    def show_failure(self, failed: Failed, *, log_path: str = "", restartable: bool = True
                     ) -> None:
        self.failure = failed
        self.update(describe_failure(failed, log_path=log_path, restartable=restartable))
        self.add_class("-shown")

    def hide(self) -> None:
        self.failure = None
        self.remove_class("-shown")

    @property
    def plain(self) -> str:
        content = self.content
        return content.plain if isinstance(content, Text) else str(content)
