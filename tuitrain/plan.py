"""`tuitrain plan`: will a run fit? Device and host memory per policy, before training.

The forecast itself is engine.planning.planner.plan (no UI there); this module takes the
machine's memory when the user gives none, and prints the plan as a table or as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, TextIO

from engine.config import format_size
from tuitrain.errors import UsageError
from tuitrain.fit import default_device_budget, default_host_budget
from tuitrain.settings import Settings

if TYPE_CHECKING:
    from engine.planning.planner import Plan


def plan_main(args: argparse.Namespace) -> int:
    """Print the plan for `args`, checked by the command line: model, device_budget and
    host_budget (bytes, or None for this machine's), precision, batch_size, seq_len (None
    for what a run would use), checkpointing, json.

    Raises UsageError for input the planner refuses (one line, status 2).
    """
    from engine.devices.device import uses_cuda
    from engine.planning.planner import plan

    simulated = not uses_cuda()
    defaults = Settings()
    try:
        result = plan(
            args.model,
            device_mem=args.device_budget or default_device_budget(simulated),
            host_mem=args.host_budget or default_host_budget(),
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
