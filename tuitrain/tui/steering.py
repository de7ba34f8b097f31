"""Steering: the user's requests to the worker, each pending on screen until it answers.

A request with a live worker is sent as a command and shows as a pending Change until the
worker reports the step it took effect at (Applied) or why it did not (Rejected). With no
live worker (failed or finished) a setting changes what the next restart runs with.
"""

from __future__ import annotations

from typing import Protocol

from engine.placement.policy import Policy
from tuitrain.events import Applied, Checkpoint, Command, Pause, Rejected, Resume
from tuitrain.settings import (
    MARGIN_RATIO_MAX,
    MARGIN_RATIO_MIN,
    EngineSettings,
    check_engine_setting,
)
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
from tuitrain.tui.header import WAITING_STATES


class SteeredScreen(Protocol):
    """What Steering needs from the screen it works for, and nothing more."""

    @property
    def live(self) -> bool:
        """Whether a worker runs (or starts) that can take commands."""

    @property
    def run_state(self) -> str:
        """ "starting", "running", "paused", ... (see TuitrainApp.set_state)."""

    @property
    def controls(self) -> Controls:
        """Where targets, messages and the list of changes are shown."""

    def send(self, command: Command) -> int:
        """Send `command` to the worker; returns the id its answer will carry."""

    def use_setting(self, setting: str, value: Value, *, from_step: int | None) -> None:
        """`setting` is `value` from step `from_step` on (None: for the next run)."""

    def set_state(self, state: str) -> None:
        """Show the run's new state."""

    def add_log(self, message: str, *, level: str = "info", step: int | None = None) -> None:
        """A line in the log panel, stamped `step` (None: the latest)."""


