"""Planner: the device and host memory a run will need, per policy, before anything runs.

    p = plan("opt-1.3b", device_mem=6 * 2**30, host_mem=32 * 2**30, precision="bf16")
    p.cpu.device_peak, p.cpu.host_peak, p.cpu.fits, p.recommended.policy
    p = plan("opt-1.3b", device_mem=6 * 2**30, host_mem=24 * 2**30, host_budget=8 * 2**30)
    p.cpu.disk_bytes, p.cpu.disk_read, p.disk_needed, p.disk_free
    p = plan("opt-1.3b", device_mem=6 * 2**30, host_mem=64 * 2**30, batch_size=8, nproc=4)
    p.cpu.device_peak, p.cpu.host_peak, p.cpu.machine_host_peak, p.cpu.gathered

With a host budget (EngineConfig.host_budget) the chunk bytes on the host and the disk
tier's I/O buffers stay within it and the rest goes to the scratch folder, as the engine's
placement rules decide (engine.planning.disk replays them); the host peak is then checked
against `host_mem`, the memory the machine has.

Nothing is allocated. The step is run once on the meta device (shapes and dtypes, no data)
through the engine's own hooks, which records what the engine would see:
the modules in the order they run, every byte an op allocates and frees (counted the way the
engine counts non-model bytes on the simulated device), and when each gradient arrives. That
recording is then replayed against the engine's own chunk layout under each policy, with the
manager's rules (fetch before use, evict the chunk used farthest ahead, gradient buffers, or
autograd's gradients kept, until a chunk's last gradient is in, optimizer state resident for
cuda and the margin, room kept for the traced non-model peak), in bytes only.

Decoder stacks repeat one layer, so a large model is traced with TRACE_LAYERS layers and its
inner layer is repeated in the recording: opt-30b plans in about as long as opt-125m.

Data parallel (`nproc` ranks, engine.distributed): every rank holds one shard of each chunk
(padded to split evenly), gathers a chunk whole for each use and reduce-scatters its
gradients, on its part of the global batch. Every rank then runs the same step, so the plan
is one rank's: its device peak, its host peak (and the machine's, for `nproc` ranks on one
machine, which `host_mem` is checked against), and the bytes it gathers and reduce-scatters
per step (engine.planning.sharded). A host budget is each rank's too, for its shards: the
disk figures are one rank's, in a scratch folder of its own.

The recording is engine.planning.recording's, the layout engine.planning.layout's, the
replay engine.planning.replay's (sharded, with engine.planning.sharded over it), the host's
side engine.planning.host_memory's, and each policy's replays, row and the recommendation
engine.planning.policy_plans'; this module checks the arguments, records the step, lays
out its chunks and gathers the rows into a Plan (engine.planning.report).
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine.config import PRECISIONS, EngineConfig, parse_size
from engine.devices.disk import default_disk_dir
from engine.models.lora import Lora, apply_lora
from engine.models.zoo import meta_model, model_config
from engine.placement.policy import Policy
from engine.planning.host_memory import HostMemory
from engine.planning.layout import ChunkBytes, model_layout, sharded_layout
from engine.planning.policy_plans import PolicyPlans
from engine.planning.recording import record_step
from engine.planning.report import Plan, PolicyPlan, Recommendation

__all__ = ["Plan", "PolicyPlan", "Recommendation", "plan"]

# Decoder layers traced for a deeper model: the first, one inner layer that stands for every
# inner layer, and the last.
TRACE_LAYERS = 3


def plan(
    model_name_or_path: str,
    *,
    device_mem: int | str,
    host_mem: int | str,
    precision: str = "bf16",
    batch_size: int = 2,
    seq_len: int = 128,
    checkpointing: bool = False,
    simulated: bool | None = None,
    chunk_size: int | None = None,
    margin_ratio: float = 0.0,
    host_budget: int | str | None = None,
    disk_dir: str | Path | None = None,
    nproc: int = 1,
    grad_accum: int = 1,
    lora: Lora | None = None,
) -> Plan:
    """Forecast a training step's device and host memory under each policy.

    Args:
        model_name_or_path: a zoo name or a local model folder (only its config is read).
        device_mem: device memory in bytes or as text ("6GiB"): the budget the engine gets.
        host_mem: host memory in bytes or as text: what the machine has, which the training
            process's peak (runtime, chunks, a simulated device) must stay within.
        precision: compute dtype of the chunks, "fp32", "bf16" or "fp16".
        batch_size, seq_len: the batch shape; activations scale with both.
        checkpointing: whether the model recomputes its layers in backward.
        simulated: whether the device lives in host memory (the simulated device); None
            means "when there is no CUDA", as the engine decides.
        chunk_size: elements per chunk; None searches it as the engine does.
        margin_ratio: the margin the cpu and auto rows are planned with (the recommendation
            picks its own).
        host_budget: the engine's host budget (EngineConfig.host_budget): chunk bytes and
            the disk tier's I/O buffers on the host; what does not fit goes to disk. None:
            no budget, nothing on disk.
        disk_dir: where the scratch folder would go (EngineConfig.disk_dir); None means the
            engine's default. Only its free space is read.
        nproc: data-parallel ranks (engine.distributed). Above 1 the plan is one rank's:
            `batch_size` is the global batch, which must split evenly over the ranks;
            `device_mem` is each rank's device; `host_mem` is the machine's, which every
            rank's host peak shares (ranks on one machine). A host budget is then each
            rank's, for its shards, and so are the disk figures.
        grad_accum: micro-batches of `batch_size` sequences per step (EngineConfig's):
            the memory is a micro-batch's whatever their number, the host budget
            included, but for the fp32 gradients' host buffers a later micro-batch starts
            with (HostMemory.grads_land_in_step) and the device's peak, the highest
            micro-batch's (resident chunks keep their gradients there from one to the
            next); copied, disk_read and disk_written are the whole step's.
        lora: LoRA adapters (engine.models.lora) as the run adds them: the base weights
            frozen, in payload-only chunks, and only the adapters with gradients and
            optimizer state. None: every parameter trains.

    Nothing is allocated: the model only ever exists on the meta device.

    Raises:
        engine.models.zoo.UnknownModel, engine.models.zoo.BadCheckpoint: the model cannot
            be found or read.
        ValueError: a size, precision or batch shape that makes no sense.
        engine.placement.rules.HostBudgetTooSmall: a host budget below what the host needs
            with every part that may go to disk on disk (a ValueError, with the numbers).
    """
    from engine.config import check_margin
    from engine.step.engine import DTYPES

    margin_ratio = check_margin(margin_ratio)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    device_bytes, host_bytes = parse_size(device_mem), parse_size(host_mem)
    if device_bytes <= 0 or host_bytes <= 0:
        raise ValueError("device and host memory must be positive")
    budget = parse_size(host_budget) if host_budget is not None else None
    if budget is not None and budget <= 0:
        raise ValueError("host_budget must be positive")
    folder = None
    if budget is not None:
        folder = Path(disk_dir).expanduser() if disk_dir is not None else default_disk_dir()
    if isinstance(grad_accum, bool) or not isinstance(grad_accum, int) or grad_accum < 1:
        raise ValueError(f"grad_accum must be a whole number of micro-batches, at least 1, "
                         f"not {grad_accum!r}")
    if batch_size < 1 or seq_len < 2:
        raise ValueError(
            f"batch_size must be at least 1 and seq_len at least 2, not {batch_size} and {seq_len}"
        )
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a whole number of ranks, at least 1, not {nproc!r}")
    if batch_size % nproc:
        raise ValueError(f"batch_size {batch_size} does not split evenly over {nproc} ranks; "
                         f"use a multiple of {nproc}")
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, not {chunk_size}")
    config = model_config(model_name_or_path)
    positions = getattr(config, "max_position_embeddings", None)
    if positions and seq_len > positions:
        raise ValueError(
            f"seq_len {seq_len} is longer than the {positions} positions of {model_name_or_path}"
        )
    if simulated is None:
        simulated = not torch.cuda.is_available()
    dtype = DTYPES[precision]

    events = record_step(
        config, dtype, batch_size // nproc, seq_len, checkpointing, trace_layers=TRACE_LAYERS,
        lora=lora,
        # As Engine.step scales each micro-batch's loss: by 1 / grad_accum, and in fp16 by
        # the loss scale too.
        loss_scale=(EngineConfig.initial_loss_scale if precision == "fp16" else 1.0)
        / grad_accum,
    )
    full = meta_model(model_name_or_path)
    if lora is not None:
        full = apply_lora(full, lora)
    whole = model_layout(full, events, chunk_size)
    lay = sharded_layout(whole, nproc)
    cost = ChunkBytes(dtype.itemsize, nproc)
    host = HostMemory(lay, cost=cost, host_mem=host_bytes, simulated=simulated,
                      host_budget=budget, disk_dir=folder, grad_accum=grad_accum)
    planner = PolicyPlans(lay, events, cost=cost, device_mem=device_bytes, host=host)
    plans, outcomes = {}, {}
    for policy in Policy:
        plans[policy.value], outcomes[policy.value] = planner.policy_plan(policy, margin_ratio)
    trace = outcomes["cpu"].trace
    return Plan(
        model=model_name_or_path,
        precision=precision,
        batch_size=batch_size,
        seq_len=seq_len,
        checkpointing=checkpointing,
        device_mem=device_bytes,
        host_mem=host_bytes,
        simulated=simulated,
        parameters=sum(lay.sizes.values()),
        chunk_size=lay.chunk_size,
        chunks=len(lay.numel),
        model_bytes=sum(ChunkBytes(dtype.itemsize).host(n, whole.is_frozen(c))
                        for c, n in enumerate(whole.numel)),
        working_set=planner.working_set(trace),
        non_model_peak=trace.non_model_peak,
        cuda=plans["cuda"],
        cpu=plans["cpu"],
        auto=plans["auto"],
        recommended=planner.recommend(plans, outcomes["auto"]),
        host_budget=budget,
        disk_dir=str(folder) if folder is not None else None,
        disk_needed=host.disk_needed,
        disk_free=host.disk_free,
        build_peak=host.runtime + host.built(),
        nproc=nproc,
        grad_accum=grad_accum,
        lora=lora,
    )
