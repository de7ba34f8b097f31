"""Controls: the policy, margin ratio and budget the user asks for, and how each request went.

The widget only validates and asks (it posts a message); the app sends the command and
feeds back what happened, so there is one place that talks to the worker. A field shows the
run's value (the one asked for last) except while the user edits it: what they type is
never replaced under them, and a field they leave without Enter reads the run's value again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
from tuitrain.tui.field import Field
from tuitrain.tui.fitting import wrap_at_separators

STATUS_STYLES = {"pending": "yellow", "applied": "green", "rejected": "red"}
HINT = "Enter applies · c policy · +- margin"
# The policy select with none chosen, as the header words a value not known: one the run
# may still say, or one that will not come now that it has ended.
POLICY_WAITING, POLICY_UNSAID = "…", "-"
# In a field c, + and - are typed: the hint says how to leave instead (36 columns at 80x24).
FIELD_HINT = "Enter applies · Esc leaves the field"


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
        self, *, policy: str | None, margin_ratio: float, device_budget: str | None,
        id: str | None = None,
    ) -> None:
        """`policy` None: none is shown as chosen until set_values says which (a policy left
        to the plan is chosen as the run starts)."""
        super().__init__(id=id)
        self.border_title = "Controls"
        self._initial = (policy, margin_ratio, device_budget)
        self._policy = policy  # the one shown, None while the run has not said
        self._steerable = True  # see allow_changes
        self._why_not = ""  # see allow_changes
        self._budget_allowed = True  # see allow_budget
        # Per field: the text it shows when the user is not editing it, and the text last
        # written in it here (a focused field holding other text is being edited).
        self._wanted = {"margin": f"{margin_ratio:.2f}", "budget": device_budget or ""}
        self._written = dict(self._wanted)

    def compose(self) -> ComposeResult:
        policy, margin_ratio, device_budget = self._initial
        options = [(p.value, p.value) for p in Policy]
        with Horizontal():
            yield Label("policy")
            # Blank allowed, for the time before the run says its policy (see forget_policy).
            yield Select(options, value=Select.NULL if policy is None else policy,
                         prompt=POLICY_WAITING, compact=True, id="policy")
        with Horizontal():
            yield Label("margin")
            yield Field(
                f"{margin_ratio:.2f}",
                compact=True,
                id="margin",
                validators=[_valid("margin_ratio")],
            )
            yield Label("budget")
            yield Field(
                device_budget or "",
                # Until the worker says which budget it chose (see set_values).
                placeholder=device_budget or "default",
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
        budget_shown: str | None = None,
    ) -> None:
        """Show these targets without treating them as a new request; a field the user is
        editing shows them once they leave it. `device_budget` "" is the default budget,
        which the empty field shows greyed as `budget_shown` (the budget in words)."""
        if policy is not None:
            self._select_policy(policy)
        if margin_ratio is not None:
            self._show("margin", f"{margin_ratio:.2f}")
        if device_budget is not None:
            self._show("budget", device_budget)
        if budget_shown is not None:
            self.query_one("#budget", Input).placeholder = budget_shown

    def forget_policy(self) -> None:
        """Show no policy as chosen: the run left it to the plan, and a new worker has not
        said which the plan chose (it may choose another than the last one did)."""
        self._select_policy(None)

    def policy_waits(self, waiting: bool) -> None:
        """Whether a policy not shown yet may still come: the run has not ended."""
        self.query_one("#policy", Select).prompt = POLICY_WAITING if waiting else POLICY_UNSAID

    def _select_policy(self, policy: str | None) -> None:
        self._policy = policy
        select = self.query_one("#policy", Select)
        with select.prevent(Select.Changed):
            select.value = Select.NULL if policy is None else policy

    def _show(self, name: str, text: str) -> None:
        self._wanted[name] = text
        field = self.query_one(f"#{name}", Input)
        if field.has_focus and field.value != self._written[name]:
            return  # being edited
        field.value = self._written[name] = text

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
        self._why_not = why
        self.allow_budget(self._budget_allowed)
        self._show_hint()

    def _show_hint(self) -> None:
        if not self._steerable:
            hint = self._why_not
        else:
            hint = FIELD_HINT if isinstance(self.screen.focused, Field) else HINT
        self.query_one("#control-hint", Static).update(hint)

    def show_changes(self, changes: list[Change], *, paused_after: int | None = None) -> None:
        """The changes, newest first; `paused_after`: the step the run is paused after."""
        lines = [Text(c.describe(paused_after=paused_after), style=STATUS_STYLES[c.status])
                 for c in changes]
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

    def on_descendant_focus(self) -> None:
        self._show_hint()

    def on_descendant_blur(self) -> None:
        self._show_hint()

    @on(Input.Blurred)
    def _left(self, event: Input.Blurred) -> None:
        """Left without Enter: the field reads the run's value again."""
        name = event.input.id
        if name in self._wanted:
            event.input.value = self._written[name] = self._wanted[name]

    @on(Select.Changed, "#policy")
    def _policy_changed(self, event: Select.Changed) -> None:
        event.stop()
        if isinstance(event.value, str):
            self.post_message(self.PolicyChosen(event.value))
        elif self._policy is not None:  # the blank row, picked: no policy is no choice
            self._select_policy(self._policy)

    @on(Input.Submitted, "#margin")
    def _margin_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if (value := self._entered("margin", event.value)) is not None:
            self.post_message(self.MarginEntered(round(value, 4)))

    @on(Input.Submitted, "#budget")
    def _budget_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if (value := self._entered("budget", event.value)) is not None:
            self.post_message(self.BudgetEntered(value))

    def _entered(self, name: str, text: str) -> Any:
        """The setting typed in field `name`, checked; None (the reason on screen) when it is
        not valid, or when the field was emptied (it reads the run's value again)."""
        field = self.query_one(f"#{name}", Input)
        if not text.strip():
            field.value = self._written[name] = self._wanted[name]
            return None
        setting = "margin_ratio" if name == "margin" else "device_budget"
        try:
            value = check_engine_setting(setting, text.strip())
        except InvalidSettings as error:
            self.show_message(str(error), error=True)
            return None
        self.show_message("")
        self._written[name] = field.value  # entered: the run's value may replace it now
        return value
