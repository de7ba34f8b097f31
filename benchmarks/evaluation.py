"""Evaluation through the engine against a plain forward over the same tokens, in one process.

    python benchmarks/evaluation.py [--model opt-125m] [--rounds 5] [--batches 4] [--threads 1]

Each round, after one training step of every engine: plain PyTorch's no-grad eval forward
over `--batches` held-out batches of 2 x 128 tokens, then `Engine.evaluate` over the same
batches under each policy (a budget every chunk fits in, and for auto also a tight one:
the traced working set plus a quarter of the parameter bytes). Medians of CPU seconds per
evaluation round (one thread: steadier than wall time on a shared machine) and the bytes
each copied to the device.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from engine import Engine, EngineConfig, format_size
from engine.models.training import prepare_for_training
from engine.models.zoo import build_model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dry-run", action="store_true", help="the tiny model, one round")
    args = ap.parse_args(argv)
    seq_len = 128
    if args.dry_run:
        args.model, args.rounds, args.batches, seq_len = "tiny", 1, 2, 32
    torch.set_num_threads(args.threads)
    base = build_model(args.model, seed=0)
    prepare_for_training(base)  # no generation cache in any system, as the engine runs it
    vocab = base.config.vocab_size
    g = torch.Generator().manual_seed(0)

    def batch() -> dict[str, torch.Tensor]:
        ids = torch.randint(0, vocab, (2, seq_len), generator=g)
        return {"input_ids": ids, "labels": ids}

    train, held_out = batch(), [batch() for _ in range(args.batches)]
    payload = sum(p.numel() * 4 for p in base.parameters())
    with Engine(copy.deepcopy(base), EngineConfig(policy="cpu", device_budget="64GiB")) as probe:
        probe.step(train)
        working_set = probe.trace.working_set
    budgets = {"cuda": 64 * 2**30, "auto": 64 * 2**30, "cpu": 64 * 2**30,
               "auto-tight": working_set + payload // 4}
    engines = {}
    for name, budget in budgets.items():
        eng = Engine(copy.deepcopy(base),
                     EngineConfig(policy=name.split("-")[0], device_budget=budget))
        eng.step(train)
        engines[name] = eng
    plain = copy.deepcopy(base).eval()

    def plain_eval() -> list[float]:
        with torch.no_grad():
            return [float(plain(**b).loss) for b in held_out]

    systems = {"plain": plain_eval}
    for name, eng in engines.items():
        systems[name] = lambda eng=eng: [eng.evaluate(b) for b in held_out]
    seconds: dict[str, list[float]] = {name: [] for name in systems}
    copied: dict[str, list[int]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, run in systems.items():
            before = engines[name].manager.bytes_h2d if name in engines else 0
            t0 = time.process_time()
            run()
            seconds[name].append(time.process_time() - t0)
            if name in engines:
                copied[name].append(engines[name].manager.bytes_h2d - before)
    base_median = statistics.median(seconds["plain"])
    print(f"{args.model}, {args.batches} batches of 2 x {seq_len}, fp32, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds; payload "
          f"{format_size(payload)}, working set {format_size(working_set)}")
    print(f"{'system':<12}{'budget':>12}{'CPU s':>9}{'x plain':>9}{'copied 1st':>12}"
          f"{'copied later':>14}")
    for name, values in seconds.items():
        median = statistics.median(values)
        budget = format_size(budgets[name]) if name in budgets else "-"
        first = format_size(copied[name][0]) if name in copied else "-"
        later = (format_size(statistics.median(copied[name][1:] or [0]))
                 if name in copied else "-")
        print(f"{name:<12}{budget:>12}{median:>9.3f}{median / base_median:>9.2f}{first:>12}"
              f"{later:>14}")


if __name__ == "__main__":
    main()
