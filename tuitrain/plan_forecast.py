"""The time forecast of `tuitrain plan`: seconds per step for each policy's row.

The forecast is engine.planning.time_model's, with this machine's calibration (measured
once and cached; the first plan says it is measuring; a plan that uses the disk probes the
disk where the scratch would go: engine.planning.disk_speed) or, with `--hardware NAME`, a shipped
profile's published specs beside this host's measured figures: then an estimate from specs,
which the output says.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from tuitrain.formatting import format_seconds

if TYPE_CHECKING:
    from engine.planning.calibration import Calibration
    from engine.planning.hardware import HardwareProfile
    from engine.planning.planner import Plan
    from engine.planning.time_model import StepTime

# The parts a text line names, in the order a step runs them, and their labels.
_PARTS = (("forward", "forward"), ("backward", "backward"), ("recompute", "recompute"),
          ("copy_h2d", "copies in"), ("copy_d2h", "copies out"),
          ("optimizer_host", "update on host"), ("optimizer_device", "update on device"),
          ("disk", "disk"), ("collectives", "collectives"))


def machine_calibration(**kwargs: Any) -> Calibration:
    """This machine's calibration (engine.planning.calibration.calibration, given `kwargs`),
    measured, where it must be, in the heap a run keeps (engine.devices.host_memory
    .steady_heap, as tuitrain.training_run sets it): the new memory its decoder takes is
    then what the forecasts price apart. Only a process that measures takes that heap, for
    the rest of its life, as a run's does; one that reads the cached figures keeps its own."""
    from engine.devices.host_memory import steady_heap
    from engine.planning.calibration import calibration, measure

    def measured() -> Calibration:
        steady_heap()
        return measure()

    return calibration(measure_fn=measured, **kwargs)


def forecast(result: Plan, hardware: HardwareProfile | None,
             grad_accum: int = 1) -> dict[str, StepTime]:
    """policy -> StepTime for `result`'s rows; measures this machine first if it never was,
    and the disk where the scratch would go if a row uses it (saying so on stderr)."""
    from engine.planning.disk_speed import disk_now
    from engine.planning.time_model import step_times

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    cal = machine_calibration(say=say, precision=result.precision)
    if result.uses_disk:
        cal = disk_now(cal, result.disk_dir, say=say)
    if hardware is not None:
        cal = hardware.calibration(cal)
    return step_times(result, cal, grad_accum=grad_accum)


def row_settings(result: Plan, policy: str, grad_accum: int = 1) -> dict[str, object]:
    """The settings a row assumes, under the keys of a preset's `engine:` and `training:`."""
    return {
        "engine": {"policy": policy, "margin_ratio": 0.0, "device_budget": result.device_mem,
                   "host_budget": result.host_budget, "precision": result.precision},
        "training": {"batch_size": result.batch_size, "seq_len": result.seq_len,
                     "grad_accum": grad_accum,
                     "activation_checkpointing": result.checkpointing},
    }


def add_to_json(out: dict, result: Plan, times: dict[str, StepTime],
                grad_accum: int = 1) -> dict:
    """`out` (Plan.to_dict()) with each row's `step_seconds` (total and parts) and
    `settings`, and where the figures come from."""
    for policy, time in times.items():
        out[policy]["step_seconds"] = time.parts()
        out[policy]["settings"] = row_settings(result, policy, grad_accum)
    out["step_seconds_source"] = next(iter(times.values())).source if times else ""
    return out


def text_lines(result: Plan, times: dict[str, StepTime]) -> list[str]:
    """One line per row that fits: its seconds per step and what they are made of."""
    if not times:
        return []
    source = next(iter(times.values())).source
    lines = ["", f"time per step, forecast from {source}:"]
    width = max(len(name) for name in times)
    for policy, time in times.items():
        if not result.policies[policy].fits:
            lines.append(f"{policy.ljust(width)}  -  (does not fit)")
            continue
        parts = ", ".join(f"{label} {format_seconds(getattr(time, key))}"
                          for key, label in _PARTS if getattr(time, key) > 0)
        hidden = f"; {format_seconds(time.overlap)} of it overlapped" if time.overlap else ""
        lines.append(f"{policy.ljust(width)}  {format_seconds(time.total)}  ({parts}{hidden})")
    return lines
