"""The tuner's forecaster: a candidate through the plan (does it fit, and if not, which
budget by how much) and the time model (seconds per step), with this machine's calibration.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tuitrain.tune import Candidate, Forecast, Forecaster

if TYPE_CHECKING:
    from engine.planning.calibration import Calibration


def plan_forecaster(model: str, *, host_mem: int, precision: str, seq_len: int,
                    simulated: bool, calibration: Calibration,
                    disk_dir: str | Path | None = None, lora: object = None,
                    say: Callable[[str], None] | None = None) -> Forecaster:
    """A Forecaster for `model` at this batch length on this machine (with `lora`'s
    adapters, an engine.models.lora.Lora, if given). Plans are shared by the candidates
    that differ only in policy (accumulation changes the host peak and the disk's bytes).
    `say` tells when the disk is measured (engine.planning.disk_speed.disk_now)."""
    from engine.planning.disk_speed import disk_now
    from engine.planning.planner import plan
    from engine.planning.time_model import step_times

    plans: dict[tuple, object] = {}

    def forecast(c: Candidate) -> Forecast:
        key = (c.device_budget, c.batch_size, c.grad_accum, c.activation_checkpointing,
               c.margin_ratio, c.host_budget)
        if key not in plans:
            plans[key] = plan(model, device_mem=c.device_budget, host_mem=host_mem,
                              precision=precision, batch_size=c.batch_size, seq_len=seq_len,
                              checkpointing=c.activation_checkpointing, simulated=simulated,
                              margin_ratio=c.margin_ratio, host_budget=c.host_budget,
                              disk_dir=disk_dir, grad_accum=c.grad_accum, lora=lora)
        p = plans[key]
        row = p.policies[c.policy]
        if not row.fits:
            return Forecast(False, 0.0, row.reason, over=_over(row, c, host_mem))
        # A setting that uses the disk: at its folder's speed now (probed once a while).
        cal = disk_now(calibration, p.disk_dir, say=say) if p.uses_disk else calibration
        return Forecast(True, step_times(p, cal, grad_accum=c.grad_accum)[c.policy].total)

    return forecast


def _over(row, c: Candidate, host_mem: int) -> str:
    """Which budget a setting that does not fit goes over, and by how much, in a few words
    (a table's cell): "device +1.2 GiB"; the disk when it is neither."""
    from tuitrain.formatting import format_size

    host = c.host_budget if c.host_budget is not None else host_mem
    if row.device_peak > c.device_budget:
        return f"device +{format_size(row.device_peak - c.device_budget)}"
    if row.host_peak > host:
        return f"host +{format_size(row.host_peak - host)}"
    return "disk too small"
