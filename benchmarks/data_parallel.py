"""Data parallel on this machine: the engine's sharded chunks against FSDP2 and DeepSpeed.

Two gloo ranks with one thread each, the same model, global batch and math (fp32, AdamW
with torch's defaults but lr 1e-3, dropout off): step time and each rank's peak resident
memory. Every system runs in ranks of its own (fresh processes, so that a peak is that
system's alone), started here through a file store:

    python benchmarks/data_parallel.py --model opt-125m --steps 6 --warmup 2

Systems:
- the engine, sharded over the ranks, under cuda (every shard resident on the simulated
  device), auto (the traced working set plus half of a rank's shard bytes) and cpu (twice
  the working set); the budgets come from a first traced step of the same run;
- FSDP2: `fully_shard` on each decoder layer and the root, CPUOffloadPolicy (pinning needs
  CUDA, so pin_memory=False), AdamW(fused=True);
- DeepSpeed ZeRO-3 with CPU offload, when deepspeed is installed (it is not in the dev
  environment: `pip install -e .[bench]` in a venv of its own).

On this CPU-only machine every byte is host memory (the engine's device is simulated in
it), so a rank's peak RSS is the comparable measure. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-3


def _peak_rss() -> int:
    """VmHWM: this process's high-water resident set, in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _model(name: str, seed: int) -> torch.nn.Module:
    from transformers import OPTForCausalLM

    from engine.models.zoo import model_config

    config = model_config(name)
    config.dropout = config.attention_dropout = 0.0  # the same arithmetic in every system
    torch.manual_seed(seed)
    return OPTForCausalLM(config)


def _batches(args: argparse.Namespace, vocab: int, rank: int, world: int) -> list[dict]:
    """Fixed-seed global batches; this rank's contiguous part of each."""
    g = torch.Generator().manual_seed(args.seed)
    out = []
    per_rank = args.batch_size // world
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=g)
        part = ids[rank * per_rank:(rank + 1) * per_rank]
        out.append({"input_ids": part, "labels": part.clone()})
    return out


# --- one system, in each rank -----------------------------------------------------------


def _engine(args: argparse.Namespace, model: torch.nn.Module, batches: list[dict],
            rank: int, world: int) -> dict:
    from engine import Engine, EngineConfig

    policy = "auto" if args.system == "engine-probe" else args.system.split("-")[1]
    budgets = json.loads(args.budgets) if args.budgets else {}
    eng = Engine(model, EngineConfig(policy=policy, device_budget=budgets.get(policy, "64GiB"),
                                     precision="fp32", lr=LR))
    losses, seconds, peaks, host = [], [], [], []
    for batch in batches:
        t0 = time.perf_counter()
        stats = eng.step(batch)
        seconds.append(time.perf_counter() - t0)
        losses.append(stats.loss)
        peaks.append(stats.memory.device_peak)
        host.append(stats.memory.host_model)
    extra = {"device_peak": max(peaks), "host_model": max(host)}
    if args.system == "engine-probe":
        trace = eng.trace
        shard_bytes = sum(c.home_numel * 4 for c in eng.chunks)
        extra["budgets"] = {"auto": int(trace.working_set + shard_bytes / 2),
                            "cpu": int(2 * trace.working_set)}
    eng.close()
    return {"losses": losses, "seconds": seconds, **extra}


def _fsdp2(args: argparse.Namespace, model: torch.nn.Module, batches: list[dict],
           rank: int, world: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    mesh = init_device_mesh("cpu", (world,))
    options = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=False)}
    for layer in model.model.decoder.layers:
        fully_shard(layer, **options)
    fully_shard(model, **options)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    losses, seconds = [], []
    for batch in batches:
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        dist.all_reduce(mean)  # the global batch's loss, as the engine reports it
        losses.append(float(mean) / world)
    return {"losses": losses, "seconds": seconds}


def _deepspeed(args: argparse.Namespace, model: torch.nn.Module, batches: list[dict],
               rank: int, world: int) -> dict:
    import deepspeed
    import torch.distributed as dist

    config = {
        "train_micro_batch_size_per_gpu": args.batch_size // world,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                              "offload_optimizer": {"device": "cpu"}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           model_parameters=model.parameters())
    losses, seconds = [], []
    for batch in batches:
        t0 = time.perf_counter()
        loss = engine(**batch).loss
        engine.backward(loss)
        engine.step()
        seconds.append(time.perf_counter() - t0)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / world)
    return {"losses": losses, "seconds": seconds}


