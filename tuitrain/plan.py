"""`tuitrain plan`: will a run fit? Device and host memory per policy, before training.

The forecast itself is engine.planning.planner.plan (no UI there); this module takes the
machine's memory as what the host has (the host budget, when the user gives one, is what
the engine keeps on the host, the rest going to disk), and prints the plan as a table or as
JSON. With `--nproc N` the plan is one data-parallel rank's (each of N on this machine):
its device peak, its host peak beside the machine's for all N, and the bytes it gathers
and reduce-scatters per step.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, TextIO

from engine.config import format_size
from tuitrain import plan_forecast
from tuitrain.errors import UsageError
from tuitrain.fit import default_device_budget, default_host_budget
from tuitrain.settings import Settings

if TYPE_CHECKING:
    from engine.planning.planner import Plan
    from engine.planning.time_model import StepTime


def plan_main(args: argparse.Namespace) -> int:
    """Print the plan for `args`, checked by the command line: model, device_budget (bytes,
    or None for this machine's), host_budget (bytes, or None for none), disk_dir (None for
    the engine's default), precision, batch_size, seq_len (None for what a run would use),
    checkpointing, grad_accum and margin_ratio (optional: 1 and 0), nproc (data-parallel
    ranks on this machine; 1: one process), json, hardware (an
    engine.planning.hardware.HardwareProfile to plan for instead of this machine's device,
    or None).

    Raises UsageError for input the planner refuses (one line, status 2).
    """
    from engine.devices.device import uses_cuda
    from engine.planning.planner import plan

    hardware = getattr(args, "hardware", None)  # a HardwareProfile: a GPU, not this device
    simulated = not uses_cuda() and hardware is None
    defaults = Settings()

    def forecast(device_budget: int | None, host_budget: int | None) -> Plan:
        try:
            return plan(
                args.model,
                device_mem=device_budget or (hardware.memory if hardware is not None
                                             else default_device_budget(simulated)),
                host_mem=default_host_budget(),
                host_budget=host_budget,
                disk_dir=args.disk_dir,
                precision=args.precision or defaults.precision_for(simulated),
                batch_size=args.batch_size or defaults.training.batch_size,
                seq_len=args.seq_len or defaults.training.seq_len,
                checkpointing=bool(args.checkpointing),
                grad_accum=getattr(args, "grad_accum", 1),
                margin_ratio=getattr(args, "margin_ratio", 0.0),
                simulated=simulated,
                nproc=args.nproc,
                lora=getattr(args, "lora", None),
            )
        except ValueError as error:  # UnknownModel and BadCheckpoint are ValueErrors too
            raise UsageError(" ".join(str(error).split())) from None

    result = forecast(args.device_budget, args.host_budget)
    accum = getattr(args, "grad_accum", 1)
    if args.json:
        times = plan_forecast.forecast(result, hardware, accum)
        json.dump(plan_forecast.add_to_json(result.to_dict(), result, times, accum), sys.stdout,
                  indent=2)
        sys.stdout.write("\n")
        return 0
    run_here: list[str] = []
    if args.host_budget is None and not result.policies[defaults.engine.policy].fits:
        # A run here adapts what was left to the defaults: the plan shown is of the run as
        # it would start, so that the table and the line below it tell one story.
        settled, run_here = what_a_run_would_do(args)
        if settled is not None:
            e = settled.engine
            device = e.device_budget.nbytes if e.device_budget is not None else None
            host = e.host_budget.nbytes if e.host_budget is not None else None
            if (device, host) != (args.device_budget, None):
                result = forecast(device or args.device_budget, host)
    print_plan(result, sys.stdout, plan_forecast.forecast(result, hardware, accum))
    for line in run_here:
        print(line)
    return 0


def what_a_run_would_do(args: argparse.Namespace) -> tuple[Settings | None, list[str]]:
    """What `tuitrain run` with the same flags would start with here (tuitrain.fit.settle,
    with this machine's free memory): its settings (None when refused) and, in one block,
    the defaults it would adapt, or its refusal."""
    from tuitrain.fit import settle

    engine: dict[str, object] = {"precision": args.precision, "disk_dir": args.disk_dir}
    if args.device_budget is not None:
        engine["device_budget"] = args.device_budget
    settings = Settings.model_validate({
        "model": args.model,
        "engine": engine,
        "training": {"batch_size": args.batch_size or Settings().training.batch_size,
                     "seq_len": args.seq_len or Settings().training.seq_len,
                     "activation_checkpointing": bool(args.checkpointing),
                     "grad_accum": getattr(args, "grad_accum", 1)},
    })
    said: list[str] = []
    try:
        settled = settle(settings, said.append, nproc=args.nproc)
    except ValueError as error:
        return None, [f"a run here would be refused: {error}"]
    if not said:
        return settled, []
    return settled, ["a run here, with these flags, would start with (the plan above is its):",
                     *(f"  {line}" for line in said)]


def print_plan(result: Plan, out: TextIO, times: dict[str, StepTime] | None = None) -> None:
    """The plan as a table per policy, the time per step of each, then the recommendation."""
    ranks = result.nproc
    device = f"device {format_size(result.device_mem)}"
    if ranks > 1:
        device += " per rank"
    if result.simulated:
        device += " (simulated: its bytes live in host memory and count in the host peak)"
    host = f"host {format_size(result.host_mem)}"
    batch = f"batch {result.batch_size} x {result.seq_len} tokens"
    if ranks > 1:
        host += f", shared by the {ranks} ranks"
        batch += f" ({result.batch_size // ranks} per rank on {ranks} data-parallel ranks)"
    if result.grad_accum > 1:  # what a step copies and how long it takes are all of theirs
        batch += f", {result.grad_accum} micro-batches a step"
    lines = [
        f"{result.model}, {result.precision}, {batch}"
        f"{', checkpointing' if result.checkpointing else ''}",
        f"{device}, {host}",
        f"{result.parameters:,} parameters in {result.chunks} chunks; model data "
        f"{format_size(result.model_bytes)} when on the host"
        f"{', a shard of it per rank' if ranks > 1 else ''}; working set "
        f"{format_size(result.working_set)}{' per rank' if ranks > 1 else ''} "
        f"(activations {format_size(result.non_model_peak)})",
        f"building: host peak {format_size(result.build_peak)}{' per rank' if ranks > 1 else ''}"
        f" (chunks made one at a time: never the whole model in host memory)",
        *_disk_lines(result),
        "",
    ]
    if ranks > 1:
        lines[-1:-1] = [
            f"figures are one rank's, but HOST, {ranks} RANKS: the machine's for all of them; "
            f"GATHERED is what a rank receives per step, REDUCE-SCATTERED what it sends"
        ]
    disk = result.uses_disk
    header = ("POLICY", "DEVICE PEAK", "HOST PEAK")
    if ranks > 1:
        header += (f"HOST, {ranks} RANKS", "COPIED/STEP", "GATHERED/STEP",
                   "REDUCE-SCATTERED/STEP")
    else:
        header += ("COPIED/STEP",)
    if disk:
        header += ("HOST CHUNKS", "I/O BUFFERS", "ON DISK", "DISK READ/STEP", "DISK WRITE/STEP")
    rows = [(*header, "FITS")]
    for name, p in result.policies.items():
        fits = "yes" if p.fits else f"no: {p.reason}"
        per_step = (p.copied, p.disk_read, p.disk_written)
        copied, read, written = (format_size(n) if p.fits else "-" for n in per_step)
        row = (name, format_size(p.device_peak), format_size(p.host_peak))
        if ranks > 1:
            sent = (format_size(n) if p.fits else "-" for n in (p.gathered, p.reduce_scattered))
            row += (format_size(p.machine_host_peak), copied, *sent)
        else:
            row += (copied,)
        if disk:
            row += (format_size(p.host_model), format_size(p.io_buffers),
                    format_size(p.disk_bytes), read, written)
        rows.append((*row, fits))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for name, *sizes, fits in rows:
        cells = [name.ljust(widths[0])] + [
            s.rjust(w) for s, w in zip(sizes, widths[1:], strict=True)
        ]
        lines.append("  ".join([*cells, fits]))
    lines += plan_forecast.text_lines(result, times or {})
    rec = result.recommended
    lines.append("")
    if rec.policy is None:
        lines.append(f"recommended: none ({rec.why})")
    else:
        lines.append(
            f"recommended: --policy {rec.policy} --margin {rec.margin_ratio:g} ({rec.why})"
        )
    out.write("\n".join(lines) + "\n")


def _disk_lines(result: Plan) -> list[str]:
    """What the host budget sends to disk, and whether the scratch folder has room."""
    if result.host_budget is None:
        return []
    ranks = result.nproc
    each = " per rank" if ranks > 1 else ""
    budget = f"host budget {format_size(result.host_budget)}{each}"
    if not result.uses_disk:
        return [f"{budget}: holds every chunk, nothing goes to disk"]
    # The ranks of one machine share its disk: each writes a folder of its own there.
    needed = result.disk_needed * ranks
    # cuda keeps every chunk on the device and sends nothing there (its row says if it fits).
    room = ("enough" if needed <= result.disk_free
            else "NOT enough for cpu or auto (cuda puts nothing there)")
    whose = f" for {ranks} ranks" if ranks > 1 else ""
    return [
        f"{budget} (chunks and disk I/O buffers on the host): the rest goes to disk, "
        f"up to {format_size(needed)}{whose} in {result.disk_dir}; "
        f"{format_size(result.disk_free)} free there, {room}"
    ]