class Steering:
    """What the user asked the worker for, and how each request went.

    Args:
        engine: the engine settings the run starts with.
        screen: the app, seen through what steering needs of it.
        policy_known: whether the user gave the policy; one left to the plan is shown as
            none until the run says which (or a policy asked for is pending).
    """

    def __init__(self, engine: EngineSettings, *, screen: SteeredScreen,
                 policy_known: bool = True) -> None:
        self.screen = screen
        self.policy_given = self.policy_known = policy_known
        self.changes = ChangeTracker()
        # What is in force (the worker applied it), and what the user asked for last,
        # pending included.
        self.in_force: dict[str, Value] = {name: getattr(engine, name) for name in SETTINGS}
        self.target: dict[str, Value] = dict(self.in_force)
        self.want_paused = False
        # The step the run paused after, while it is paused: a change applied then applies
        # at a step that has not begun.
        self.paused_after: int | None = None
        self.default_budget: str | None = None  # the budget the worker chose, as shown

    # --- requests -------------------------------------------------------------------------

    def request(self, setting: str, value: Value) -> None:
        """Ask for a new policy, margin_ratio or device_budget.

        With a live worker this sends the command and shows the change as pending; with
        none (failed or finished) it changes the settings the next restart will use.
        """
        old, new = self.shown(setting, self.target[setting]), self.shown(setting, value)
        self.screen.controls.show_message("")
        if not self.screen.live:
            if setting == "policy":  # the next run's, as the user gave it
                self.policy_given = self.policy_known = True
            self.in_force[setting] = self.target[setting] = value
            self.show_targets()
            self.screen.use_setting(setting, value, from_step=None)
            self.screen.add_log(f"{LABELS[setting]}: {old} → {new}, used when the run restarts (r)")
            return
        change = Change(self.screen.send(command_for(setting, value)), setting, value, old, new)
        self.changes.sent(change)
        self.target[setting] = value
        self.show_targets()
        self.show_changes()
        self.screen.add_log(change.describe())

    def cycle_policy(self) -> None:
        self.request("policy", Policy.parse(str(self.target["policy"])).next().value)

    def move_margin(self, delta: float) -> None:
        current = float(self.target["margin_ratio"])
        value = round(min(MARGIN_RATIO_MAX, max(MARGIN_RATIO_MIN, current + delta)), 2)
        if value == current:
            self.screen.controls.show_message(f"margin is already {current:.2f}")
            return
        self.request("margin_ratio", value)

    def toggle_pause(self) -> None:
        pause = not self.want_paused
        command = Pause() if pause else Resume()
        change = Change(self.screen.send(command), "pause" if pause else "resume")
        self.changes.sent(change)
        self.want_paused = pause
        self.show_changes()
        self.screen.add_log(change.describe())

    def checkpoint(self) -> None:
        change = Change(self.screen.send(Checkpoint()), "checkpoint")
        self.changes.sent(change)
        self.show_changes()
        self.screen.add_log(change.describe())

    def state_changed(self, state: str) -> None:
        """The run is now `state`: a pause or resume asked for has happened, or never will,
        and so may a policy the run has not said yet."""
        if state in ("running", "paused"):
            self.want_paused = state == "paused"
        if state == "running":
            self.paused_after = None
        self.screen.controls.policy_waits(state in WAITING_STATES)

    # --- answers --------------------------------------------------------------------------

    def applied(self, event: Applied) -> None:
        change = self.changes.applied(event.id, event.step)
        if change is None:
            self._applied_elsewhere(event)
            self.screen.add_log(f"applied at step {event.step}: {event.what}", level="change",
                                step=event.step)
            return
        if change.setting in SETTINGS:
            self.in_force[change.setting] = change.value
            self.policy_known |= change.setting == "policy"
            self.screen.use_setting(change.setting, change.value, from_step=event.step)
        elif change.setting == "pause":
            self.paused_after = event.step
            self.screen.set_state("paused")
        elif change.setting == "resume":
            self.screen.set_state("running")
        where = event.what.removeprefix("checkpoint").strip()
        detail = f" ({where})" if change.setting == "checkpoint" and where else ""
        # A setting's line is stamped with the step it applies at, which it names; a pause,
        # a resume or a checkpoint happened after the step it names, the latest.
        stamp = event.step if change.setting in SETTINGS else None
        self.screen.add_log(change.describe(paused_after=self.paused_after) + detail,
                            level="change", step=stamp)
        self.show_changes()

    def _applied_elsewhere(self, event: Applied) -> None:
        """A change this screen did not ask for: another viewer of an attached run made it
        (tuitrain.listener words it "<setting> <value> (by ...)"). It is in force now."""
        name, _, rest = event.what.partition(" ")
        if name in ("paused", "resumed"):
            self.paused_after = event.step if name == "paused" else None
            self.screen.set_state("paused" if name == "paused" else "running")
            self.show_changes()
        if name not in SETTINGS:
            return
        try:
            value = check_engine_setting(name, rest.split(" (by ")[0])
        except ValueError:
            return
        self.in_force[name] = value
        if self.changes.latest_pending(name) is None:
            self.target[name] = value
            self.show_targets()
        self.screen.use_setting(name, value, from_step=event.step)

    def started_with(self, engine: dict) -> None:
        """The worker started with these engine settings (a Started event's, as JSON): a
        policy or margin the plan chose for a run that left it unset is in force, and the
        screen shows it rather than the default it asked with."""
        self.policy_known |= "policy" in engine
        for name in ("policy", "margin_ratio"):
            if name not in engine or self.changes.latest_pending(name) is not None:
                continue
            try:
                value = check_engine_setting(name, str(engine[name]))
            except ValueError:
                continue
            if value != self.in_force[name]:
                self.in_force[name] = self.target[name] = value
                self.screen.use_setting(name, value, from_step=1)
        self.show_targets()

    def rejected(self, event: Rejected) -> None:
        change = self.changes.rejected(event.id, event.reason)
        if change is None:
            self.screen.add_log(f"rejected: {event.reason}", level="warning")
            return
        if change.setting in SETTINGS:
            still = self.changes.latest_pending(change.setting)
            self.target[change.setting] = still.value if still else self.in_force[change.setting]
            self.show_targets()
        elif change.setting in ("pause", "resume"):
            self.want_paused = self.screen.run_state == "paused"
        # Listed once, in red among the changes (and in the log); the field shows what is
        # in force again.
        self.screen.add_log(change.describe(), level="warning")
        self.show_changes()

    def forget_pending(self) -> None:
        """The worker is gone: nothing waits for its answer any more."""
        self.changes.clear()
        self.show_changes()

    def restarted(self) -> None:
        """A new run starts: the last one's changes and messages are not its own."""
        self.changes.forget_all()
        self.policy_known = self.policy_given  # a plan's choice is made again, maybe another
        self.want_paused = False
        self.paused_after = None
        self.show_changes()
        self.screen.controls.show_message("")

    # --- showing --------------------------------------------------------------------------

    def show_changes(self) -> None:
        self.screen.controls.show_changes(self.changes.lines(), paused_after=self.paused_after)

    def shown(self, setting: str, value: Value) -> str:
        return shown(setting, value, default=self.default_budget)

    def show_targets(self) -> None:
        device_budget = self.target["device_budget"]
        # A policy left to the plan shows as none until the run says it, unless one asked
        # for is pending (one rejected before then leaves none shown again).
        policy = (str(self.target["policy"]) if self.policy_known
                  or self.changes.latest_pending("policy") is not None else None)
        if policy is None:
            self.screen.controls.forget_policy()
        self.screen.controls.set_values(
            policy=policy,
            margin_ratio=float(self.target["margin_ratio"]),
            # Empty: the field's placeholder shows the budget the worker chose.
            device_budget=str(device_budget) if device_budget is not None else "",
            budget_shown=self.shown("device_budget", device_budget),
        )