SYSTEMS = {"engine": _engine, "fsdp2": _fsdp2, "deepspeed": _deepspeed}


def _rank(rank: int, world: int, store: str, out: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    os.environ["TUITRAIN_SIMULATE"] = "1"
    sys.path.insert(0, str(ROOT))
    import torch.distributed as dist

    result: dict = {}
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
        model = _model(args.model, args.seed)
        batches = _batches(args, model.config.vocab_size, rank, world)
        run = SYSTEMS[args.system.split("-")[0]]
        result = run(args, model, batches, rank, world)  # the system owns the model now
        result["peak_rss"] = _peak_rss()
    except BaseException:  # noqa: BLE001 - reported in the table
        result = {"error": traceback.format_exc()}
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        os._exit(0)


def run_system(args: argparse.Namespace, system: str) -> list[dict]:
    """`system` on args.ranks fresh processes; each rank's result."""
    with tempfile.TemporaryDirectory() as tmp:
        ctx = multiprocessing.get_context("spawn")
        run_args = argparse.Namespace(**{**vars(args), "system": system})
        procs = [ctx.Process(target=_rank, args=(r, args.ranks, f"{tmp}/store", tmp, run_args))
                 for r in range(args.ranks)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(args.deadline)
            if p.is_alive():
                p.kill()
        return [json.loads(Path(tmp, f"rank{r}.json").read_text())
                if Path(tmp, f"rank{r}.json").exists() else {"error": "no result (killed)"}
                for r in range(args.ranks)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4, help="global batch (sequences)")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=6, help="all steps, warm-up included")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--deadline", type=float, default=1800.0, help="seconds per system")
    ap.add_argument("--systems", default="",
                    help="comma-separated subset to run (engine-cuda,engine-auto,engine-cpu,"
                         "fsdp2,deepspeed); default all (deepspeed when installed)")
    args = ap.parse_args(argv)
    args.budgets = ""
    load = os.getloadavg()[0]

    probe = run_system(argparse.Namespace(**{**vars(args), "steps": 1}), "engine-probe")
    if "error" in probe[0]:
        print(probe[0]["error"], file=sys.stderr)
        return 1
    args.budgets = json.dumps(probe[0]["budgets"])
    systems = ["engine-cuda", "engine-auto", "engine-cpu", "fsdp2"]
    if importlib.util.find_spec("deepspeed") is not None:
        systems.append("deepspeed")
    if args.systems:
        systems = [s for s in systems if s in args.systems.split(",")]
    rows = []
    for system in systems:
        results = run_system(args, system)
        failed = [r["error"] for r in results if "error" in r]
        if failed:
            rows.append((system, None, failed[0].strip().splitlines()[-1]))
            continue
        timed = [statistics.median(r["seconds"][args.warmup:]) for r in results]
        rows.append((system, results, max(timed)))
    base = next((r for r in rows if r[0] == "fsdp2" and r[1]), None)
    print(f"{args.model}, {args.ranks} gloo ranks x 1 thread, global batch {args.batch_size} "
          f"x {args.seq_len}, fp32, {args.steps - args.warmup} timed steps after "
          f"{args.warmup}; load average {load:.1f} -> {os.getloadavg()[0]:.1f}")
    print(f"budgets per rank: {json.loads(args.budgets)}\n")
    print("| system | s/step (median, slowest rank) | x FSDP2 | peak RSS per rank (max) "
          "| x FSDP2 | final loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for system, results, value in rows:
        if results is None:
            print(f"| {system} | failed: {value} | | | | |")
            continue
        rss = max(r["peak_rss"] for r in results)
        step_ratio = value / base[2] if base else float("nan")
        rss_ratio = rss / max(r["peak_rss"] for r in base[1]) if base else float("nan")
        print(f"| {system} | {value:.3f} | {step_ratio:.2f} | {rss / 2**20:.0f} MiB | "
              f"{rss_ratio:.2f} | {results[0]['losses'][-1]:.5f} |")
    if "deepspeed" not in systems and not args.systems:
        print("| deepspeed ZeRO-3, CPU offload | not installed here | | | | |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
