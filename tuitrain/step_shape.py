"""The shape of a running run's steps: how its global batch is split into micro-batches, and
activation checkpointing. SetShape (tuitrain.events) changes it between steps; the global
batch never changes, so neither do the data order nor the math.

The plan checks a new shape with the settings staged beside it before a step runs with it,
as the run's start does (tuitrain.fit): the engine knows a micro-batch's activations only
once a step has traced them, and a shape the plan let through that still overruns the
budget fails its first step, which the run then takes back (tuitrain.run_commands).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tuitrain.events import SetShape
from tuitrain.settings import Settings


@dataclass(frozen=True)
class Shape:
    batch_size: int  # sequences per micro-batch
    grad_accum: int  # micro-batches per step
    activation_checkpointing: bool

    def describe(self) -> str:
        """As an Applied answer words it: "batch_size 2 x grad_accum 4, activation_
        checkpointing off"."""
        return (f"batch_size {self.batch_size} x grad_accum {self.grad_accum}, "
                f"activation_checkpointing {'on' if self.activation_checkpointing else 'off'}")


def global_batch(settings: Settings) -> int:
    """Sequences per step: the same under every shape."""
    return settings.training.batch_size * settings.training.grad_accum


def resolve(command: SetShape, *, global_batch: int, grad_accum: int,
            checkpointing: bool) -> Shape:
    """The shape `command` asks for, its None fields kept from the staged `grad_accum` and
    `checkpointing`; ValueError when its split is not of the run's global batch."""
    size, accum = command.batch_size, command.grad_accum
    for name, value in (("batch_size", size), ("grad_accum", accum)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < 1):
            raise ValueError(f"{name} must be a whole number, at least 1, not {value!r}")
    if size is None and accum is None:
        accum = grad_accum
    if size is None:
        size = global_batch // accum
    elif accum is None:
        accum = global_batch // size
    if size * accum != global_batch:
        raise ValueError(f"{size} x {accum} sequences is not the run's global batch of "
                         f"{global_batch}, which a run keeps")
    ckpt = (checkpointing if command.activation_checkpointing is None
            else command.activation_checkpointing)
    if not isinstance(ckpt, bool):
        raise ValueError(f"activation_checkpointing must be true or false, not {ckpt!r}")
    return Shape(size, accum, ckpt)


def check_fits(settings: Settings, staged: Any, shape: Shape) -> None:
    """ValueError with the plan's reason when a step of `shape` under the engine's staged
    policy, margin and budget (`staged`, engine.config.LiveSettings) does not fit."""
    from engine.devices.device import uses_cuda
    from engine.planning.planner import plan
    from tuitrain.fit import host_room

    simulated = not uses_cuda()
    e, t = settings.engine, settings.training
    result = plan(settings.model, device_mem=staged.device_budget, host_mem=host_room(),
                  precision=settings.precision_for(simulated), batch_size=shape.batch_size,
                  seq_len=t.seq_len, checkpointing=shape.activation_checkpointing,
                  simulated=simulated, chunk_size=e.chunk_size,
                  margin_ratio=staged.margin_ratio,
                  host_budget=e.host_budget.nbytes if e.host_budget else None,
                  disk_dir=e.disk_dir, grad_accum=shape.grad_accum,
                  lora=t.lora.as_lora() if t.lora else None)
    row = result.policies[staged.policy.value]
    if not row.fits:
        ckpt = " with" if shape.activation_checkpointing else " without"
        raise ValueError(f"micro-batches of {shape.batch_size} sequences{ckpt} activation "
                         f"checkpointing do not fit: {row.reason}")


def shaped(settings: Settings, shape: Shape) -> Settings:
    """`settings` with `shape`: what a checkpoint or a preset of the run records."""
    training = settings.training.model_copy(update={
        "batch_size": shape.batch_size, "grad_accum": shape.grad_accum,
        "activation_checkpointing": shape.activation_checkpointing})
    return settings.model_copy(update={"training": training})
