"""What a saved trial becomes: the run's settings with the trial's policy, margin ratio,
budget and step shape (micro-batches of the run's global batch, checkpointing), and the
lines the save dialog shows about it. Pure functions over settings and
trials; the app opens the dialog (tuitrain.tui.save_dialog)."""

from __future__ import annotations

from tuitrain.formatting import format_size
from tuitrain.settings import Settings, Size
from tuitrain.trials import Trial, describe_measurements


def trial_settings(settings: Settings, trial: Trial, *, default_budget: int | None) -> Settings:
    """`settings` with `trial`'s policy, margin ratio, budget and step shape.

    A budget the run took by default (none given, the worker chose `default_budget`) stays
    none when the trial ran under it, so that a run of the preset takes the default of its
    own device."""
    engine = settings.engine
    budget = engine.device_budget
    if budget is None or budget.nbytes != trial.device_budget:
        budget = None if trial.device_budget == default_budget else Size.of_bytes(
            trial.device_budget)
    engine = engine.model_copy(
        update={"policy": trial.policy, "margin_ratio": trial.margin_ratio,
                "device_budget": budget}
    )
    t = settings.training
    training = t.model_copy(update={
        "batch_size": t.batch_size * t.grad_accum // trial.micro_batches,
        "grad_accum": trial.micro_batches,
        "activation_checkpointing": trial.activation_checkpointing})
    return settings.model_copy(update={"engine": engine, "training": training})


def settings_line(settings: Settings, *, default_budget: int | None) -> str:
    """ "policy auto · margin 0.30 · budget 3GiB"; a budget left to the device names the one
    this run had."""
    engine = settings.engine
    # No budget in the settings is saved as none: a run of the preset takes the default
    # for its own device, which is not always the one measured here.
    budget = engine.device_budget or "default"
    if engine.device_budget is None and default_budget:
        budget += f" ({format_size(default_budget)} on this run)"
    t = settings.training
    shape = f" · micro-batches {t.batch_size} x {t.grad_accum}" if t.grad_accum > 1 else ""
    shape += " · checkpointing" if t.activation_checkpointing else ""
    return f"policy {engine.policy} · margin {engine.margin_ratio:.2f} · budget {budget}{shape}"


def save_summary(
    settings: Settings, trial: Trial | None, *, in_force: bool, default_budget: int | None
) -> str:
    """What the save dialog says it will write: the settings, then what was measured."""
    line = settings_line(settings, default_budget=default_budget)
    if trial is None:
        return f"{line}\nno step yet: nothing measured"
    when = "in force now" if in_force else f"tried at steps {trial.first_step}-{trial.last_step}"
    return f"{line} ({when})\nmeasured: {describe_measurements(trial)}"
