"""Where a settled step's time goes inside the engine: wall seconds in its hooks, by function.

    python benchmarks/step_parts.py [--model small-opt] [--policy cpu] [--threads 2]
                                    [--steps 30] [--dry-run]

The model and the budgets are engine_overhead.py's (its `small-opt` or a zoo name, batch
2 x 128, fp32, the heap kept: no fresh pages), on the simulated device. After a few steps
to settle, each listed function is wrapped in a wall clock and the next `--steps` steps
are timed: every row is a function's inclusive time per step (a function's callees are in
its row and in their own), with its calls per step. The hooks' rows are the engine's
whole share of forward and backward; the copies' rows (`copy`: in line; `copy_ahead`: a
fetch ahead, in line where no core is spare for the copy thread, else only its
submission) are the bytes the stepping thread moves, nearly all of it in the hooks (the
rest: the chunks whose gradients were incomplete at the end of backward); the hooks less
the copies are the engine's Python. The wrappers
cost about half a microsecond a call, which the rows carry.

A profiler's attribution (cProfile, py-spy) weighs Python calls against the kernels
between them as it samples or traces them; a wall clock around each hook is what the step
waits for, copies and all.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from engine_overhead import build, clocked, policy_budgets

from engine import Engine, EngineConfig
from engine.chunks.chunk import Chunk
from engine.chunks.device_copies import DeviceCopies
from engine.chunks.gradients import Gradients
from engine.devices.host_memory import kept_heap
from engine.devices.simulated import SimulatedDevice
from engine.models.training import prepare_for_training
from engine.step.arrivals import GradientArrivals
from engine.step.runner import StepRunner

# (class, method, what it is): the hooks first, then what they call.
TIMED: list[tuple[type, str, str]] = [
    (StepRunner, "_pre_forward", "hook"),
    (StepRunner, "_post_forward", "hook"),
    (StepRunner, "_pre_backward", "hook"),
    (StepRunner, "_after_backward", "hook"),
    (GradientArrivals, "_take", "hook"),
    (SimulatedDevice, "copy", "copies"),
    (SimulatedDevice, "copy_ahead", "copies"),
    (StepRunner, "_point", "engine"),
    (StepRunner, "_sample", "engine"),
    (StepRunner, "_on_arrival", "engine"),
    (StepRunner, "_keep_room", "engine"),
    (DeviceCopies, "prepare", "engine"),
    (DeviceCopies, "prefetch", "engine"),
    (DeviceCopies, "release", "engine"),
    (Gradients, "keep_slot_grad", "engine"),
    (Gradients, "finish_grads", "engine"),
    (Chunk, "set_state", "engine"),
]


def timed(cls: type, name: str, seconds: dict[str, float], calls: dict[str, int]) -> Callable:
    """Wrap `cls.name` in a wall clock (engine_overhead.clocked) that adds each call's
    seconds and count under "Class.name"; returns the original, to put back."""
    original = getattr(cls, name)
    key = f"{cls.__name__}.{name}"

    def spent(call: float) -> None:
        seconds[key] = seconds.get(key, 0.0) + call
        calls[key] = calls.get(key, 0) + 1

    setattr(cls, name, clocked(original, spent))
    return original


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-opt")
    ap.add_argument("--policy", default="cpu", choices=["cuda", "auto", "cpu"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dry-run", action="store_true", help="the tiny model, a few steps")
    args = ap.parse_args(argv)
    settle = 5
    if args.dry_run:
        args.model, args.steps = "tiny", 3
    torch.set_num_threads(args.threads)
    if not kept_heap():
        raise SystemExit("this C library has no mallopt: the heap cannot be kept")
    base = build(args.model)
    prepare_for_training(base)
    g = torch.Generator().manual_seed(0)
    seq = 32 if args.dry_run else 128
    batches = [torch.randint(0, base.config.vocab_size, (2, seq), generator=g)
               for _ in range(settle + args.steps)]
    batches = [{"input_ids": b, "labels": b} for b in batches]
    budget = policy_budgets(base, batches[0], simulate=True)[0][args.policy]
    seconds: dict[str, float] = {}
    calls: dict[str, int] = {}
    # Wrapped before the engine is built: it installs its hooks as bound methods.
    originals = [(cls, name, timed(cls, name, seconds, calls)) for cls, name, _ in TIMED]
    steps = []
    try:
        with Engine(base, EngineConfig(policy=args.policy, device_budget=budget,
                                       simulate=True)) as eng:
            for batch in batches[:settle]:
                eng.step(batch)
            seconds.clear()
            calls.clear()
            for batch in batches[settle:]:
                t0 = time.perf_counter()
                eng.step(batch)
                steps.append(time.perf_counter() - t0)
            counted = dict(seconds), dict(calls)
    finally:
        for cls, name, original in originals:
            setattr(cls, name, original)
    seconds, calls = counted
    n = len(steps)
    step = statistics.median(steps)
    hooks = sum(seconds.get(f"{c.__name__}.{m}", 0.0) for c, m, kind in TIMED
                if kind == "hook") / n
    copies = sum(seconds.get(f"{c.__name__}.{m}", 0.0) for c, m, kind in TIMED
                 if kind == "copies") / n
    print(f"{args.model}, policy {args.policy}, {args.threads} threads, {n} steps: median step "
          f"{step * 1e3:.1f} ms; in the hooks {hooks * 1e3:.2f} ms a step "
          f"({hooks / step:.1%}); copies on the stepping thread {copies * 1e3:.2f} ms "
          f"({copies / step:.1%}), nearly all of them in the hooks")
    print(f"{'function':<34}{'kind':>8}{'ms/step':>10}{'calls/step':>12}")
    for cls, name, kind in TIMED:
        key = f"{cls.__name__}.{name}"
        if key in seconds:
            print(f"{key:<34}{kind:>8}{seconds[key] / n * 1e3:>10.2f}{calls[key] / n:>12.1f}")


if __name__ == "__main__":
    main()
