"""TuitrainApp: the terminal app that watches a training worker and steers it between steps.

Data flows one way: the worker's events are drained on a timer, folded into the app's view
of the run, and the panels are redrawn from the latest sample at a bounded rate, so a
worker doing hundreds of steps a second never floods the screen. User requests go back as
commands and stay "pending" on screen until the worker reports the step they took effect.
Every setting the run has used is a trial (tuitrain.trials): the trials table compares
them, and a save writes the selected one. The panels, their layout at the terminal's size
and their drawing are a RunPanels' (tuitrain.tui.run_panels), which the app holds; this
module wires them to the worker and to the user's keys.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from functools import partial

from textual import events
from textual.app import App, ComposeResult, SystemCommand
from textual.screen import Screen
from textual.widgets import DataTable

from engine.telemetry import StepStats
from tuitrain.client import WorkerClient
from tuitrain.events import (
    Applied,
    Command,
    Eval,
    Event,
    Failed,
    Finished,
    Log,
    RankStep,
    Rejected,
    Started,
    Step,
)
from tuitrain.formatting import format_size
from tuitrain.run_preset import PresetPace
from tuitrain.run_summary import record_summary, run_summary_lines
from tuitrain.settings import Settings
from tuitrain.trials import Trial, TrialBook
from tuitrain.tui.changes import Value
from tuitrain.tui.chunk_map import ChunkMap
from tuitrain.tui.controls import Controls
from tuitrain.tui.failure_panel import FailurePanel, exit_status
from tuitrain.tui.header import RunHeader, settings_fields
from tuitrain.tui.help_screen import HelpScreen
from tuitrain.tui.keys import KEYS, MARGIN_STEP, STEERING_ACTIONS, bindings, palette_commands
from tuitrain.tui.layout import View, next_view, views_for
from tuitrain.tui.log_panel import LogPanel
from tuitrain.tui.memory_chart import MemoryChart
from tuitrain.tui.ranks_table import RanksTable
from tuitrain.tui.run_panels import PANELS_CSS, RunPanels
from tuitrain.tui.save_dialog import PresetSaving
from tuitrain.tui.screenshot import save_screenshot
from tuitrain.tui.spawn import WorkerFactory, default_worker_factory, start_worker
from tuitrain.tui.steering import Steering
from tuitrain.tui.step_panel import StepPanel
from tuitrain.tui.termination import Termination
from tuitrain.tui.trials_table import TrialsTable
from tuitrain.tui.tuning import LiveTune, toggle_tune

POLL_INTERVAL = 0.1  # seconds between drains of the worker's events
PANEL_INTERVAL = 0.25  # numbers redraw at most 4 times a second, however fast steps come
CHART_INTERVAL = 0.5  # charts cost the most to draw (plotext), so twice a second
LIVE_STATES = ("starting", "running", "paused")
ENDED_STATES = ("finished", "stopped", "failed")


class TuitrainApp(App[None]):
    """Watch and steer one training run: its panels (tuitrain.tui.run_panels) wired to the
    worker, and the user's keys and requests wired to commands.

    Args:
        settings: the run's settings; the app keeps its own copy and updates it as changes
            are applied, so a saved preset or a restart uses what actually ran.
        worker_factory: builds the worker for these settings (default: a real worker
            process, see default_worker_factory). Tests pass a FakeWorker.
        attached: the worker is a run this app did not start (tuitrain.attach): quitting
            detaches from it, and it cannot be restarted from here.
        read_only: watch and send nothing (attach --read-only, a finished run's replay):
            no key, field or command that would change the run is offered.
    """

    TITLE = "tuitrain"
    CSS = PANELS_CSS
    AUTO_FOCUS = None  # keys go to the app until the user tabs into a control
    BINDINGS = bindings()

    def __init__(
        self,
        settings: Settings,
        *,
        worker_factory: WorkerFactory | None = None,
        attached: bool = False,
        read_only: bool = False,
    ):
        super().__init__()
        self.settings = settings.model_copy(deep=True)
        self.started: Started | None = None
        self.latest: StepStats | None = None
        self.trial_book = TrialBook()
        self.panels = RunPanels(self)
        self.attached = attached
        self.read_only = read_only
        self.worker_factory = worker_factory or default_worker_factory
        self.worker: WorkerClient | None = None
        self.run_state = "starting"
        self.failure: Failed | None = None
        self.failure_at_quit: Failed | None = None  # how the run stood when the user quit
        self.finished: Finished | None = None
        self.steering = Steering(self.settings.engine, screen=self,
                                 policy_known=self.settings.policy_chosen)
        self.tuning: LiveTune | None = None  # the search of `a`, once started
        self.preset_pace: PresetPace | None = None  # a tuned preset's pace, said if far off
        self.saving = PresetSaving(self, report=self._report_save)
        self.termination = Termination(self)  # SIGTERM, SIGHUP: the run stopped at once

    # --- the panels -----------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        yield from self.panels.compose()

    def on_resize(self, event: events.Resize) -> None:
        self.panels.lay_out(event.size.width, event.size.height)

    @property
    def view(self) -> View | None:
        """The view shown: which panels are on screen (tuitrain.tui.layout)."""
        return self.panels.view

    def redraw(self) -> None:
        """Draw everything that is stale now, without waiting for the timers."""
        self.panels.redraw()

    def add_log(self, message: str, *, level: str = "info", step: int | None = None) -> None:
        """A line in the log panel, at the latest step unless `step` is given. A change
        applied at the step under way is stamped with it, and so are the lines after it
        until that step's telemetry comes: the column never runs backwards."""
        log = self.query_one(LogPanel)
        if step is None:
            stamped = [s for s in (log.step, self.latest and self.latest.step) if s]
            step = max(stamped) if stamped else None
        log.add(message, level=level, step=step)

    # --- start and end --------------------------------------------------------------------

    def on_mount(self) -> None:
        self.query_one(RunHeader).show(read_only=self.read_only)
        self.panels.lay_out(self.size.width, self.size.height)
        self.termination.catch()  # before the worker starts: no signal leaves it behind
        self._start_worker()
        self.set_interval(POLL_INTERVAL, self.poll_worker)
        self.set_interval(PANEL_INTERVAL, self.panels.redraw_panels)
        self.set_interval(CHART_INTERVAL, self.panels.redraw_charts)

    async def on_unmount(self) -> None:
        await asyncio.to_thread(self._stop_worker)
        self.termination.release()

    # --- the worker -----------------------------------------------------------------------

    @property
    def live(self) -> bool:
        """Whether a worker is running (or starting) that can take commands."""
        return self.worker is not None and self.run_state in LIVE_STATES

    def _start_worker(self) -> None:
        self.set_state("starting")
        self.query_one(StepPanel).show_waiting("starting the worker…")  # seconds, on a busy CPU
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
            if self.tuning is not None:
                self.tuning.feed(event)
        if any(isinstance(e, Applied | Rejected) for e in events):
            self.refresh_bindings()  # a pause asked for happened, or never will
        return len(events)

    def _handle(self, event: Event) -> None:
        handler = {
            Started: self._on_started,
            Step: self._on_step,
            RankStep: self._on_rank_step,
            Eval: self._on_eval,
            Log: self._on_log,
            Applied: self.steering.applied,
            Rejected: self.steering.rejected,
            Failed: self._on_failed,
            Finished: self._on_finished,
        }.get(type(event))
        if handler is not None:
            handler(event)

    def _on_started(self, event: Started) -> None:
        self.started = event
        simulated = event.device.startswith("simulated")
        self.query_one(ChunkMap).show(event.chunks)
        self.steering.started_with(event.settings.get("engine") or {})
        self.query_one(RunHeader).show(
            model=event.model, parameters=event.parameters, device=event.device,
            trainable=event.trainable, device_size=event.device_budget if simulated else None,
            policy=self.settings.engine.policy)  # known now: the plan's, or the one asked for
        self.query_one(MemoryChart).simulated = simulated
        if event.ranks > 1:
            self.query_one(RanksTable).start(event.ranks)
        self.panels.show_ranks()
        self.query_one(Controls).allow_budget(simulated)
        # The worker picks the default budget (the whole GPU, or one sized for the simulated
        # device): show it now rather than after the first step, which can take a while.
        if event.device_budget is not None and self.settings.engine.device_budget is None:
            self.query_one(RunHeader).show(device_budget=event.device_budget)
            # In the header's words: one value, one unit (and the field reads it back).
            self.steering.default_budget = format_size(event.device_budget)
            self.steering.show_targets()
        self.query_one(StepPanel).show_first_step(paused=self.run_state == "paused")
        where = f", log {event.log_path}" if event.log_path else ""
        self.add_log(f"started {event.model} on {event.device or 'N/A'} (pid {event.pid}{where})")
        if self.run_state == "starting":
            self.set_state("running")

    def _on_step(self, event: Step) -> None:
        stats = event.stats
        self.latest = stats
        self.query_one(MemoryChart).record(stats)
        self.query_one(StepPanel).record(stats)
        self.trial_book.record(stats)
        if self.preset_pace is not None and (line := self.preset_pace.record(stats)):
            self.add_log(line, level="warning")
        if self.started is not None and self.started.ranks > 1:
            self.query_one(RanksTable).record(0, stats)
        if self.run_state == "starting":
            self.set_state("running")
        self.panels.mark_stale()

    def _on_rank_step(self, event: RankStep) -> None:
        self.query_one(RanksTable).record(event.rank, event.stats)
        self.panels.mark_stale(charts=False)

    def _on_eval(self, event: Eval) -> None:
        self.query_one(StepPanel).record_eval(event.step, event.loss)
        self.panels.mark_stale(panels=False)

    def _on_log(self, event: Log) -> None:
        self.add_log(event.message, level=event.level)
        if self.started is None:  # a start-up stage (building, preparing data): say it where
            self.query_one(StepPanel).show_waiting(f"{event.message}…")  # every view shows

    def _on_failed(self, event: Failed) -> None:
        self.failure = event
        self.steering.forget_pending()
        self.set_state("failed")
        self.query_one(FailurePanel).show_failure(event, log_path=self.log_path,
                                                  restartable=self.can_run("restart"))
        self.query_one(LogPanel).shorten(True)  # the failure panel needs the rows
        where = "" if event.rank is None else f" on rank {event.rank}"
        self.add_log(f"failed{where}: {event.reason}", level="error")
        self.panels.mark_stale()

    def _on_finished(self, event: Finished) -> None:
        self.finished = event
        self.steering.forget_pending()
        summary = event.summary
        self.set_state("stopped" if summary.get("stopped") else "finished")
        for line in run_summary_lines(summary, self.trial_book.rows()):
            self.add_log(line)
        # The run's metrics end with its summary, as a headless run's do; an attached
        # run's own process writes it.
        if not self.attached and (problem := record_summary(summary, self.trial_book.rows())):
            self.add_log(problem, level="error")
        if summary.get("eval_loss") is not None:  # beside the loss, not only in the log
            self.query_one(StepPanel).record_eval(summary["eval_step"], summary["eval_loss"])
        self.panels.mark_stale()

    def set_state(self, state: str) -> None:
        """Show the run's new state, and offer the keys that make sense in it."""
        self.run_state = state
        self.steering.state_changed(state)
        self.query_one(RunHeader).show(state=state)
        self.query_one(Controls).allow_changes(self.steerable, why=self._why_not_steerable())
        if self.started is not None:
            self.query_one(StepPanel).show_first_step(paused=self.run_state == "paused")
        self.refresh_bindings()

    @property
    def log_path(self) -> str:
        """The worker's log file; a real worker knows it before it reports Started. After a
        rank of several failed, that rank's."""
        if self.failure is not None and self.failure.log_path:
            return self.failure.log_path
        if self.started is not None and self.started.log_path:
            return self.started.log_path
        return str(getattr(self.worker, "log_path", "") or "")

    @property
    def steerable(self) -> bool:
        """Whether the user may change the run's settings: a live run this viewer may
        steer, or an ended run of this app's own (the change is for its restart)."""
        return not self.read_only and (self.live or not self.attached)

    def _why_not_steerable(self) -> str:
        if self.read_only:
            return "read-only: nothing is sent"
        return f"run {self.run_state}: nothing to change"  # fits the 36 columns at 80x24

    # --- what steering asks of the app ----------------------------------------------------

    @property
    def controls(self) -> Controls:
        return self.query_one(Controls)

    def send(self, command: Command) -> int:
        assert self.worker is not None, "commands go to a live worker"
        return self.worker.send(command)

    def use_setting(self, setting: str, value: Value, *, from_step: int | None) -> None:
        """`setting` is `value` from step `from_step` on (None: for the next run); the
        value was checked where it entered, on the screen or by the worker."""
        engine = self.settings.engine.model_copy(update={setting: value})
        self.settings = self.settings.model_copy(update={"engine": engine})
        known = self.panels.policy_known
        self.query_one(RunHeader).show(**settings_fields(engine, policy_known=known))

    # --- requests -------------------------------------------------------------------------

    def request(self, setting: str, value: Value) -> None:
        """Ask for a new policy, margin_ratio or device_budget (see Steering.request)."""
        if self.steerable:
            self.steering.request(setting, value)

    def on_controls_policy_chosen(self, message: Controls.PolicyChosen) -> None:
        if message.policy != self.steering.target["policy"]:
            self.request("policy", message.policy)

    def on_controls_margin_entered(self, message: Controls.MarginEntered) -> None:
        if message.margin_ratio != self.steering.target["margin_ratio"]:
            self.request("margin_ratio", message.margin_ratio)

    def on_controls_budget_entered(self, message: Controls.BudgetEntered) -> None:
        if message.device_budget != self.steering.target["device_budget"]:
            self.request("device_budget", message.device_budget)

    # --- actions (keys, palette) ----------------------------------------------------------

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if self.screen.is_modal and action in {k.action for k in KEYS} | {"leave_field"}:
            return False  # a dialog is open: its keys, not the main screen's
        # The footer offers only what works now: a key it shows does what it says.
        return self.can_run(action)

    def can_run(self, action: str) -> bool:
        """Whether `action` makes sense in the run's state (the palette asks too, and it
        runs actions without the key bindings' check)."""
        if action in STEERING_ACTIONS and not self.steerable:
            return False  # read-only, or an attached run that has ended
        if action in ("pause", "resume"):  # the one the run is not in (or heading for)
            return self.live and self.steering.want_paused == (action == "resume")
        if action in ("tune", "stop_tune"):  # the one that acts now
            searching = self.tuning is not None and self.tuning.running
            return self.live and searching == (action == "stop_tune")
        if action == "checkpoint":
            return self.live and self.settings.checkpoint.dir is not None
        if action == "restart":
            # a live run is steered, not restarted; an attached one is not ours to restart
            return self.run_state in ENDED_STATES and not self.attached
        return True

    def action_cycle_policy(self) -> None:
        self.steering.cycle_policy()

    def action_margin_up(self) -> None:
        self.steering.move_margin(+MARGIN_STEP)

    def action_margin_down(self) -> None:
        self.steering.move_margin(-MARGIN_STEP)

    def action_pause(self) -> None:
        if self.can_run("pause"):
            self.steering.toggle_pause()
            self.refresh_bindings()

    def action_resume(self) -> None:
        if self.can_run("resume"):
            self.steering.toggle_pause()
            self.refresh_bindings()

    def action_checkpoint(self) -> None:
        if self.can_run("checkpoint"):
            self.steering.checkpoint()

    async def action_restart(self) -> None:
        """A new worker from the current settings; the old one is stopped if it lingers."""
        if not self.can_run("restart"):
            return
        await asyncio.to_thread(self._stop_worker)
        self.latest = self.failure = self.finished = self.started = None
        self.trial_book.reset()
        self.panels.reset()
        self.steering.restarted()
        policy = self.settings.engine.policy if self.panels.policy_known else "the plan's choice"
        self.add_log(f"restarting {self.settings.model} with policy {policy}")
        self._start_worker()

    def action_tune(self) -> None:
        if self.can_run("tune"):
            toggle_tune(self)

    def action_stop_tune(self) -> None:
        if self.can_run("stop_tune"):
            toggle_tune(self)

    def action_help(self) -> None:
        self.push_screen(HelpScreen(views_for(self.panels.size_class), self.view,
                                    read_only=not self.steerable and self.attached))

    def action_next_view(self) -> None:
        views = views_for(self.panels.size_class)
        if len(views) == 1:
            self.notify("every panel is on screen at this size")
            return
        assert self.view is not None
        self.panels.show_view(next_view(self.panels.size_class, self.view))

    def action_screenshot(self, filename: str | None = None, path: str | None = None) -> None:
        self.set_timer(0.1, partial(save_screenshot, self, filename, path))  # palette gone

    def action_leave_field(self) -> None:
        self.set_focus(None)

    async def action_quit(self) -> None:
        """Stop the worker (it finishes or is killed within its timeout), then leave."""
        # Taken before stopping: a worker terminated now because its step ran long has not
        # failed, as far as the user is concerned.
        self.failure_at_quit = self.failure
        if self.live and self.attached:
            self.add_log("detaching: the run goes on")
        elif self.live:
            self.set_state("stopping")
            message = (
                "stopping: the step under way ends at its next layer, and nothing of it is kept"
            )
            self.query_one(Controls).show_message(message)
            self.add_log(message)
        await asyncio.to_thread(self._stop_worker)
        if not self.attached:
            self.poll_worker()  # what came while stopping: how the run ended, its summary
        self.exit(return_code=exit_status(self.failure_at_quit))

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        """Our actions that can run now, then Textual's own commands (its theme)."""
        textual = super().get_system_commands(screen)
        views = views_for(self.panels.size_class)
        shows = [
            SystemCommand(f"Show view: {v.name}", v.about, partial(self.panels.show_view, v))
            for v in views
            if len(views) > 1
        ]
        return palette_commands(self.can_run, self.run_action, textual, extra=shows)

    # --- presets --------------------------------------------------------------------------

    def action_save_preset(self) -> None:
        """Save the selected trial (the setting in force, unless the user picked another
        row), or the settings as they are before the first step."""
        self.save_trial(self.query_one(TrialsTable).selected)

    def on_data_table_row_selected(self, message: DataTable.RowSelected) -> None:
        if message.data_table.id == "trials":  # Enter on a row saves it
            self.save_trial(self.query_one(TrialsTable).selected)

    def save_trial(self, trial: Trial | None) -> None:
        """Open the save dialog for `trial`'s settings and measurements (None: the settings
        in force, nothing measured yet)."""
        in_force = trial is not None and trial.setting == self.trial_book.current
        self.saving.start_trial(self.settings, trial, in_force=in_force, started=self.started)

    def _report_save(self, message: str, *, error: bool) -> None:
        self.query_one(Controls).show_message(message, error=error)
        self.add_log(message, level="error" if error else "change")
        if not error:
            self.notify(message)
