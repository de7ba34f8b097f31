"""Does the GPU budget hold as the caching allocator sees it?

Trains a few steps under a device budget with the auto policy and a margin of 0.9 (the most
the planner recommends on a GPU), so that the engine fills the budget with chunks and
optimizer state, then compares what the allocator *reserved* (its cache included, the
number nvidia-smi is closest to) with the budget.

    python benchmarks/budget_check.py [--model opt-350m] [--budget 6GiB] [--steps 3]

Prints one line; exits 1 when max_memory_reserved exceeds the budget, or when the
allocator, held to the budget by the engine's hard cap, runs out of memory. opt-350m in
bf16 needs ~5.3 GB to keep everything resident (2 + 2 + 12 bytes a parameter), so under
6 GiB the margin pushes the budget to its edge. Needs CUDA.
"""

from __future__ import annotations

import argparse
import sys

import torch

from engine import Engine, EngineConfig, format_size, parse_size
from engine.models.zoo import build_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-350m")
    ap.add_argument("--budget", default="6GiB")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--margin", type=float, default=0.9)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("budget check: no CUDA device", file=sys.stderr)
        return 1
    budget = parse_size(args.budget)

    model = build_model(args.model, seed=0)
    vocab = model.config.vocab_size
    eng = Engine(model, EngineConfig(policy="auto", device_budget=budget,
                                     precision=args.precision, simulate=False))
    g = torch.Generator().manual_seed(0)
    torch.cuda.reset_peak_memory_stats()
    try:
        for i in range(args.steps):
            if i == 1:
                eng.set_margin(args.margin)  # the margin needs the first step's trace
            ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=g)
            stats = eng.step({"input_ids": ids, "labels": ids})
    except torch.OutOfMemoryError as error:
        print(f"OOM: {args.model} {args.precision}, margin {args.margin}, step {i + 1} under "
              f"{format_size(budget)}: {str(error).splitlines()[0]}")
        return 1
    torch.cuda.synchronize()
    reserved = torch.cuda.max_memory_reserved()
    allocated = torch.cuda.max_memory_allocated()
    others = eng.device.other_processes_bytes()
    held = reserved <= budget
    print(f"{'ok' if held else 'OVER'}: {args.model} {args.precision}, margin {args.margin}: "
          f"max reserved {format_size(reserved)} {'<=' if held else '>'} budget "
          f"{format_size(budget)} (max allocated {format_size(allocated)}, device model "
          f"{format_size(stats.memory.device_model)}, pinned "
          f"{format_size(eng.device.pinned_bytes())}, other processes "
          f"{format_size(others) if others is not None else 'N/A'})")
    eng.close()
    return 0 if held else 1


if __name__ == "__main__":
    sys.exit(main())
