"""What training asks of a model, said once for the engine and the planner, and how the
engine runs a model outside a training step without the run noticing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def prepare_for_training(model: torch.nn.Module) -> None:
    """Set what a training step needs of `model`: no generation cache (a model's config
    may keep one on by default, and its key/value tensors would be activations that no
    step uses: GPT-2's real peak was 3.2% over a plan recorded without them). The engine
    calls it on the model it is given and the planner on the model it records, so the
    plan and the step run the same forward."""
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "use_cache"):
        config.use_cache = False


def drops_out(model: torch.nn.Module) -> bool:
    """Whether `model` may draw dropout masks in training: a dropout module with p > 0, or a
    config setting some dropout probability above 0 (transformers' models call the
    function with it, with no module to see). Data-parallel ranks then draw them as one
    process would (engine.step.dropout), which costs a look at every op; the rest skip it."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
           for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else {}
    return any(("dropout" in key or "pdrop" in key) and isinstance(value, int | float)
               and not isinstance(value, bool) and value > 0 for key, value in settings.items())


@contextlib.contextmanager
def untouched(model: torch.nn.Module) -> Iterator[None]:
    """Run a forward of `model` that the training run must not see: the random state of
    every generator it could draw from is put back afterwards (a dropout mask drawn here
    would shift every mask of the run), and so is each module's train/eval mode.

    The block may switch modes (`model.eval()`): BatchNorm statistics and dropout stay
    as they are in eval mode, which is what such a forward wants."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        with torch.random.fork_rng(devices=_cuda_devices(model)):
            yield
    finally:
        for module, training in modes:
            module.training = training


def _cuda_devices(model: torch.nn.Module) -> list[int]:
    """The GPUs whose random state a forward of `model` could touch (fork_rng otherwise
    forks every visible GPU's and warns when there are several)."""
    if not torch.cuda.is_available():
        return []
    return sorted({torch.cuda.current_device() if p.device.index is None else p.device.index
                   for p in model.parameters() if p.device.type == "cuda"}
                  | {torch.cuda.current_device()})
