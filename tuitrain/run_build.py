"""What a training run trains, built from its Settings: the model, the data and the engine,
on the device this machine has (a GPU, or a simulated one sized to fit beside the host's
copies), and the settings as they were actually used."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tuitrain.settings import Settings


@dataclass
class BuiltRun:
    model: Any
    data: Any  # the training batches (engine.data.corpus.TokenBatches)
    engine: Any
    device: str  # as the user sees it: "simulated, 6.0 GiB", or the GPU's name and memory
    device_budget: int | None  # bytes the engine got; None: the whole GPU
    settings: Settings  # as used: precision and device budget resolved (Settings.as_used)
    eval_data: Any = None  # the fixed held-out batches (engine.data.held_out.EvalBatches)


def build_run(s: Settings, say: Callable[[str], None]) -> BuiltRun:
    """Build model, data and engine; `say` hears each stage and any setting adapted."""

    from engine import Engine, EngineConfig
    from engine.data.held_out import build_run_data
    from engine.devices.device import uses_cuda
    from engine.models.zoo import meta_build

    simulated = not uses_cuda()
    device_budget = s.device_budget_for(simulated)
    say(f"building {s.model}")
    # On the meta device: the engine fills its chunks from `weights` one at a time, so the
    # model never exists whole in host memory. Adapters wrap the meta model before its
    # chunks are made, and draw their own weights by name whatever the placement.
    lora = s.lora()
    built = meta_build(s.model, seed=s.training.seed)
    model, weights = built.model, built.weights
    if lora is not None:
        from engine.models.lora import LoraWeights, apply_lora

        say(f"adding LoRA adapters of rank {lora.rank}")
        model = apply_lora(model, lora, seed=s.training.seed)
        weights = LoraWeights(model, weights, s.training.seed)
    if s.training.activation_checkpointing:
        # transformers 5 renamed it; 4.x only has the old name.
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    say("preparing data")
    t = s.training
    data = build_run_data(
        s.data.path,
        model_name_or_path=s.model,
        vocab_limit=model.config.vocab_size,
        # A step's batch holds all its micro-batches, in order: the engine splits it, so a
        # run with accumulation sees exactly the sequences of one without it.
        batch_size=t.batch_size * t.grad_accum,
        seq_len=t.seq_len,
        seed=t.seed,
        text_field=s.data.text_field,
        eval_path=s.data.eval_path,
        eval_fraction=s.data.eval_fraction,
        # eval_batches of a step's sequences, scored a micro-batch at a time: the same
        # sequences however a step's batch is split, in a micro-batch's memory.
        eval_sequences=t.eval_batches * t.grad_accum * t.batch_size,
        eval_batch_size=t.batch_size,
    )
    precision = s.precision_for(simulated)
    engine = Engine(
        model,
        weights=weights,
        config=EngineConfig(
            policy=s.engine.policy,
            margin_ratio=s.engine.margin_ratio,
            device_budget=device_budget,
            host_budget=s.engine.host_budget.nbytes if s.engine.host_budget else None,
            disk_dir=s.engine.disk_dir,
            precision=precision,
            lr=s.training.lr,
            weight_decay=s.training.weight_decay,
            max_grad_norm=s.training.max_grad_norm,
            seed=s.training.seed,
            chunk_size=s.engine.chunk_size,
            collective_timeout=s.engine.collective_timeout,
            grad_accum=t.grad_accum,
            lr_schedule=t.lr_schedule,
            warmup_steps=t.warmup_steps,
            # The schedule spans the run as planned; a resumed run keeps the same span.
            total_steps=t.steps,
        ),
    )
    return BuiltRun(
        model,
        data.train,
        engine,
        describe_device(simulated, device_budget),
        device_budget,
        s.as_used(precision=precision, device_budget=device_budget),
        data.eval,
    )


def describe_device(simulated: bool, device_budget: int | None) -> str:
    """The device as shown to the user: "simulated, 6.0 GiB", or the GPU name and memory."""
    import torch

    from engine import format_size

    if simulated:
        return f"simulated, {format_size(device_budget or 0)}"
    index = torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).total_memory
    device = f"{torch.cuda.get_device_name(index)}, {format_size(total)}"
    if device_budget is not None:
        device += f", budget {format_size(device_budget)}"
    return device
