"""What a tune of a running run searches, and its forecaster: shared by `tuitrain tune` and
the app's `a`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from tuitrain.formatting import format_seconds
from tuitrain.settings import Settings
from tuitrain.tune import (
    MEASURED,
    Candidate,
    Forecaster,
    Trial,
    TuneResult,
    candidates,
    model_error,
)

if TYPE_CHECKING:
    from engine.planning.calibration import Calibration

POLICIES = ("cuda", "auto", "cpu")
MARGINS = (0.0, 0.5, 1.0)


def tune_space(settings: Settings, *, device_budget: int) -> list[Candidate]:
    """What a running run can change between steps (tuitrain.tune_worker): policy and margin
    at the run's device budget, and every split of its global batch into micro-batches,
    with activation checkpointing and without. A data-parallel run keeps its shape (each
    rank's part of every micro-batch is cut before the step)."""
    t = settings.training
    host = settings.engine.host_budget.nbytes if settings.engine.host_budget else None
    space = candidates(global_batch=t.batch_size * t.grad_accum,
                       device_budgets=(device_budget,), policies=POLICIES, margins=MARGINS,
                       checkpointing=(False, True), host_budget=host)
    if t.nproc == 1:
        return space
    return [c for c in space if (c.batch_size, c.grad_accum, c.activation_checkpointing)
            == (t.batch_size, t.grad_accum, t.activation_checkpointing)]


def start_fitting(settings: Settings, fitting: list[Candidate],
                  forecast: Forecaster) -> tuple[Settings, Candidate | None]:
    """The run a tune starts on: `settings` where some fitting candidate keeps its split of
    the global batch and its checkpointing; else (a global batch too big for the device in
    the user's split) the fitting candidate the forecast says is fastest, which the search
    measures first anyway, with that candidate: the run starts instead of being refused,
    at the same global batch."""
    t = settings.training
    shape = (t.batch_size, t.grad_accum, t.activation_checkpointing)
    if any((c.batch_size, c.grad_accum, c.activation_checkpointing) == shape for c in fitting):
        return settings, None
    from tuitrain.presets import merge

    best = min(fitting, key=lambda c: forecast(c).seconds)
    return merge(settings, best.settings()), best


def run_budget(settings: Settings, simulated: bool) -> int:
    """The run's device budget in bytes; the whole GPU's memory when it has none."""
    budget = settings.device_budget_for(simulated)
    if budget is None:
        import torch

        budget = torch.cuda.get_device_properties(0).total_memory
    return budget


def tune_forecaster(settings: Settings, *, simulated: bool,
                    say: Callable[[str], None]) -> tuple[Forecaster, Calibration]:
    """The plan and time model for `settings` on this machine, and the machine's
    calibration. Measures the machine first when it has none (`say` tells)."""
    from tuitrain.fit import default_host_budget
    from tuitrain.plan_forecast import machine_calibration
    from tuitrain.tune_plan import plan_forecaster

    precision = settings.precision_for(simulated)
    cal = machine_calibration(say=say, precision=precision)  # what tunes taught it
    forecast = plan_forecaster(settings.model, host_mem=default_host_budget(),
                               precision=precision,
                               seq_len=settings.training.seq_len, simulated=simulated,
                               calibration=cal, disk_dir=settings.engine.disk_dir,
                               lora=settings.lora(), say=say)
    return forecast, cal


def learn_from(result: TuneResult, cal: Calibration) -> str | None:
    """The search's measured steps teach the time model this machine's correction, for the
    next forecast (engine.planning.calibration.learn); what it learned in words, or None
    when nothing was measured or it could not be kept."""
    from engine.planning.calibration import learn

    error = model_error(result.trials)
    if error is None:
        return None
    try:
        taught = learn(cal, error)
    except OSError as error_:
        return f"the time model's correction not kept: {error_.strerror or error_}"
    if taught is cal:
        return None
    return (f"steps took {error:.2f}x their forecast; this machine's forecasts are now "
            f"x{taught.correction:.2f} (learned from {taught.learned_from} "
            f"run{'s' if taught.learned_from != 1 else ''})")


def trial_line(trial: Trial) -> str:
    what = trial.candidate.describe()
    if trial.status == MEASURED:
        return (f"{what}: {format_seconds(trial.measured)}/step (forecast "
                f"{format_seconds(trial.forecast.seconds)})")
    return f"{what}: {trial.status}" + (f", {trial.reason}" if trial.reason else "")
