"""Will a run fit this machine? Its memory when the user names none, and the settings a run
starts with: what the user left to the defaults chosen so that the plan says it fits, what
they chose and cannot fit refused, before anything is built.

The forecast itself is engine.planning.planner.plan (no UI there). Used by the worker at the
start of a run and by the `plan` command for the machine's defaults.
"""

from __future__ import annotations

from collections.abc import Callable

from tuitrain.settings import SIMULATED_DEVICE_BUDGET, Settings, Size


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


# Host memory left to the rest of the machine.
HOST_RESERVE = 1024**3
MiB = 2**20


def host_room(ranks: int = 1) -> int:
    """Host memory this run may use: what is available now plus what this process holds
    already (the plan counts the process's runtime), less HOST_RESERVE for the rest. With
    `ranks` data-parallel ranks on this machine, what all of them may use together: each
    holds about what this one does when they start."""
    import psutil

    held = psutil.Process().memory_info().rss
    return psutil.virtual_memory().available + ranks * held - HOST_RESERVE


def _least_room(room: int, nproc: int) -> int:
    """The least `room` of the `nproc` ranks, once they have joined: they read their
    machines' free memory at slightly different moments. Before (`tuitrain plan --nproc`
    plans for ranks not started), this process's own."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() != nproc:
        return room
    least = torch.tensor([room], dtype=torch.int64)
    dist.all_reduce(least, op=dist.ReduceOp.MIN)
    return int(least.item())


def settle(settings: Settings, say: Callable[[str], None], *, nproc: int = 1,
           local: int | None = None) -> Settings:
    """The run as it will start, decided by the plan before anything is built.

    What the user left to the defaults adapts until the plan says the run fits this
    machine, and `say` hears each choice in one line: a simulated device (whose bytes live
    in host memory) shrinks first, then a host budget sends what does not fit to disk.
    What the user chose and cannot fit is refused: a ValueError with one line that says
    why and what would fit. A model the planner cannot read is left to the build to report.

    Returns the settings with what was chosen written in, so that the run (and a preset
    saved from it) uses exactly that.

    `nproc`: data-parallel ranks, each of which settles with the per-rank plan: each rank's
    device is its own, a machine's memory is shared by the `local` ranks on it (by default
    all of them: one machine). A host budget chosen then is each rank's, for its shards,
    within its share of this machine's room. When the ranks have joined
    (torch.distributed), every rank must call this at the same point: they plan with the
    least room any of them found, so that all decide alike.
    """
    from engine.config import format_size
    from engine.devices.device import uses_cuda
    from engine.placement.rules import BudgetTooSmall, HostBudgetTooSmall
    from engine.planning.planner import plan

    simulated = not uses_cuda()
    e = settings.engine
    local = nproc if local is None else local
    room = host_room() if nproc == 1 else _least_room(host_room(local), nproc)

    def here(row) -> int:
        """The row's host peak for the ranks on this machine."""
        return row.host_peak * local

    def forecast(device: int, host_budget: int | None):
        result = plan(
            settings.model,
            device_mem=device,
            # The plan checks all its ranks' peaks against host_mem; `local` of them share
            # this machine's room.
            host_mem=room * nproc // local,
            precision=settings.precision_for(simulated),
            batch_size=settings.training.batch_size,
            seq_len=settings.training.seq_len,
            checkpointing=settings.training.activation_checkpointing,
            grad_accum=settings.training.grad_accum,
            simulated=simulated,
            chunk_size=e.chunk_size,
            margin_ratio=e.margin_ratio,
            host_budget=host_budget,
            disk_dir=e.disk_dir,
            nproc=nproc,
            lora=settings.lora(),
        )
        return result, result.policies[chosen.get("policy", e.policy)]

    chosen: dict[str, object] = {}  # what this settles, written into the settings
    device = settings.device_budget_for(simulated) or default_device_budget(simulated)
    host_budget = e.host_budget.nbytes if e.host_budget is not None else None
    try:
        result, row = forecast(device, host_budget)
    except (BudgetTooSmall, HostBudgetTooSmall):
        raise
    except Exception:  # the planner cannot read this model; the build will say why
        return settings
    rec = result.recommended
    if not settings.policy_chosen and rec.policy not in (None, row.policy):
        row = result.policies[rec.policy]
        chosen["policy"] = rec.policy
        say(f"policy {rec.policy}: the plan's choice for this machine ({rec.why})")
    if not row.fits and simulated and e.device_budget is None and here(row) > room:
        # Every rank's device shrinks alike: each gives up its share of the excess. The host
        # peak falls by less than the device's (the pool's buffers and the peak's moment
        # move with it), so it shrinks again by what is still over, a few times at most.
        for _ in range(3):
            excess = -(-(here(row) - room) // local)
            smaller = (min(device, row.device_peak) - excess) // MiB * MiB
            if smaller < result.working_set:
                break
            result, row = forecast(smaller, host_budget)
            device = smaller
            chosen["device_budget"] = Size.of_bytes(smaller)
            if row.fits or here(row) <= room:
                break
        if "device_budget" in chosen:
            whose = "the host's copies" if local == 1 else f"the host's copies of {local} ranks"
            say(f"simulated device budget {format_size(device)}"
                f"{' per rank' if nproc > 1 else ''}: its bytes live in host memory, and the "
                f"default {format_size(SIMULATED_DEVICE_BUDGET)} does not fit beside {whose}")
    share = room // local  # each rank's part of this machine's room
    if not row.fits and e.host_budget is None and row.host_peak > share:
        # Everything but the chunks stays; the chunks get what is left, the rest on disk.
        # (Without a budget, gradients land in buffers the update frees, so the peak may
        # hold some of them beside host_model: counted here as not the chunks', the guess
        # errs low; under a budget the chunks' bytes include them.)
        budget = share - (row.host_peak - row.host_model - row.io_buffers)
        for _ in range(3):
            budget = budget // MiB * MiB
            if budget <= 0:
                break
            try:
                result, row = forecast(device, budget)
            except HostBudgetTooSmall:
                break
            if row.fits or row.host_peak <= share:
                break
            budget -= row.host_peak - share
        if row.fits:
            chosen["host_budget"] = Size.of_bytes(budget)
            each = " per rank" if nproc > 1 else ""
            say(f"host budget {format_size(budget)}{each}: this machine's memory holds that "
                f"beside the rest, and {format_size(row.disk_bytes)} of training state{each} "
                f"goes to disk under {result.disk_dir}")
    if not row.fits:
        rec = result.recommended
        if rec.policy is None:  # nothing fits: the reason says what is missing
            raise ValueError(row.reason)
        line = f"policy {row.policy} will not fit: {row.reason}"
        if rec.policy != row.policy:
            line += (f"; policy {rec.policy} would (--policy {rec.policy} "
                     f"--margin {rec.margin_ratio:g})")
        raise ValueError(line)
    if not chosen:
        return settings
    return settings.model_copy(update={"engine": e.model_copy(update=chosen)})
