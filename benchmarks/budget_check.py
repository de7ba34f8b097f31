"""Does the device budget hold, counted as the user sees it: everything this process takes
on the GPU?

For each case a few steps train under a device budget, then the allocator's peaks are read
and the CUDA context (the driver's and the libraries' own memory, which no allocator
counts: hundreds of MiB, a lot on a 6 GB laptop) is added. A case holds when the
allocator's max reserved (its cache included) plus the context is within the budget the
user gave, and nothing ran out of memory.

    python benchmarks/budget_check.py [--cases cuda,auto,cpu,auto-below] [--steps 3]

Cases: opt-350m bf16 under policies cuda (8 GiB: all resident), auto (6 GiB, margin 0.9
from step 2: the engine fills the budget with chunks and optimizer state) and cpu (2 GiB);
and auto-below: opt-1.3b bf16 with activation checkpointing under 2 GiB, less than its
2.6 GB payload, so that auto fills the device (without checkpointing its minimum working
set is 3.0 GiB: the plan refuses it, and on an H200 its first step ran out of memory).
Each case runs in a process of its own: the allocator's figures and NVML's are per process,
and on an H200 a case run after another in one process started with up to 3.7 GB of the
earlier one's still allocated. One JSON line per case (max reserved and allocated,
num_alloc_retries, num_ooms, the context, the process's GPU memory from NVML or else
cudaMemGetInfo), then one line for all; exits 1 when a case does not hold. Needs CUDA;
`--dry-run` runs every case on the tiny model on the simulated device (no allocator
figures), to check that it starts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

from engine import Engine, EngineConfig, format_size, parse_size
from engine.models.zoo import build_model


@dataclass(frozen=True)
class Case:
    name: str
    model: str
    policy: str
    budget: str
    margin: float = 0.0
    checkpointing: bool = False


CASES = {
    "cuda": Case("cuda", "opt-350m", "cuda", "8GiB"),
    "auto": Case("auto", "opt-350m", "auto", "6GiB", margin=0.9),
    "cpu": Case("cpu", "opt-350m", "cpu", "2GiB"),
    "auto-below": Case("auto-below", "opt-1.3b", "auto", "2GiB", checkpointing=True),
}


def held(max_reserved: int, context: int, budget: int) -> bool:
    """Whether a run kept to its budget as the user counts it: the allocator's most
    reserved bytes plus the CUDA context, everything the process took on the device."""
    return max_reserved + context <= budget


def process_gpu_bytes() -> tuple[int, str]:
    """(bytes this process holds on the current GPU, where the figure comes from): NVML's
    per-process count when it lists this process, else cudaMemGetInfo's used bytes (the
    whole device's: right when this process is alone on it)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID("GPU-" + str(torch.cuda.get_device_properties(
            torch.cuda.current_device()).uuid))
        for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if p.pid == os.getpid() and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory), "nvml"
    except Exception:  # no NVML, another pid namespace, a MIG slice: fall back
        pass
    free, total = torch.cuda.mem_get_info()
    return total - free, "mem_get_info"


def cuda_context() -> tuple[int, str]:
    """The process's GPU memory that its allocator did not reserve (the CUDA context, cuBLAS
    and other libraries' workspaces), once CUDA is up and a matmul has made the handle."""
    x = torch.ones(64, 64, device="cuda")
    (x @ x).sum().item()
    torch.cuda.synchronize()
    used, source = process_gpu_bytes()
    return max(0, used - torch.cuda.memory_reserved()), source


