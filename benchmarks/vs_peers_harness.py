"""What every system of benchmarks/vs_peers.py shares: arguments, model, batches, the timed
loop and the result file, so that the systems differ only in how they train a step.

Each system runs in a process of its own and calls, in order:

    args = parse_args("plain")                 # the command line vs_peers.py passes
    model = build(args)                        # opt-125m from its config, seed 0
    step = ...                                 # the system's own wrapping of the model
    result = measure(args, step, batches(args, vocab))
    report(args, result, extra={...})          # JSON with peak RSS, read at the very end
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine.models.training import prepare_for_training
from engine.models.zoo import build_model

# Same optimizer for every system: torch.optim.AdamW's defaults, a constant learning rate
# and no clipping (DeepSpeed clips at 1.0 unless told otherwise).
LR = 1e-3
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01

Batch = dict[str, torch.Tensor]
Step = Callable[[Batch], float]  # trains one step, returns the loss as a Python float


@dataclass
class Result:
    system: str
    precision: str
    losses: list[float]  # every step, warm-up included
    seconds: list[float]  # wall time of every step, warm-up included
    warmup: int
    threads: int = 0
    setup_seconds: float = 0.0  # arguments read to the first step: model build and wrapping
    peak_rss: int = 0  # bytes, the process's high-water resident set (VmHWM)
    load_average: float = 0.0  # the machine's 1-minute load average when the steps ended
    extra: dict = field(default_factory=dict)


_started = time.perf_counter()


def parse_args(system: str, argv: list[str] | None = None) -> argparse.Namespace:
    """The worker command line; vs_peers.py builds it, a person may run one system by hand."""
    ap = argparse.ArgumentParser(description=f"one vs_peers system: {system}")
    ap.add_argument("--system", default=system)
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--steps", type=int, default=13, help="all steps, warm-up included")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0 keeps torch's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="where the JSON result goes")
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="write a cProfile of the timed (post warm-up) steps here",
    )
    args = ap.parse_args(argv)
    global _started
    _started = time.perf_counter()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    return args


def fused_adamw(params) -> torch.optim.AdamW:
    """The reference optimizer, with the hyperparameters every system shares."""
    return torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY,
                             fused=True)


def build(args: argparse.Namespace) -> torch.nn.Module:
    """The benchmark model in fp32; each system casts or wraps it as it would in practice.
    Without its generation cache, as the engine runs it (prepare_for_training): every
    system then runs the same forward."""
    model = build_model(args.model, seed=args.seed)
    prepare_for_training(model)
    return model


def batches(args: argparse.Namespace, vocab_size: int) -> list[Batch]:
    """Fixed-seed random tokens, one batch per step, identical in every process."""
    g = torch.Generator().manual_seed(args.seed)
    out = []
    for _ in range(args.steps):
        ids = torch.randint(0, vocab_size, (args.batch_size, args.seq_len), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def measure(args: argparse.Namespace, step: Step, data: list[Batch]) -> Result:
    """Run every batch through `step`, timing each one.

    The global RNG is seeded right before the first step so that every system draws the
    same dropout masks (OPT keeps dropout 0.1): wrapping a model may consume random numbers.
    """
    setup = time.perf_counter() - _started
    torch.manual_seed(args.seed)
    profiler = cProfile.Profile() if args.profile else None
    losses, seconds = [], []
    for i, batch in enumerate(data):
        timed = profiler is not None and i >= args.warmup
        if timed:
            profiler.enable()
        t0 = time.perf_counter()
        loss = step(batch)
        seconds.append(time.perf_counter() - t0)
        if timed:
            profiler.disable()
        losses.append(loss)
    if profiler is not None:
        profiler.dump_stats(args.profile)
    return Result(
        system=args.system,
        precision=args.precision,
        losses=losses,
        seconds=seconds,
        warmup=args.warmup,
        threads=torch.get_num_threads(),
        setup_seconds=setup,
    )


def peak_rss() -> int:
    """High-water resident set of this process image, in bytes.

    VmHWM rather than getrusage's ru_maxrss: on Linux ru_maxrss keeps the high-water mark
    of the process before exec, so a worker started by torchrun (which imports torch) would
    be charged for its launcher.
    """
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def report(args: argparse.Namespace, result: Result, extra: dict | None = None) -> None:
    """Write the result; peak RSS is read here, after the last step."""
    result.peak_rss = peak_rss()
    result.load_average = os.getloadavg()[0]
    result.extra.update(extra or {})
    args.out.write_text(json.dumps(asdict(result), indent=1))
