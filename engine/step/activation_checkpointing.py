"""Activation checkpointing of a Hugging Face model, read and switched between steps.

transformers 5 renamed the methods and the flag (`activation_checkpointing_*`); 4.x has only
the old names (`gradient_checkpointing_*`), which 5 still answers with a warning.
"""

from __future__ import annotations

import torch

from engine.config import LiveSettings

__all__ = ["as_the_model_has_it", "is_checkpointing", "set_checkpointing"]


def is_checkpointing(model: torch.nn.Module) -> bool:
    """Whether `model`'s layers recompute their activations in backward."""
    # Read once: the flag is a property that walks every module (hasattr would walk them
    # too), and a step reads it twice.
    on = getattr(model, "is_activation_checkpointing", None)
    return bool(getattr(model, "is_gradient_checkpointing", False) if on is None else on)


def set_checkpointing(model: torch.nn.Module, on: bool) -> None:
    """Switch it on or off (a model that cannot is a ValueError, transformers' own)."""
    if on == is_checkpointing(model):
        return
    verb = "enable" if on else "disable"
    switch = getattr(model, f"activation_checkpointing_{verb}", None)
    (switch or getattr(model, f"gradient_checkpointing_{verb}"))()


def as_the_model_has_it(settings: LiveSettings, model: torch.nn.Module) -> LiveSettings:
    """`settings` with checkpointing as `model` has it. Switched on the model itself
    (transformers' own call, as before the engine could switch it), it is the run's
    setting too, so that a change staged since does not switch it back."""
    on = is_checkpointing(model)
    if on == settings.activation_checkpointing:
        return settings
    return settings.replace(activation_checkpointing=on)
