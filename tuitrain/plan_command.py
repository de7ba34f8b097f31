"""`tuitrain plan`: what the user gave, checked and typed, for tuitrain.plan."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from tuitrain.errors import UsageError
from tuitrain.flags import PLAN, as_number, merge_flags
from tuitrain.given import Given

if TYPE_CHECKING:
    from tuitrain.settings import Settings


def cmd_plan(args: argparse.Namespace) -> int:
    """Check what the user gave, then hand it typed to tuitrain.plan.plan_main."""
    from pathlib import Path

    from tuitrain.plan import plan_main
    from tuitrain.settings import InvalidSettings, check_engine_setting

    base = _plan_base(args.preset)
    if args.model is None and "model" not in base.model_fields_set:
        raise UsageError("no model given: name one (e.g. `tuitrain plan opt-125m`, see "
                         "`tuitrain models`) or use a preset that sets `model:`")
    more = {"model": args.model} if args.model is not None else {}
    settings = merge_flags(base, args, PLAN, **more)
    try:  # checked as a run's --host-mem is
        size = check_engine_setting("host_budget", args.host_mem) if args.host_mem else None
    except InvalidSettings as error:
        raise UsageError(f"--host-mem: {error.problem}") from None
    host_budget = size.nbytes if size is not None else None
    from tuitrain.run_checks import check_disk, check_lora, check_model

    if args.disk is not None:  # a folder the run would refuse, the plan refuses too
        check_disk(Path(args.disk).expanduser())

    if host_budget is None and settings.engine.host_budget is not None:
        host_budget = settings.engine.host_budget.nbytes  # the preset's
    check_model(settings.model, settings.training.seq_len)
    check_lora(settings, Given.of(args, PLAN))
    nproc = _plan_ranks(args.nproc, settings.training.batch_size)
    hardware = _hardware(args.hardware or settings.hardware)
    simulated = not has_cuda() and hardware is None
    if hardware is not None and settings.engine.precision is None:
        settings = merge_flags(settings, args, (), **{"engine.precision": "bf16"})
    checked = argparse.Namespace(
        model=settings.model,
        device_budget=settings.device_budget_for(simulated),
        host_budget=host_budget,
        precision=settings.precision_for(simulated),
        batch_size=settings.training.batch_size,
        seq_len=settings.training.seq_len,
        checkpointing=settings.training.activation_checkpointing,
        grad_accum=settings.training.grad_accum,
        margin_ratio=settings.engine.margin_ratio,
        disk_dir=args.disk,
        nproc=nproc,
        lora=settings.lora(),
        json=args.json,
        hardware=hardware,
    )
    return plan_main(checked)


def _plan_base(preset: str | None) -> Settings:
    """The settings `tuitrain plan` starts from: the preset's, or the built-in defaults."""
    from tuitrain.preset_folders import find_preset
    from tuitrain.presets import PresetError, load_preset
    from tuitrain.settings import Settings

    if preset is None:
        return Settings()
    try:
        return load_preset(find_preset(preset))
    except PresetError as error:
        raise UsageError(str(error)) from None


def _hardware(name: str | None) -> object:
    """`--hardware NAME`: the shipped profile, or None without the flag."""
    if name is None:
        return None
    from engine.planning.hardware import hardware_profile

    try:
        return hardware_profile(name)
    except ValueError as error:
        raise UsageError(f"--hardware: {error}") from None


def _plan_ranks(nproc: str | None, batch_size: int) -> int:
    """`tuitrain plan --nproc`: ranks the plan is for (1 without it), checked as `run`
    checks it, the global batch splitting evenly over them."""
    if nproc is None:
        return 1
    from tuitrain.launch import check_nproc
    from tuitrain.ranks import Ranks

    try:
        ranks = check_nproc(as_number(nproc))
        Ranks(0, ranks).check_batch(batch_size)
    except ValueError as error:
        raise UsageError(str(error)) from None
    return ranks


def has_cuda() -> bool:
    from engine.devices.device import uses_cuda

    return uses_cuda()
