"""The app's `a`: the tuner's search (tuitrain.tune) on the app's own run, live.

The search runs in a thread and blocks on the run's steps; the app hands it every worker
event it polls (`feed`), and the search's commands go to the worker on the app's thread
(`call`), like the user's keys. `a` again stops it between steps, keeping the best so far;
at the end the best is applied, so it is the setting in force that `s` saves.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

from tuitrain.events import Command, Event
from tuitrain.formatting import format_seconds
from tuitrain.settings import Settings
from tuitrain.tui.trials_table import TrialsTable
from tuitrain.tune import Trial, TuneResult, search

EVENT_WAIT_SECONDS = 0.05


class LiveTune:
    """One search at a time on the app's run.

    Args:
        send: the app's worker's `send`, called on the app's thread through `call`.
        call: runs a function on the app's thread and returns its result
            (App.call_from_thread).
        on_trial: told of each trial's change, on the app's thread.
        on_done: the result, or the reason the search could not run (str), on the app's
            thread.
        say: a line for the log, on the app's thread.
    """

    def __init__(self, *, send: Callable[[Command], int], call: Callable[..., Any],
                 on_trial: Callable[[Trial], None],
                 on_done: Callable[[TuneResult | str], None],
                 say: Callable[[str], None]) -> None:
        self.send = send
        self.call = call
        self.on_trial = on_trial
        self.on_done = on_done
        self.say = say
        self.stopping = False
        self.ended = False  # the result is out: the thread may still be finishing
        self.thread: threading.Thread | None = None
        self.events: queue.Queue[Event] = queue.Queue()

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive() and not self.ended

    def start(self, settings: Settings, *, shape: tuple[int, int, bool], policy: str,
              margin_ratio: float, device_budget: int, simulated: bool,
              trial_steps: int = 3) -> None:
        """Search from the run's setting now: `shape` (micro-batch, accumulation,
        checkpointing), policy, margin and budget; the run is `settings` (its global
        batch)."""
        self.stopping = self.ended = False
        self.events = queue.Queue()
        run = {"settings": settings, "shape": shape, "policy": policy,
               "margin_ratio": margin_ratio, "device_budget": device_budget,
               "simulated": simulated, "trial_steps": trial_steps}
        self.thread = threading.Thread(target=self._run, kwargs=run, daemon=True,
                                       name="tuitrain-tune")
        self.thread.start()

    def stop(self) -> None:
        """End the search at the next step, keeping (and applying) the best so far."""
        self.stopping = True

    def feed(self, event: Event) -> None:
        if self.running:
            self.events.put(event)

    def _events(self) -> list[Event]:
        try:
            out = [self.events.get(timeout=EVENT_WAIT_SECONDS)]
        except queue.Empty:
            return []
        while not self.events.empty():
            out.append(self.events.get_nowait())
        return out

    def _run(self, *, settings: Settings, shape: tuple[int, int, bool], policy: str,
             margin_ratio: float, device_budget: int, simulated: bool,
             trial_steps: int) -> None:
        from tuitrain.tune_setup import learn_from, tune_forecaster, tune_space
        from tuitrain.tune_worker import WorkerTrainer

        try:
            forecast, cal = tune_forecaster(
                settings, simulated=simulated, say=lambda line: self.call(self.say, line))
            space = tune_space(settings, device_budget=device_budget)
            batch_size, grad_accum, checkpointing = shape
            trainer = WorkerTrainer(
                lambda command: self.call(self.send, command), self._events,
                batch_size=batch_size, grad_accum=grad_accum,
                checkpointing=checkpointing, policy=policy,
                margin_ratio=margin_ratio, device_budget=device_budget,
                stopped=lambda: self.stopping)
            result: TuneResult | str = search(
                space, forecast, trainer, trial_steps=trial_steps, stop=lambda: self.stopping,
                on_trial=lambda trial: self.call(self.on_trial, trial))
            if learned := learn_from(result, cal):
                self.call(self.say, f"tune: time model: {learned}")
        except Exception as error:  # the search's failure is the app's line, not a crash
            result = f"{type(error).__name__}: {error}"
        self.ended = True
        self.call(self.on_done, result)


def toggle_tune(app: Any) -> None:
    """`a`: start a search on the app's run (`app.tuning`), or stop the one under way."""
    tune: LiveTune | None = app.tuning
    if tune is not None and tune.running:
        tune.stop()
        app.add_log("tune: stopping after this step; the best so far is kept")
        return
    started, latest = app.started, app.latest
    if started is None:
        app.notify("the run has not started yet: tune once it has")
        return
    budget = latest.device_budget if latest is not None else started.device_budget
    if budget is None:
        app.notify("the run's device budget is not known yet: tune after its first step")
        return
    engine = started.settings.get("engine", {})
    table = app.query_one(TrialsTable)
    table.forget_candidates()
    t = app.settings.training
    tokens = t.batch_size * t.grad_accum * t.seq_len
    shape = (t.batch_size, t.grad_accum, t.activation_checkpointing)
    if latest is not None:  # a search before may have changed it: the global batch stays
        accum = latest.micro_batches
        shape = (t.batch_size * t.grad_accum // accum, accum, latest.activation_checkpointing)
    app.tuning = tune = LiveTune(
        send=lambda command: app.worker.send(command), call=app.call_from_thread,
        on_trial=lambda trial: _trial_line(app, trial, tokens),
        on_done=lambda result: _done(app, result), say=app.add_log)
    tune.start(app.settings, shape=shape,
               policy=latest.policy if latest else engine.get("policy", "auto"),
               margin_ratio=latest.margin_ratio if latest else engine.get("margin_ratio", 0.0),
               device_budget=budget, simulated=started.device.startswith("simulated"))
    app.add_log("tune: searching policy, margin, micro-batches and checkpointing on this "
                "run's steps (a stops)")
    app.refresh_bindings()  # `a` stops it now


def _trial_line(app: Any, trial: Trial, tokens: int) -> None:
    """The trial's row in the trials table, and its line in the log when it starts or
    ends."""
    from tuitrain.tune import MEASURING, PENDING
    from tuitrain.tune_setup import trial_line

    app.query_one(TrialsTable).show_candidate(trial, tokens)
    if trial.status == MEASURING and not trial.steps:
        app.add_log(f"tune: trying {trial.candidate.describe()} (forecast "
                    f"{format_seconds(trial.forecast.seconds)}/step)")
    elif trial.status not in (PENDING, MEASURING):
        app.add_log(f"tune: {trial_line(trial)}")


def _done(app: Any, result: TuneResult | str) -> None:
    app.refresh_bindings()  # `a` starts a search again
    if isinstance(result, str):
        app.add_log(f"tune: could not search: {result}", level="warning")
        return
    if result.best is None:
        app.add_log(f"tune: nothing measured ({result.stopped_by})", level="warning")
        return
    best = result.best
    # The trial's own median, which the search compared; the trials table's row goes on
    # counting every settled step the run takes with the setting from now on.
    line = (f"tune: best {best.candidate.describe()}: {format_seconds(best.measured)}/step, "
            f"median of its {len(best.steps)} trial steps; searched {result.steps} steps "
            f"({result.stopped_by}); applied: s saves it")
    app.add_log(line)
    app.notify(line)
