"""Changes the screen asked the worker for, from pending until Applied or Rejected.

A change is pending from the moment its command is sent until the worker answers with the
step it took effect at (Applied) or why it did not (Rejected). The screen shows both.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tuitrain.events import Command, SetBudget, SetMargin, SetPolicy

LABELS = {
    "policy": "policy",
    "margin_ratio": "margin",
    "device_budget": "budget",
    "pause": "pause",
    "resume": "resume",
    "checkpoint": "checkpoint",
}
SETTINGS = ("policy", "margin_ratio", "device_budget")  # the ones that are values
DONE = {"pause": "paused", "resume": "resumed", "checkpoint": "checkpoint saved"}  # actions
# A policy, a margin ratio, or a device budget (a Size, "4GiB"; None = the default).
Value = str | float | None


def shown(setting: str, value: Value, *, default: str | None = None) -> str:
    """A setting's value as the screen writes it: "cpu", "0.35", "4GiB"; a budget left to
    the worker (None) as the `default` it chose ("6.0 GiB"), "default" until it says."""
    if value is None:
        return default or "default"
    if setting == "margin_ratio":
        return f"{float(value):.2f}"
    return str(value)


def command_for(setting: str, value: Value) -> Command:
    """The command that asks the worker for `setting` = `value`."""
    if setting == "policy":
        return SetPolicy(policy=str(value))
    if setting == "margin_ratio":
        return SetMargin(margin_ratio=float(value))
    if setting == "device_budget":
        return SetBudget(device_budget=value)
    raise ValueError(f"not a setting the worker can change: {setting!r}")


@dataclass
class Change:
    id: int  # the command id its answer will carry
    setting: str  # a key of LABELS
    value: Value = None  # the new value, for settings
    old: str = ""  # as shown, e.g. "auto" or "0.30"
    new: str = ""
    status: str = "pending"  # "pending" | "applied" | "rejected"
    step: int | None = None
    reason: str = ""

    def describe(self, *, paused_after: int | None = None) -> str:
        """One line: "policy: auto → cpu (pending)", "…, applied at step 43", "…, rejected: …".

        A setting's step is the first step that runs with it; an action's (pause, resume,
        checkpoint) is the step it came after, so those read "paused after step 42". While
        the run is paused after step `paused_after`, a setting whose step has not begun
        reads "applies at step 43".
        """
        head = LABELS[self.setting]
        if self.setting in SETTINGS:
            head = f"{head}: {self.old} → {self.new}"
        if self.status == "applied":
            if self.setting in DONE:
                after = f"after step {self.step}" if self.step else "before the first step"
                return f"{DONE[self.setting]} {after}"
            waiting = paused_after is not None and self.step is not None \
                and self.step > paused_after
            return f"{head}, {'applies' if waiting else 'applied'} at step {self.step}"
        if self.status == "rejected":
            return f"{head}, rejected: {self.reason}"
        return f"{head} (pending)"


@dataclass
class ChangeTracker:
    """Pending changes by command id, and the last few that were answered."""

    keep: int = 3  # answered changes still shown
    pending: dict[int, Change] = field(default_factory=dict)
    answered: deque[Change] = field(default_factory=deque)

    def sent(self, change: Change) -> None:
        self.pending[change.id] = change

    def applied(self, id: int, step: int) -> Change | None:
        """Mark change `id` applied at `step`; None when it is not one of ours."""
        change = self.pending.pop(id, None)
        if change is not None:
            change.status, change.step = "applied", step
            self._answer(change)
        return change

    def rejected(self, id: int, reason: str) -> Change | None:
        change = self.pending.pop(id, None)
        if change is not None:
            change.status, change.reason = "rejected", reason
            self._answer(change)
        return change

    def latest_pending(self, setting: str) -> Change | None:
        """The most recent change of `setting` still waiting for its answer."""
        waiting = [c for c in self.pending.values() if c.setting == setting]
        return max(waiting, key=lambda c: c.id) if waiting else None

    def clear(self) -> None:
        """Forget pending changes (their worker is gone); answered ones stay on screen."""
        self.pending.clear()

    def forget_all(self) -> None:
        """Forget every change, answered ones too: a new run has made none."""
        self.pending.clear()
        self.answered.clear()

    def lines(self) -> list[Change]:
        """What to show: every pending change, then the latest answered ones, newest first."""
        pending = sorted(self.pending.values(), key=lambda c: c.id, reverse=True)
        return pending + list(reversed(self.answered))

    def _answer(self, change: Change) -> None:
        self.answered.append(change)
        while len(self.answered) > self.keep:
            self.answered.popleft()
