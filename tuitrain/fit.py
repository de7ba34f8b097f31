"""Will a run fit this machine? Its memory when the user names none, and the warning a run
prints at its start when the planner says it will not fit.

The forecast itself is engine.planning.planner.plan (no UI there). Used by the worker at the
start of a run and by the `plan` command for the machine's defaults.
"""

from __future__ import annotations

from tuitrain.settings import Settings


def default_device_budget(simulated: bool) -> int:
    """What the engine gets with no budget: the GPU's free memory, or the simulated
    device's default (the laptop story's)."""
    if simulated:
        return Settings().device_budget_for(simulated=True)
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


def default_host_budget() -> int:
    """This machine's memory."""
    import psutil

    return int(psutil.virtual_memory().total)


def warn_if_unfit(settings: Settings) -> str | None:
    """One line saying why the run will not fit, or None if it will.

    Args:
        settings: the run as it is built (Settings.as_used): the budget is the one the
            engine got, which on the simulated device may be less than the one asked for.

    For the start of a run (headless or the app): the plan takes a second or two and
    allocates nothing. A model or size the planner cannot read gives None; the run reports
    that itself.
    """
    from engine.devices.device import uses_cuda
    from engine.planning.planner import plan

    simulated = not uses_cuda()
    try:
        result = plan(
            settings.model,
            device_mem=settings.device_budget_for(simulated) or default_device_budget(simulated),
            host_mem=default_host_budget(),
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
