"""Controls: the policy, margin ratio and budget the user asks for, and how each request went.

The widget only validates and asks (it posts a message); the app sends the command and
feeds back what happened, so there is one place that talks to the worker.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.validation import Function
from textual.widgets import Input, Label, Select, Static

from engine.placement.policy import Policy
from tuitrain.settings import InvalidSettings, Size, check_engine_setting
from tuitrain.tui.changes import Change
from tuitrain.tui.fitting import wrap_at_separators

STATUS_STYLES = {"pending": "yellow", "applied": "green", "rejected": "red"}
HINT = "Enter applies · c policy · +- margin"


def _valid(setting: str) -> Function:
    """A field's validator (its look while typing): the settings' own rule for `setting`."""

    def valid(text: str) -> bool:
        try:
            check_engine_setting(setting, text)
        except InvalidSettings:
            return False
        return True

    return Function(valid, f"not a valid {setting}")


def _plain(static: Static) -> str:
    content = static.content
    return content.plain if isinstance(content, Text) else str(content)


class Controls(Vertical):
    """Policy select, margin and budget inputs, and the list of recent changes."""

    DEFAULT_CSS = """
    Controls {
        border: round $primary-muted;
        border-title-color: $text-primary;
        height: 1fr;
        padding: 0 1;
    }
    Controls > Horizontal {
        height: 1;
        margin-bottom: 1;
    }
    Controls Label {
        width: 8;
        color: $text-muted;
    }
    Controls Select {
        width: 14;
    }
    Controls #margin {
        width: 8;
        margin-right: 2;
    }
    Controls #budget {
        width: 10;
    }
    Controls #control-hint {
        height: 1;
        color: $text-muted;
    }
    Controls #control-message {
        height: auto;
    }
    Controls #changes {
        height: auto;
    }
    """

    @dataclass
    class PolicyChosen(Message):
        policy: str

    @dataclass
    class MarginEntered(Message):
        margin_ratio: float

    @dataclass
    class BudgetEntered(Message):
        device_budget: Size

    def __init__(
        self, *, policy: str, margin_ratio: float, device_budget: str | None, id: str | None = None
    ) -> None:
        super().__init__(id=id)
        self.border_title = "Controls"
        self._initial = (policy, margin_ratio, device_budget)
        self._steerable = True  # see allow_changes
        self._budget_allowed = True  # see allow_budget

    def compose(self) -> ComposeResult:
        policy, margin_ratio, device_budget = self._initial
        options = [(p.value, p.value) for p in Policy]
        with Horizontal():
            yield Label("policy")
            yield Select(options, value=policy, allow_blank=False, compact=True, id="policy")
        with Horizontal():
            yield Label("margin")
            yield Input(
                f"{margin_ratio:.2f}",
                compact=True,
                id="margin",
                validators=[_valid("margin_ratio")],
            )
            yield Label("budget")
            yield Input(
                device_budget or "",
                placeholder="6GiB",
                compact=True,
                id="budget",
                validators=[_valid("device_budget")],
            )
        yield Static(HINT, id="control-hint")
        yield Static("", id="control-message")
        yield Static("", id="changes")

    # --- what the app calls ---------------------------------------------------------------

    def set_values(
        self,
        *,
        policy: str | None = None,
        margin_ratio: float | None = None,
        device_budget: str | None = None,
    ) -> None:
        """Show these targets without treating them as a new request."""
        if policy is not None:
            select = self.query_one("#policy", Select)
            with select.prevent(Select.Changed):
                select.value = policy
        if margin_ratio is not None:
            self.query_one("#margin", Input).value = f"{margin_ratio:.2f}"
        if device_budget is not None:
            self.query_one("#budget", Input).value = device_budget

    def allow_budget(self, allowed: bool) -> None:
        """The budget is a simulated device's; a real GPU's capacity is what it is."""
        self._budget_allowed = allowed
        field = self.query_one("#budget", Input)
        field.disabled = not (allowed and self._steerable)
        if not allowed:
            field.tooltip = "only a simulated device has a budget to change"

    def allow_changes(self, allowed: bool, *, why: str = "") -> None:
        """Whether the user may change the run's settings here; `why` not, on the hint's
        line (a read-only viewer, a run that ended and is not this app's to restart)."""
        self._steerable = allowed
        self.query_one("#policy", Select).disabled = not allowed
        self.query_one("#margin", Input).disabled = not allowed
        self.allow_budget(self._budget_allowed)
        self.query_one("#control-hint", Static).update(HINT if allowed else why)

    def show_default_budget(self, device_budget: str) -> None:
        """Show, greyed in the empty budget field, the budget the worker chose by default."""
        self.query_one("#budget", Input).placeholder = device_budget

    def show_changes(self, changes: list[Change]) -> None:
        lines = [Text(c.describe(), style=STATUS_STYLES[c.status]) for c in changes]
        self.query_one("#changes", Static).update(Text("\n").join(lines))

    def show_message(self, message: str, *, error: bool = False) -> None:
        width = self.query_one("#control-message", Static).content_region.width
        text = Text(wrap_at_separators(message, width or 10_000),
                    style="bold red" if error else "")
        self.query_one("#control-message", Static).update(text)

    @property
    def message(self) -> str:
        return _plain(self.query_one("#control-message", Static))

    @property
    def changes_text(self) -> str:
        return _plain(self.query_one("#changes", Static))

    # --- what the user does ---------------------------------------------------------------

    @on(Select.Changed, "#policy")
    def _policy_changed(self, event: Select.Changed) -> None:
        event.stop()
        if isinstance(event.value, str):
            self.post_message(self.PolicyChosen(event.value))

    @on(Input.Submitted, "#margin")
    def _margin_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            value = check_engine_setting("margin_ratio", event.value.strip())
        except InvalidSettings as error:
            self.show_message(str(error), error=True)
            return
        self.show_message("")
        self.post_message(self.MarginEntered(round(value, 4)))

    @on(Input.Submitted, "#budget")
    def _budget_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        try:
            value = check_engine_setting("device_budget", event.value.strip())
        except InvalidSettings as error:
            self.show_message(str(error), error=True)
            return
        self.show_message("")
        self.post_message(self.BudgetEntered(value))