def run_case(case: Case, steps: int, batch_size: int, seq_len: int, context: int,
             cuda: bool) -> dict:
    """Train `steps` steps of `case`; its figures and whether it held."""
    budget = parse_size(case.budget)
    model = build_model(case.model, seed=0)
    vocab = model.config.vocab_size
    eng = Engine(model, EngineConfig(policy=case.policy, device_budget=budget,
                                     precision="bf16", simulate=not cuda))
    if case.checkpointing:
        eng.set_checkpointing(True)  # from the first step
    g = torch.Generator().manual_seed(0)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.reset_accumulated_memory_stats()
    row: dict = {"case": case.name, "model": case.model, "policy": case.policy,
                 "budget": budget, "margin": case.margin, "context": context}
    stats = None
    try:
        for i in range(steps):
            if i == 1 and case.margin:
                eng.set_margin(case.margin)  # the margin needs the first step's trace
            ids = torch.randint(0, vocab, (batch_size, seq_len), generator=g)
            stats = eng.step({"input_ids": ids, "labels": ids})
        row["device_peak"] = stats.memory.device_peak
        row["device_model"] = stats.memory.device_model
        row["loss"] = stats.loss
    except torch.OutOfMemoryError as error:
        row["oom"] = f"step {i + 1}: {str(error).splitlines()[0]}"
    if cuda:
        torch.cuda.synchronize()
        memory = torch.cuda.memory_stats()
        # The engine resets the allocator's peaks at each trace point and keeps the run's
        # highest itself: the larger of the two is the run's.
        row.update(max_reserved=max(torch.cuda.max_memory_reserved(), eng.device.reserved_peak),
                   max_allocated=max(torch.cuda.max_memory_allocated(),
                                     eng.device.allocated_peak),
                   num_alloc_retries=memory.get("num_alloc_retries", 0),
                   num_ooms=memory.get("num_ooms", 0))
        row["process"], row["process_source"] = process_gpu_bytes()
    else:
        row.update(max_reserved=0, max_allocated=0, num_alloc_retries=0, num_ooms=0,
                   process=0, process_source="none (simulated)")
    row["pinned"] = eng.device.pinned_bytes()
    row["held"] = "oom" not in row and held(row["max_reserved"], context, budget)
    eng.close()
    del eng, model, stats
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        # What the closed engine left allocated: cuBLAS's workspaces (32 MiB a stream on
        # Hopper) and nothing else. On an H200, a case run after another in one process
        # started with gigabytes of the earlier one's still allocated.
        row["left_allocated"] = torch.cuda.memory_allocated()
    return row


def line(row: dict) -> str:
    if "error" in row:
        return f"{row['case']} failed: {row['error'].splitlines()[0]}"
    if "oom" in row:
        return f"{row['case']} OOM at {row['oom']}"
    total = row["max_reserved"] + row["context"]
    return (f"{row['case']} {format_size(row['max_reserved'])}+ctx "
            f"{format_size(row['context'])} {'<=' if row['held'] else '>'} "
            f"{format_size(row['budget'])} (alloc {format_size(row['max_allocated'])}, "
            f"{100 * total / row['budget']:.0f}%, retries {row['num_alloc_retries']}, "
            f"ooms {row['num_ooms']})")


CASE_SECONDS = 300  # a case that hangs fails alone, and the others still run


def in_own_process(case: Case, args: argparse.Namespace) -> dict:
    """`case`'s row, from this script run with `--here` on it alone in a new process."""
    command = [sys.executable, os.path.abspath(__file__), "--here", "--cases", case.name,
               "--steps", str(args.steps), "--batch-size", str(args.batch_size),
               "--seq-len", str(args.seq_len)] + (["--dry-run"] if args.dry_run else [])
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=CASE_SECONDS)
    except subprocess.TimeoutExpired:
        return {"case": case.name, "error": f"no result within {CASE_SECONDS} s", "held": False}
    rows = [json.loads(text) for text in done.stdout.splitlines()
            if text.startswith("{") and '"case"' in text]
    if not rows:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"case": case.name, "error": f"exit {done.returncode}: {tail}", "held": False}
    return rows[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", default=",".join(CASES),
                    help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--dry-run", action="store_true",
                    help="every case on the tiny model, simulated: checks that it starts")
    ap.add_argument("--here", action="store_true",
                    help="run the cases in this process (each is in its own otherwise)")
    args = ap.parse_args(argv)
    unknown = [c for c in args.cases.split(",") if c not in CASES]
    if unknown:
        print(f"budget check: unknown case {unknown[0]!r}; choose from {', '.join(CASES)}",
              file=sys.stderr)
        return 2
    cases = [CASES[c] for c in args.cases.split(",")]
    cuda = torch.cuda.is_available() and not args.dry_run
    if args.dry_run:
        cases = [Case(c.name, "tiny", c.policy, "64MiB", c.margin, c.checkpointing)
                 for c in cases]
        args.seq_len, args.steps = 32, 2
    elif not cuda:
        print("budget check: no CUDA device", file=sys.stderr)
        return 1
    if not args.here:
        rows = [in_own_process(case, args) for case in cases]
        for row in rows:
            print(json.dumps(row), flush=True)
        context, source = max((r.get("context", 0), r.get("context_source", "")) for r in rows)
    else:
        context, source = cuda_context() if cuda else (0, "none (simulated)")
        print(json.dumps({"context": context, "context_source": source}))
        rows = []
        for case in cases:
            try:
                row = run_case(case, args.steps, args.batch_size, args.seq_len, context, cuda)
            except Exception as error:  # one case failing must not hide the others
                row = {"case": case.name, "error": f"{type(error).__name__}: {error}",
                       "held": False}
            row["context_source"] = source
            print(json.dumps(row), flush=True)
            rows.append(row)
    verdict = "held" if all(r["held"] for r in rows) else "NOT HELD"
    print(f"{verdict}, context {format_size(context)} ({source}): "
          + "; ".join(line(r) for r in rows))
    return 0 if all(r["held"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
