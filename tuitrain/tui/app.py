"""TuitrainApp: the terminal app that watches a training worker and steers it between steps.

Data flows one way: the worker's events are drained on a timer, folded into the app's view
of the run, and the panels are redrawn from the latest sample at a bounded rate, so a
worker doing hundreds of steps a second never floods the screen. User requests go back as
commands and stay "pending" on screen until the worker reports the step they took effect.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterable
from functools import partial
from typing import TextIO

from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from engine.config import parse_size
from engine.policy import Policy
from engine.telemetry import StepStats
from tuitrain.client import WorkerClient
from tuitrain.events import (
    Applied,
    Checkpoint,
    Command,
    Event,
    Failed,
    Finished,
    Log,
    Pause,
    Rejected,
    Resume,
    Started,
    Step,
)
from tuitrain.settings import Settings
from tuitrain.training_run import EXIT_BAD_INPUT
from tuitrain.tui.changes import (
    LABELS,
    SETTINGS,
    Change,
    ChangeTracker,
    Value,
    command_for,
    shown,
)
from tuitrain.tui.chunk_map import ChunkMap
from tuitrain.tui.controls import Controls
from tuitrain.tui.failure_panel import FailurePanel
from tuitrain.tui.header import HeaderInfo, RunHeader
from tuitrain.tui.help_screen import HelpScreen
from tuitrain.tui.keys import KEYS, PALETTE_ONLY
from tuitrain.tui.log_panel import LogPanel
from tuitrain.tui.measurements import RunMeter
from tuitrain.tui.memory_chart import MemoryChart
from tuitrain.tui.save_dialog import PresetSaving
from tuitrain.tui.spawn import WorkerFactory, default_worker_factory, start_worker
from tuitrain.tui.states_table import StatesTable
from tuitrain.tui.step_panel import StepPanel

POLL_INTERVAL = 0.1  # seconds between drains of the worker's events
PANEL_INTERVAL = 0.25  # numbers redraw at most 4 times a second, however fast steps come
CHART_INTERVAL = 0.5  # charts cost the most to draw (plotext), so twice a second
MARGIN_STEP = 0.05
LIVE_STATES = ("starting", "running", "paused")
TEXTUAL_COMMANDS_REPLACED = ("Quit", "Keys")  # by our Quit and Help


class TuitrainApp(App[None]):
    """Watch and steer one training run.

    Args:
        settings: the run's settings; the app keeps its own copy and updates it as changes
            are applied, so a saved preset or a restart uses what actually ran.
        worker_factory: builds the worker for these settings (default: a real worker
            process, see default_worker_factory). Tests pass a FakeWorker.
    """

    TITLE = "tuitrain"
    AUTO_FOCUS = None  # keys go to the app until the user tabs into a control
    CSS = """
    #top {
        height: 3fr;
    }
    #side {
        width: 52;
    }
    #middle {
        height: 2fr;
        min-height: 9;
    }
    #middle > Controls {
        width: 52;
    }
    """
    BINDINGS = [
        # space is a priority so that a focused select or button cannot swallow it; fields
        # that type spaces still get it (Textual skips keys a focused input consumes).
        Binding(k.key, k.action, k.short, key_display=k.shown, priority=k.key == "space")
        for k in KEYS
    ] + [Binding("escape", "leave_field", "Leave field", show=False)]

    def __init__(self, settings: Settings, *, worker_factory: WorkerFactory | None = None):
        super().__init__()
        self.settings = settings.model_copy(deep=True)
        self.worker_factory = worker_factory or default_worker_factory
        self.worker: WorkerClient | None = None
        self.run_state = "starting"
        self.started: Started | None = None
        self.latest: StepStats | None = None
        self.failure: Failed | None = None
        self.failure_at_quit: Failed | None = None  # how the run stood when the user quit
        self.finished: Finished | None = None
        self.changes = ChangeTracker()
        engine = self.settings.engine
        # What the user asked for, pending included; self.settings holds what was applied.
        self.target: dict[str, Value] = {
            "policy": engine.policy,
            "margin_ratio": engine.margin_ratio,
            "device_budget": engine.device_budget,
        }
        self.want_paused = False
        self.meter = RunMeter()
        self.saving = PresetSaving(self, report=self._report_save)
        self._panels_stale = False  # a step arrived since the panels were drawn
        self._charts_stale = False

    # --- layout ---------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        engine = self.settings.engine
        budget = parse_size(engine.device_budget) if engine.device_budget else None
        yield RunHeader(
            HeaderInfo(
                model=self.settings.model,
                total_steps=self.settings.training.steps,
                policy=engine.policy,
                margin_ratio=engine.margin_ratio,
                device_budget=budget,
            ),
            id="header",
        )
        with Horizontal(id="top"):
            yield MemoryChart(id="memory")
            with Vertical(id="side"):
                yield StatesTable(id="states")
                yield ChunkMap(id="chunks")
        with Horizontal(id="middle"):
            yield StepPanel(id="step")
            yield Controls(
                policy=engine.policy,
                margin_ratio=engine.margin_ratio,
                device_budget=engine.device_budget,
                id="controls",
            )
        yield FailurePanel(id="failure")
        yield LogPanel(id="log")
        yield Footer()

    def on_mount(self) -> None:
        self._start_worker()
        self.set_interval(POLL_INTERVAL, self.poll_worker)
        self.set_interval(PANEL_INTERVAL, self.redraw_panels)
        self.set_interval(CHART_INTERVAL, self.redraw_charts)

    async def on_unmount(self) -> None:
        await asyncio.to_thread(self._stop_worker)

    # --- the worker -----------------------------------------------------------------------

    @property
    def live(self) -> bool:
        """Whether a worker is running (or starting) that can take commands."""
        return self.worker is not None and self.run_state in LIVE_STATES

    def _start_worker(self) -> None:
        self._set_state("starting")
        try:
            self.worker = start_worker(self.worker_factory, self.settings)
        except Exception as exc:  # whatever it was, the screen shows it and stays open
            self._on_failed(Failed(reason=f"could not start the worker: {exc}"))

    def _stop_worker(self) -> None:
        if self.worker is not None:
            self.worker.stop()

    def poll_worker(self) -> int:
        """Handle every event that arrived since the last call; returns how many."""
        if self.worker is None or not self.is_running:
            return 0  # quitting: the panels that events would update are being taken down
        try:
            events = self.worker.poll()
        except Exception as exc:  # a broken channel is a failed run, not a crashed screen
            events = [Failed(reason=f"lost contact with the worker: {exc}")]
        for event in events:
            self._handle(event)
        return len(events)

    def _handle(self, event: Event) -> None:
        handler = {
            Started: self._on_started,
            Step: self._on_step,
            Log: self._on_log,
            Applied: self._on_applied,
            Rejected: self._on_rejected,
            Failed: self._on_failed,
            Finished: self._on_finished,
        }.get(type(event))
        if handler is not None:
            handler(event)

    def _on_started(self, event: Started) -> None:
        self.started = event
        self.query_one(RunHeader).show(
            model=event.model, parameters=event.parameters, device=event.device
        )
        self.query_one(ChunkMap).show(event.chunks)
        controls = self.query_one(Controls)
        controls.allow_budget(event.device.startswith("simulated"))
        # The worker picks the default budget (the whole GPU, or one sized for the simulated
        # device): show it now rather than after the first step, which can take a while.
        used = event.settings.get("engine", {}).get("device_budget")
        if used and self.settings.engine.device_budget is None:
            self.query_one(RunHeader).show(device_budget=parse_size(used))
            controls.show_default_budget(str(used))
        if self.latest is None:
            self.query_one(StepPanel).show_waiting(
                "first step running: it also records the order the chunks are used in, "
                "so it takes longer than the rest…"
            )
        where = f", log {event.log_path}" if event.log_path else ""
        self._log(f"started {event.model} on {event.device or 'N/A'} (pid {event.pid}{where})")
        if self.run_state == "starting":
            self._set_state("running")

    def _on_step(self, event: Step) -> None:
        stats = event.stats
        self.latest = stats
        self.query_one(MemoryChart).record(stats)
        self.query_one(StepPanel).record(stats)
        self.meter.record(stats)
        if self.run_state == "starting":
            self._set_state("running")
        self._panels_stale = self._charts_stale = True

    def _on_log(self, event: Log) -> None:
        self._log(event.message, level=event.level)

    def _on_applied(self, event: Applied) -> None:
        change = self.changes.applied(event.id, event.step)
        if change is None:
            self._log(f"applied at step {event.step}: {event.what}", level="change")
            return
        if change.setting in SETTINGS:
            setattr(self.settings.engine, change.setting, change.value)
            self.meter.settings_changed(event.step)
            self.query_one(RunHeader).show(**self._header_settings())
        elif change.setting == "pause":
            self._set_state("paused")
        elif change.setting == "resume":
            self._set_state("running")
        where = event.what.removeprefix("checkpoint").strip()
        detail = f" ({where})" if change.setting == "checkpoint" and where else ""
        # The log's step column is when it happened; the line itself names the step it
        # applies at (the next one, for a setting), so the column never runs backwards.
        self._log(change.describe() + detail, level="change")
        self._show_changes()

    def _on_rejected(self, event: Rejected) -> None:
        change = self.changes.rejected(event.id, event.reason)
        if change is None:
            self._log(f"rejected: {event.reason}", level="warning")
            return
        if change.setting in SETTINGS:
            still = self.changes.latest_pending(change.setting)
            applied = getattr(self.settings.engine, change.setting)
            self.target[change.setting] = still.value if still else applied
            self._show_targets()
        elif change.setting in ("pause", "resume"):
            self.want_paused = self.run_state == "paused"
        self._log(change.describe(), level="warning")
        self.query_one(Controls).show_message(change.describe(), error=True)
        self._show_changes()

    def _on_failed(self, event: Failed) -> None:
        self.failure = event
        self.changes.clear()
        self._show_changes()
        self._set_state("failed")
        self.query_one(FailurePanel).show_failure(event, log_path=self.log_path)
        self.query_one(LogPanel).shorten(True)  # the failure panel needs the rows
        self._log(f"failed: {event.reason}", level="error")
        self._panels_stale = self._charts_stale = True

    def _on_finished(self, event: Finished) -> None:
        self.finished = event
        self.changes.clear()
        self._show_changes()
        self._set_state("finished")
        summary = ", ".join(f"{k} {v}" for k, v in event.summary.items())
        self._log(f"finished: {summary}" if summary else "finished")
        self._panels_stale = self._charts_stale = True

    # --- drawing --------------------------------------------------------------------------

    def redraw(self) -> None:
        """Draw everything that is stale now, without waiting for the timers."""
        self.redraw_panels()
        self.redraw_charts()

    def redraw_panels(self) -> None:
        """Push the latest sample into the header, tables and maps, if a step arrived."""
        if not self._panels_stale or self.latest is None or not self.is_running:
            return
        self._panels_stale = False
        stats = self.latest
        # Settings come from the Applied answers, which can arrive before the step that
        # first ran with them: the header shows what is in force, not what the last step had.
        shown = {
            "step": stats.step,
            "tokens_per_s": self.meter.tokens_per_second,
            "device_budget": stats.device_budget,
        }
        self.query_one(RunHeader).show(**{**shown, **self._header_settings()})
        self.query_one(StatesTable).show(stats.memory)
        self.query_one(ChunkMap).show(stats.memory.chunks)
        self.query_one(StepPanel).redraw_breakdown()

    def redraw_charts(self) -> None:
        """Redraw the memory and loss charts from their recorded windows, if a step arrived."""
        if not self._charts_stale or not self.is_running:
            return
        self._charts_stale = False
        self.query_one(MemoryChart).redraw()
        self.query_one(StepPanel).redraw_loss()

    def _header_settings(self) -> dict[str, object]:
        engine = self.settings.engine
        fields: dict[str, object] = {"policy": engine.policy, "margin_ratio": engine.margin_ratio}
        if engine.device_budget is not None:
            fields["device_budget"] = parse_size(engine.device_budget)
        return fields

    def _set_state(self, state: str) -> None:
        self.run_state = state
        if state in ("running", "paused"):
            self.want_paused = state == "paused"
        self.query_one(RunHeader).show(state=state)
        self.refresh_bindings()

    def _log(self, message: str, *, level: str = "info", step: int | None = None) -> None:
        if step is None and self.latest is not None:
            step = self.latest.step
        self.query_one(LogPanel).add(message, level=level, step=step)

    @property
    def log_path(self) -> str:
        """The worker's log file; a real worker knows it before it reports Started."""
        if self.started is not None and self.started.log_path:
            return self.started.log_path
        return str(getattr(self.worker, "log_path", "") or "")

    def _show_changes(self) -> None:
        self.query_one(Controls).show_changes(self.changes.lines())

    def _show_targets(self) -> None:
        budget = self.target["device_budget"]
        self.query_one(Controls).set_values(
            policy=str(self.target["policy"]),
            margin_ratio=float(self.target["margin_ratio"]),
            device_budget=str(budget) if budget is not None else None,
        )

    # --- requests -------------------------------------------------------------------------

    def request(self, setting: str, value: Value) -> None:
        """Ask for a new policy, margin_ratio or device_budget.

        With a live worker this sends the command and shows the change as pending; with
        none (failed or finished) it changes the settings the next restart will use.
        """
        old, new = shown(setting, self.target[setting]), shown(setting, value)
        controls = self.query_one(Controls)
        controls.show_message("")
        if not self.live:
            setattr(self.settings.engine, setting, value)
            self.target[setting] = value
            self._show_targets()
            self.query_one(RunHeader).show(**self._header_settings())
            self._log(f"{LABELS[setting]}: {old} → {new}, used when the run restarts (r)")
            return
        change = Change(self._send(command_for(setting, value)), setting, value, old, new)
        self.changes.sent(change)
        self.target[setting] = value
        self._show_targets()
        self._show_changes()
        self._log(change.describe())

    def _send(self, command: Command) -> int:
        assert self.worker is not None
        return self.worker.send(command)

    def on_controls_policy_chosen(self, message: Controls.PolicyChosen) -> None:
        if message.policy != self.target["policy"]:
            self.request("policy", message.policy)

    def on_controls_margin_entered(self, message: Controls.MarginEntered) -> None:
        if message.margin_ratio != self.target["margin_ratio"]:
            self.request("margin_ratio", message.margin_ratio)

    def on_controls_budget_entered(self, message: Controls.BudgetEntered) -> None:
        if message.device_budget != self.target["device_budget"]:
            self.request("device_budget", message.device_budget)

    # --- actions (keys, palette) ----------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if self.screen.is_modal and action in {k.action for k in KEYS} | {"leave_field"}:
            return False  # a dialog is open: its keys, not the main screen's
        return True if self.can_run(action) else None  # None: shown greyed out

    def can_run(self, action: str) -> bool:
        """Whether `action` makes sense in the run's state (the palette asks too, and it
        runs actions without the key bindings' check)."""
        if action in ("toggle_pause", "checkpoint"):
            return self.live  # nothing runs to pause or save
        if action == "restart":
            return not self.live  # a live run is steered, not restarted
        return True

    def action_cycle_policy(self) -> None:
        self.request("policy", Policy.parse(str(self.target["policy"])).next().value)

    def action_margin_up(self) -> None:
        self._move_margin(+MARGIN_STEP)

    def action_margin_down(self) -> None:
        self._move_margin(-MARGIN_STEP)

    def _move_margin(self, delta: float) -> None:
        current = float(self.target["margin_ratio"])
        value = round(min(1.0, max(0.0, current + delta)), 2)
        if value == current:
            self.query_one(Controls).show_message(f"margin is already {current:.2f}")
            return
        self.request("margin_ratio", value)

    def action_toggle_pause(self) -> None:
        if not self.can_run("toggle_pause"):
            return
        pause = not self.want_paused
        command = Pause() if pause else Resume()
        change = Change(self._send(command), "pause" if pause else "resume")
        self.changes.sent(change)
        self.want_paused = pause
        self._show_changes()
        self._log(change.describe())

    def action_checkpoint(self) -> None:
        if not self.can_run("checkpoint"):
            return
        change = Change(self._send(Checkpoint()), "checkpoint")
        self.changes.sent(change)
        self._show_changes()
        self._log(change.describe())

    async def action_restart(self) -> None:
        """A new worker from the current settings; the old one is stopped if it lingers."""
        if not self.can_run("restart"):
            return
        await asyncio.to_thread(self._stop_worker)
        self.query_one(FailurePanel).hide()
        self.query_one(LogPanel).shorten(False)
        self.query_one(MemoryChart).samples.clear()
        self.query_one(StepPanel).reset()
        self.latest = self.failure = self.finished = self.started = None
        self.meter.reset()
        self._log(f"restarting {self.settings.model} with policy {self.settings.engine.policy}")
        self._start_worker()

    def action_help(self) -> None:
        self.push_screen(HelpScreen())

    def action_leave_field(self) -> None:
        self.set_focus(None)

    async def action_quit(self) -> None:
        """Stop the worker (it finishes or is killed within its timeout), then leave."""
        # Taken before stopping: a worker terminated now because its step ran long has not
        # failed, as far as the user is concerned.
        self.failure_at_quit = self.failure
        if self.live:
            self._set_state("stopping")
            message = "stopping: the worker finishes its step first (a few seconds at most)"
            self.query_one(Controls).show_message(message)
            self._log(message)
        await asyncio.to_thread(self._stop_worker)
        self.exit(return_code=exit_status(self.failure_at_quit))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Our actions that can run now, then Textual's theme and screenshot commands.

        Textual's own Quit and Keys are left out: ours quits by stopping the worker first,
        and Help lists every key and command already.
        """
        for key in KEYS + PALETTE_ONLY:
            if self.can_run(key.action):
                yield SystemCommand(key.title, key.help, partial(self.run_action, key.action))
        for command in super().get_system_commands(screen):
            if command.title not in TEXTUAL_COMMANDS_REPLACED:
                yield command

    # --- presets --------------------------------------------------------------------------

    def action_save_preset(self) -> None:
        budget = self.latest.device_budget if self.latest else None
        self.saving.start(self.settings, self.meter.measured(), budget=budget)

    def _report_save(self, message: str, *, error: bool) -> None:
        self.query_one(Controls).show_message(message, error=error)
        self._log(message, level="error" if error else "change")
        if not error:
            self.notify(message)


def exit_status(failure: Failed | None) -> int:
    """0; 1 for a failed run, 2 for one that failed on a mistake in the input."""
    if failure is None:
        return 0
    return EXIT_BAD_INPUT if failure.exitcode == EXIT_BAD_INPUT else 1


def run_app(settings: Settings, *, err: TextIO | None = None) -> int:
    """Run the terminal app until the user quits.

    Returns 0; 1 when the run had failed, 2 when it failed on a mistake in the input (as
    the headless runner does). A failure is also told in one line on `err` (default
    stderr), since the screen that showed it is gone once the app exits.
    """
    app = TuitrainApp(settings)
    app.run()
    failure = app.failure_at_quit
    if failure is not None:
        err = err or sys.stderr
        if failure.exitcode == EXIT_BAD_INPUT:
            print(f"tuitrain: error: {failure.reason}", file=err)
        else:
            where = f" (log: {app.log_path})" if app.log_path else ""
            print(f"training failed: {failure.reason}{where}", file=err)
    return app.return_code or 0
