"""One line about a headless run, from its `--metrics` JSONL: step time and its split,
tokens/s, MFU, bytes moved; with `--forecast`, the time model's forecast for the run's
settings and policy (this machine's calibration, measured first if it never was) against
the measured median.

    python benchmarks/run_summary.py runs/opt-1.3b.jsonl [--peak-tflops 989] [--forecast]

MFU (model FLOPs utilisation) = 6 x parameters x tokens per step / step seconds / peak,
the usual dense-transformer estimate (attention's own FLOPs left out). The peak is
`--peak-tflops` if given, else measured here: the best of a few large bf16 matmuls on the
GPU, which is what the chip really sustains (spec sheets quote more). The first step
traces the model and is reported apart; the rest give the medians. Exits 1 when the file
holds no step or a loss that is not finite.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time

from engine import format_size

MATMUL_SIDE = 8192  # large enough to reach the tensor cores' steady state
MATMUL_REPEATS = 20


def measured_peak_flops() -> float:
    """bf16 matmul FLOP/s this GPU sustains (the best of a few timed rounds)."""
    import torch

    a = torch.randn(MATMUL_SIDE, MATMUL_SIDE, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(MATMUL_SIDE, MATMUL_SIDE, device="cuda", dtype=torch.bfloat16)
    best = 0.0
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(MATMUL_REPEATS):
            a @ b
        torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        best = max(best, 2 * MATMUL_SIDE**3 * MATMUL_REPEATS / seconds)
    return best


def read(path: str) -> tuple[dict, list[dict]]:
    header, steps = {}, []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            if "step" in record and "seconds" in record:
                steps.append(record)
            elif "parameters" in record:
                header = record
    return header, steps


def summary(header: dict, steps: list[dict], peak_flops: float | None, peak_note: str) -> str:
    later = steps[1:] or steps
    seconds = statistics.median(s["seconds"] for s in later)
    split = ", ".join(f"{part} {statistics.median(s[part] for s in later):.3f}"
                      for part in ("forward", "backward", "optimizer", "transfer"))
    tokens = statistics.median(s["tokens"] for s in later)
    h2d = statistics.median(s["bytes_h2d"] for s in later)
    d2h = statistics.median(s["bytes_d2h"] for s in later)
    device_peak = max(s["memory"]["device_peak"] for s in steps)
    engine = header.get("settings", {}).get("engine", {})
    name = header.get("settings", {}).get("model", "run")
    parameters = header.get("parameters")
    if parameters and peak_flops:
        mfu = f"MFU {100 * 6 * parameters * tokens / seconds / peak_flops:.1f}% of {peak_note}"
    else:
        mfu = "MFU N/A"
    timing = (f"{len(steps)} steps, {seconds:.2f} s/step after the first "
              f"(first {steps[0]['seconds']:.1f} s; {split})" if len(steps) > 1
              else f"1 step, {seconds:.2f} s (tracing included; {split})")
    return (f"{name} {engine.get('precision', '?')} under {format_size(steps[-1]['device_budget'])}"
            f": {timing}, {tokens / seconds:,.0f} tok/s, {mfu}, moved "
            f"{format_size(h2d + d2h)}/step (h2d {format_size(h2d)}, d2h {format_size(d2h)}), "
            f"device peak {format_size(device_peak)}, loss {steps[-1]['loss']:.3f}")


def forecast(header: dict, steps: list[dict]) -> str:
    """The time model's seconds per step for the run's settings under the policy it ran,
    against the measured median of the steps after the first."""
    from engine.planning.planner import plan
    from tuitrain.fit import default_host_budget
    from tuitrain.plan_forecast import forecast as step_times

    settings = header.get("settings", {})
    engine, training = settings.get("engine", {}), settings.get("training", {})
    policy = steps[-1]["policy"]
    grad_accum = training.get("grad_accum", 1)
    result = plan(settings["model"], device_mem=steps[-1]["device_budget"],
                  host_mem=default_host_budget(), precision=engine.get("precision", "bf16"),
                  batch_size=training.get("batch_size", 2),
                  seq_len=training.get("seq_len", 128),
                  checkpointing=bool(training.get("activation_checkpointing")),
                  grad_accum=grad_accum)
    predicted = step_times(result, None, grad_accum)[policy].total
    measured = statistics.median(s["seconds"] for s in steps[1:] or steps)
    return (f"forecast {predicted:.3f} s/step under {policy}, measured {measured:.3f} "
            f"({measured / predicted:.2f}x the forecast)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("metrics")
    ap.add_argument("--peak-tflops", type=float, default=None,
                    help="the GPU's bf16 peak in TFLOP/s (default: measured here)")
    ap.add_argument("--forecast", action="store_true",
                    help="also the time model's forecast for the run's settings")
    ap.add_argument("--dry-run", action="store_true", help="check that it starts, and stop")
    args = ap.parse_args(argv)
    if args.dry_run:
        print(f"run summary: would read {args.metrics}")
        return 0
    header, steps = read(args.metrics)
    if not steps:
        print(f"{args.metrics}: no step recorded", file=sys.stderr)
        return 1
    if not all(math.isfinite(s["loss"]) for s in steps):
        print(f"{args.metrics}: a loss is not finite: {[s['loss'] for s in steps]}",
              file=sys.stderr)
        return 1
    if args.peak_tflops:
        peak, note = args.peak_tflops * 1e12, f"{args.peak_tflops:.0f} TFLOP/s given"
    else:
        peak = measured_peak_flops()
        note = f"{peak / 1e12:.0f} TFLOP/s (measured bf16 matmul)"
    line = summary(header, steps, peak, note)
    print(f"{line}; {forecast(header, steps)}" if args.forecast else line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
