"""Steering: the user's requests to the worker, each pending on screen until it answers.

A request with a live worker is sent as a command and shows as a pending Change until the
worker reports the step it took effect at (Applied) or why it did not (Rejected). With no
live worker (failed or finished) a setting changes what the next restart runs with.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.placement.policy import Policy
from tuitrain.events import Applied, Checkpoint, Command, Pause, Rejected, Resume
from tuitrain.tui.changes import (
    LABELS,
    SETTINGS,
    Change,
    ChangeTracker,
    Value,
    command_for,
    shown,
)
from tuitrain.tui.controls import Controls
from tuitrain.tui.header import RunHeader, settings_fields

if TYPE_CHECKING:
    from tuitrain.tui.app import TuitrainApp


class Steering:
    """What the user asked the worker for, and how each request went.

    Args:
        app: the app whose worker takes the commands, whose settings hold what was applied,
            and whose controls and log show each request.
    """

    def __init__(self, app: TuitrainApp) -> None:
        self.app = app
        self.changes = ChangeTracker()
        engine = app.settings.engine
        # What the user asked for, pending included; app.settings holds what was applied.
        self.target: dict[str, Value] = {
            "policy": engine.policy,
            "margin_ratio": engine.margin_ratio,
            "device_budget": engine.device_budget,
        }
        self.want_paused = False

    # --- requests -------------------------------------------------------------------------

    def request(self, setting: str, value: Value) -> None:
        """Ask for a new policy, margin_ratio or device_budget.

        With a live worker this sends the command and shows the change as pending; with
        none (failed or finished) it changes the settings the next restart will use.
        """
        old, new = shown(setting, self.target[setting]), shown(setting, value)
        controls = self.app.query_one(Controls)
        controls.show_message("")
        if not self.app.live:
            setattr(self.app.settings.engine, setting, value)
            self.target[setting] = value
            self.show_targets()
            self.app.query_one(RunHeader).show(**settings_fields(self.app.settings.engine))
            self.app.add_log(f"{LABELS[setting]}: {old} → {new}, used when the run restarts (r)")
            return
        change = Change(self._send(command_for(setting, value)), setting, value, old, new)
        self.changes.sent(change)
        self.target[setting] = value
        self.show_targets()
        self.show_changes()
        self.app.add_log(change.describe())

    def cycle_policy(self) -> None:
        self.request("policy", Policy.parse(str(self.target["policy"])).next().value)

    def move_margin(self, delta: float) -> None:
        current = float(self.target["margin_ratio"])
        value = round(min(1.0, max(0.0, current + delta)), 2)
        if value == current:
            self.app.query_one(Controls).show_message(f"margin is already {current:.2f}")
            return
        self.request("margin_ratio", value)

    def toggle_pause(self) -> None:
        pause = not self.want_paused
        command = Pause() if pause else Resume()
        change = Change(self._send(command), "pause" if pause else "resume")
        self.changes.sent(change)
        self.want_paused = pause
        self.show_changes()
        self.app.add_log(change.describe())

    def checkpoint(self) -> None:
        change = Change(self._send(Checkpoint()), "checkpoint")
        self.changes.sent(change)
        self.show_changes()
        self.app.add_log(change.describe())

    def _send(self, command: Command) -> int:
        assert self.app.worker is not None
        return self.app.worker.send(command)

    # --- answers --------------------------------------------------------------------------

    def applied(self, event: Applied) -> None:
        change = self.changes.applied(event.id, event.step)
        if change is None:
            self.app.add_log(f"applied at step {event.step}: {event.what}", level="change")
            return
        if change.setting in SETTINGS:
            setattr(self.app.settings.engine, change.setting, change.value)
            self.app.meter.settings_changed(event.step)
            self.app.query_one(RunHeader).show(**settings_fields(self.app.settings.engine))
        elif change.setting == "pause":
            self.app.set_state("paused")
        elif change.setting == "resume":
            self.app.set_state("running")
        where = event.what.removeprefix("checkpoint").strip()
        detail = f" ({where})" if change.setting == "checkpoint" and where else ""
        # The log's step column is when it happened; the line itself names the step it
        # applies at (the next one, for a setting), so the column never runs backwards.
        self.app.add_log(change.describe() + detail, level="change")
        self.show_changes()

    def rejected(self, event: Rejected) -> None:
        change = self.changes.rejected(event.id, event.reason)
        if change is None:
            self.app.add_log(f"rejected: {event.reason}", level="warning")
            return
        if change.setting in SETTINGS:
            still = self.changes.latest_pending(change.setting)
            applied = getattr(self.app.settings.engine, change.setting)
            self.target[change.setting] = still.value if still else applied
            self.show_targets()
        elif change.setting in ("pause", "resume"):
            self.want_paused = self.app.run_state == "paused"
        self.app.add_log(change.describe(), level="warning")
        self.app.query_one(Controls).show_message(change.describe(), error=True)
        self.show_changes()

    def forget_pending(self) -> None:
        """The worker is gone: nothing waits for its answer any more."""
        self.changes.clear()
        self.show_changes()

    # --- showing --------------------------------------------------------------------------

    def show_changes(self) -> None:
        self.app.query_one(Controls).show_changes(self.changes.lines())

    def show_targets(self) -> None:
        budget = self.target["device_budget"]
        self.app.query_one(Controls).set_values(
            policy=str(self.target["policy"]),
            margin_ratio=float(self.target["margin_ratio"]),
            device_budget=str(budget) if budget is not None else None,
        )
