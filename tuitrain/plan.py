"""`tuitrain plan`: will a run fit? Device and host memory per policy, before training.

The forecast itself is engine.planning.planner.plan (no UI there); this module picks the machine's
memory when the user gives none, and prints the plan as a table or as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, TextIO

from engine.config import format_size

if TYPE_CHECKING:
    from engine.planning.planner import Plan
    from tuitrain.settings import Settings


def default_device_mem(simulated: bool) -> int:
    """What the engine would get with no budget: the GPU's free memory, or the simulated
    device's default (the laptop story's 6 GiB)."""
    from tuitrain.settings import Settings

    if simulated:
        return Settings().budget_bytes(simulated=True)
    try:
        # NVML answers without a CUDA context, which in the app's process would hold device
        # memory the worker needs for the whole run.
        return _nvml_free()
    except Exception:  # NVML missing or not answering: ask the driver through torch
        import torch

        free, _ = torch.cuda.mem_get_info()
        return int(free)


def _nvml_free() -> int:
    """Free bytes of the GPU torch calls device 0 (the first of CUDA_VISIBLE_DEVICES)."""
    import os

    import pynvml

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    pynvml.nvmlInit()
    try:
        if visible.startswith("GPU-") or visible.startswith("MIG-"):
            handle = pynvml.nvmlDeviceGetHandleByUUID(visible)
        else:
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible or 0))
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).free)
    finally:
        pynvml.nvmlShutdown()


def default_host_mem() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


def plan_main(args: argparse.Namespace) -> int:
    """Print the plan for `args` (model, device_mem, host_mem, precision, batch_size, seq_len,
    checkpointing, json); sizes are bytes, text such as "6GiB", or None for this machine.

    Raises tuitrain.cli.UsageError for input the planner refuses (one line, status 2).
    """
    import torch

    from engine.config import parse_size
    from engine.planning.planner import plan
    from tuitrain.cli import UsageError
    from tuitrain.settings import Settings

    simulated = not torch.cuda.is_available()
    defaults = Settings()
    try:
        device_mem = (
            parse_size(args.device_mem)
            if args.device_mem is not None
            else default_device_mem(simulated)
        )
        host_mem = parse_size(args.host_mem) if args.host_mem is not None else default_host_mem()
        result = plan(
            args.model,
            device_mem=device_mem,
            host_mem=host_mem,
            precision=args.precision or defaults.precision_for(simulated),
            batch_size=args.batch_size or defaults.training.batch_size,
            seq_len=args.seq_len or defaults.training.seq_len,
            checkpointing=bool(args.checkpointing),
            simulated=simulated,
        )
    except ValueError as error:  # UnknownModel and BadCheckpoint are ValueErrors too
        raise UsageError(" ".join(str(error).split())) from None
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print_plan(result, sys.stdout)
    return 0


def print_plan(result: Plan, out: TextIO) -> None:
    """The plan as a table per policy, then the recommendation."""
    device = f"device {format_size(result.device_mem)}"
    if result.simulated:
        device += " (simulated: its bytes live in host memory and count in the host peak)"
    lines = [
        f"{result.model}, {result.precision}, batch {result.batch_size} x {result.seq_len} "
        f"tokens{', checkpointing' if result.checkpointing else ''}",
        f"{device}, host {format_size(result.host_mem)}",
        f"{result.parameters:,} parameters in {result.chunks} chunks; model state "
        f"{format_size(result.model_bytes)}; working set {format_size(result.working_set)} "
        f"(activations {format_size(result.non_model_peak)})",
        "",
    ]
    rows = [("POLICY", "DEVICE PEAK", "HOST PEAK", "COPIED/STEP", "FITS")]
    for name, p in result.policies.items():
        fits = "yes" if p.fits else f"no: {p.reason}"
        copied = format_size(p.copied) if p.fits else "-"
        rows.append((name, format_size(p.device_peak), format_size(p.host_peak), copied, fits))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for name, *sizes, fits in rows:
        cells = [name.ljust(widths[0])] + [
            s.rjust(w) for s, w in zip(sizes, widths[1:], strict=True)
        ]
        lines.append("  ".join([*cells, fits]))
    rec = result.recommended
    lines.append("")
    if rec.policy is None:
        lines.append(f"recommended: none ({rec.why})")
    else:
        lines.append(
            f"recommended: --policy {rec.policy} --margin {rec.margin_ratio:g} ({rec.why})"
        )
    out.write("\n".join(lines) + "\n")


def warn_if_unfit(settings: Settings) -> str | None:
    """One line saying why the run `settings` describes will not fit, or None if it will.

    For the start of a run (headless or the app): the plan takes a second or two and
    allocates nothing. A model or size the planner cannot read gives None; the run reports
    that itself.
    """
    import torch

    from engine.planning.planner import plan

    simulated = not torch.cuda.is_available()
    try:
        device_mem = settings.budget_bytes(simulated) or default_device_mem(simulated)
        result = plan(
            settings.model,
            device_mem=device_mem,
            host_mem=default_host_mem(),
            precision=settings.precision_for(simulated),
            batch_size=settings.training.batch_size,
            seq_len=settings.training.seq_len,
            checkpointing=settings.training.activation_checkpointing,
            simulated=simulated,
            chunk_size=settings.engine.chunk_size,
            margin_ratio=settings.engine.margin_ratio,
        )
    except (ValueError, RuntimeError):  # a warning must never stop the run it warns about
        return None
    chosen = result.policies[settings.engine.policy]
    if chosen.fits:
        return None
    line = f"the plan says policy {chosen.policy} will not fit: {chosen.reason}"
    rec = result.recommended
    if rec.policy is not None and rec.policy != chosen.policy:
        line += f"; policy {rec.policy} would (margin {rec.margin_ratio:g})"
    return line
