"""The offload engine against its peers: plain PyTorch, DeepSpeed ZeRO-3 offload and FSDP2.

The same model (opt-125m built from its config, seed 0, no download), the same batches
(batch 2 x 128 of fixed-seed random tokens), the same AdamW (lr 1e-3, weight decay 0.01, no
clipping), in fp32 and bf16, for each of:

    (a) plain     plain PyTorch, AdamW(fused=True); bf16 under CPU autocast
    (b) deepspeed DeepSpeed ZeRO-3, parameters and optimizer offloaded to the CPU, on its
                  CPU accelerator with gloo and DeepSpeedCPUAdam
    (c) engine-cpu, engine-auto
                  our engine under policy cpu / auto; device budget = the traced working
                  set + half the parameter bytes in the compute dtype
    (d) fsdp2     PyTorch FSDP2 fully_shard with CPUOffloadPolicy(pin_memory=False) on a
                  one-rank gloo CPU mesh, under torchrun

Each system runs in a process of its own (benchmarks/vs_peers_<system>.py), so its peak
resident memory is its own; systems run one after another, never side by side. Reported:
the median step time after warm-up, peak RSS, the largest relative loss difference from
(a) over all steps, and ratios to (a) and (b).

    python benchmarks/vs_peers.py --quick          # fp32, a few steps: see that all run
    python benchmarks/vs_peers.py --precisions fp32 --repeats 2    # about 10 minutes
    python benchmarks/vs_peers.py --precisions bf16 --threads 1    # see --bf16-steps
    python benchmarks/vs_peers.py --precisions fp32 --systems plain engine-cpu

A CPU without native bf16 matrix units (AVX2 only) runs a bf16 step of this model tens of
times slower than fp32, minutes per step, hence the separate, shorter bf16 step count.

DeepSpeed is the `bench` extra (`pip install -e '.[bench]'`); without it its rows say so.
This process imports no torch: it only launches, collects and prints.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
SYSTEMS = ("plain", "deepspeed", "engine-cpu", "engine-auto", "fsdp2")
LABELS = {
    "plain": "(a) plain PyTorch",
    "deepspeed": "(b) DeepSpeed ZeRO-3 offload",
    "engine-cpu": "(c) engine, policy cpu",
    "engine-auto": "(c) engine, policy auto",
    "fsdp2": "(d) FSDP2 CPU offload",
}
# The engine's cpu policy should beat DeepSpeed's step time by this factor, and use no
# more memory than FSDP2.
TARGET_VS_DEEPSPEED = 0.75


def command(
    system: str, precision: str, args: argparse.Namespace, out: Path, profile: Path | None
) -> list[str]:
    """The worker command line of one system."""
    common = [
        "--system",
        system,
        "--precision",
        precision,
        "--model",
        args.model,
        "--steps",
        str(args.steps if precision == "fp32" else args.bf16_steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--seq-len",
        str(args.seq_len),
        "--threads",
        str(args.threads),
        "--out",
        str(out),
    ]
    if profile is not None:
        common += ["--profile", str(profile)]
    py = sys.executable
    if system == "plain":
        return [py, str(HERE / "vs_peers_plain.py"), *common]
    if system == "deepspeed":
        return [py, str(HERE / "vs_peers_deepspeed.py"), *common]
    if system.startswith("engine-"):
        return [py, str(HERE / "vs_peers_engine.py"), *common]
    if system == "fsdp2":
        return [
            py,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=1",
            str(HERE / "vs_peers_fsdp.py"),
            *common,
        ]
    raise ValueError(f"unknown system {system!r}")


def worker_env(threads: int, exact_rss: bool) -> dict[str, str]:
    env = dict(os.environ)
    if exact_rss:
        # glibc otherwise keeps freed blocks below a threshold that grows up to 32 MiB, so
        # the peak RSS of a run depends on thread timing by a few hundred MiB. Mapping every
        # block over 64 KiB on its own makes RSS follow live bytes (and steps slower).
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    # DeepSpeed's JIT build must find this interpreter's ninja first: another one on PATH
    # makes it rebuild cpu_adam on every run.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["DS_ACCELERATOR"] = "cpu"
    env["OMP_NUM_THREADS"] = str(threads)  # torchrun would otherwise pick its own
    return env


def run_system(system: str, precision: str, args: argparse.Namespace, logs: Path, tag: str) -> dict:
    """Run one system to completion; its result dict, or one with an "error"."""
    out = logs / f"{system}-{precision}{tag}.json"
    log = logs / f"{system}-{precision}{tag}.log"
    profile = args.profile / f"{system}-{precision}{tag}.prof" if args.profile else None
    cmd = command(system, precision, args, out, profile)
    t0 = time.perf_counter()
    with log.open("w") as f:
        try:
            rc = subprocess.run(
                cmd,
                stdout=f,
                stderr=subprocess.STDOUT,
                cwd=HERE.parent,
                env=worker_env(args.threads, args.exact_rss),
                timeout=args.timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = None
    wall = time.perf_counter() - t0
    if rc != 0 or not out.exists():
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        why = "timed out" if rc is None else f"exit status {rc}"
        return {
            "system": system,
            "precision": precision,
            "error": f"{why}; log {log}: " + " | ".join(tail),
        }
    result = json.loads(out.read_text())
    result["wall_seconds"] = wall
    return result


def merge(runs: list[dict]) -> dict:
    """Repeats of one system: the lowest per-run median, the worst peak and loss kept.

    Other processes on the machine only ever slow a run down, so of several runs the one
    with the lowest median step time is the least disturbed.
    """
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return runs[0]
    first = ok[0]
    medians = [statistics.median(r["seconds"][r["warmup"] :]) for r in ok]
    return {
        **first,
        "timed": first["seconds"][first["warmup"] :],
        "median": min(medians),
        "medians": medians,
        "peak_rss": max(r["peak_rss"] for r in ok),
        "peak_rss_runs": [r["peak_rss"] for r in ok],
        "repeats": len(ok),
        "all_losses": [r["losses"] for r in ok],
    }


def max_rel_diff(losses: list[list[float]], reference: list[float]) -> float:
    return max(abs(x - r) / abs(r) for run in losses for x, r in zip(run, reference, strict=True))


def ratio(result: dict, other: dict, key: str) -> str:
    """result[key] / other[key] as text; "-" where `other` has no such measurement."""
    return f"{result[key] / other[key]:.2f}" if other.get(key) else "-"


def table(
    results: dict[tuple[str, str], dict], precisions: list[str], systems: list[str]
) -> list[str]:
    """The markdown table, one row per system and precision."""
    lines = [
        "| system | precision | timed steps per run | median s/step | x (a) | x (b) | peak RSS MiB "
        "| x (a) | x (b) | max rel. loss diff vs (a) |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for precision in precisions:
        plain = results.get(("plain", precision), {})
        ds = results.get(("deepspeed", precision), {})
        for system in systems:
            r = results[(system, precision)]
            name = LABELS[system]
            if "error" in r:
                lines.append(f"| {name} | {precision} | {r['error'].split(';')[0]} | | | | | | | |")
                continue
            if "median" in plain:
                loss = f"{max_rel_diff(r['all_losses'], plain['all_losses'][0]):.1e}"
            else:
                loss = "-"
            lines.append(
                f"| {name} | {precision} | {len(r['timed'])} | {r['median']:.3f} | "
                f"{ratio(r, plain, 'median')} | "
                f"{ratio(r, ds, 'median')} | {r['peak_rss'] / 2**20:.0f} | "
                f"{ratio(r, plain, 'peak_rss')} | {ratio(r, ds, 'peak_rss')} | {loss} |"
            )
    return lines


def verdicts(results: dict[tuple[str, str], dict], precisions: list[str]) -> list[str]:
    """The targets for policy cpu, in words, where the rows to judge them exist."""
    lines = []
    for precision in precisions:
        cpu = results.get(("engine-cpu", precision), {})
        ds = results.get(("deepspeed", precision), {})
        fsdp = results.get(("fsdp2", precision), {})
        if "median" not in cpu:
            continue
        if "median" in ds:
            ratio = cpu["median"] / ds["median"]
            met = "met" if ratio <= TARGET_VS_DEEPSPEED else "MISSED"
            lines.append(
                f"- {precision}: engine cpu step time {ratio:.3f}x DeepSpeed "
                f"(target <= {TARGET_VS_DEEPSPEED}): {met}"
            )
        if "median" in fsdp:
            diff = (cpu["peak_rss"] - fsdp["peak_rss"]) / 2**20
            met = "met" if diff <= 0 else "MISSED"
            lines.append(
                f"- {precision}: engine cpu peak RSS {cpu['peak_rss'] / 2**20:.0f} "
                f"MiB vs FSDP2 {fsdp['peak_rss'] / 2**20:.0f} MiB ({diff:+.0f} MiB, "
                f"target <= FSDP2): {met}"
            )
    return lines


def engine_details(results: dict[tuple[str, str], dict]) -> list[str]:
    lines = []
    for (system, precision), r in results.items():
        extra = r.get("extra", {})
        if not system.startswith("engine-") or "device_budget" not in extra:
            continue
        b = extra["breakdown_seconds"]
        lines.append(
            f"- {system} {precision}: budget {extra['device_budget'] / 2**20:.0f} MiB = "
            f"working set {extra['working_set'] / 2**20:.0f} MiB + half the parameters "
            f"{extra['half_parameters'] / 2**20:.0f} MiB; median forward {b['forward']:.3f} s, "
            f"backward {b['backward']:.3f} s, optimizer {b['optimizer']:.3f} s, copies "
            f"{b['transfer']:.3f} s; moved per step "
            f"{(extra['bytes_h2d'] + extra['bytes_d2h']) / 2**20:.0f} MiB"
        )
    return lines


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--quick",
        action="store_true",
        help="fp32 only (unless --precisions says otherwise), 4 steps of which 2 warm-up: "
        "checks that every system runs",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=None,
        help="fp32 steps per run, warm-up included (default 12, quick 4)",
    )
    ap.add_argument(
        "--bf16-steps",
        type=int,
        default=None,
        help="bf16 steps per run, warm-up included (default 4, quick 3): a CPU without "
        "native bf16 matrix units runs bf16 matmuls tens of times slower than fp32",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=2,
        help="untimed first steps, at least 2 (default 2)",
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every system this many times in turn and pool the timed steps",
    )
    ap.add_argument(
        "--precisions",
        nargs="+",
        choices=("fp32", "bf16"),
        default=None,
        help="default: fp32 and bf16; fp32 alone with --quick",
    )
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="torch threads in every system (default: all cores)",
    )
    ap.add_argument(
        "--timeout",
        type=float,
        default=1800.0,
        help="seconds one system may run (DeepSpeed's first build is slow)",
    )
    ap.add_argument(
        "--exact-rss",
        action="store_true",
        help="make peak RSS follow live bytes (glibc maps each block over 64 KiB on its "
        "own); step times are then not representative",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write every result here")
    ap.add_argument(
        "--logs",
        type=Path,
        default=None,
        help="folder for worker logs and results (default: a temporary one)",
    )
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="folder for a cProfile of each system's timed steps",
    )
    args = ap.parse_args(argv)
    args.steps = args.steps or (4 if args.quick else 12)
    args.bf16_steps = args.bf16_steps or (3 if args.quick else 4)
    args.precisions = args.precisions or (["fp32"] if args.quick else ["fp32", "bf16"])
    # The engine applies the measured policy and budget after its first (traced) step and
    # places chunks at the second: neither may be timed.
    problems = [
        (args.warmup < 2, f"--warmup must be at least 2, not {args.warmup}"),
        (args.steps <= args.warmup, f"--steps ({args.steps}) must exceed --warmup ({args.warmup})"),
        (
            "bf16" in args.precisions and args.bf16_steps <= args.warmup,
            f"--bf16-steps ({args.bf16_steps}) must exceed --warmup ({args.warmup})",
        ),
        (args.repeats < 1, f"--repeats must be at least 1, not {args.repeats}"),
        (args.threads < 1, f"--threads must be at least 1, not {args.threads}"),
    ]
    for bad, message in problems:
        if bad:
            print(f"vs_peers: {message}", file=sys.stderr)
            sys.exit(2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    systems = [s for s in SYSTEMS if s in args.systems]
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    logs = args.logs or Path(tempfile.mkdtemp(prefix="vs_peers-"))
    logs.mkdir(parents=True, exist_ok=True)
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()

    runs: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        tag = f"-{repeat + 1}" if args.repeats > 1 else ""
        for precision in args.precisions:
            for system in systems:
                if system == "deepspeed" and not has_deepspeed:
                    result = {
                        "system": system,
                        "precision": precision,
                        "missing": True,
                        "error": "not installed (pip install -e '.[bench]')",
                    }
                else:
                    print(f"running {system} {precision}{tag} ...", file=sys.stderr, flush=True)
                    result = run_system(system, precision, args, logs, tag)
                    if "error" in result:
                        print(f"  {system} {precision} failed: {result['error']}", file=sys.stderr)
                runs.setdefault((system, precision), []).append(result)
    results = {key: merge(value) for key, value in runs.items()}
    load_after = os.getloadavg()

    threads = {r.get("threads") for r in results.values() if "threads" in r}
    loads = [r["load_average"] for r in results.values() if "load_average" in r]
    print(
        f"{args.model}, batch {args.batch_size} x {args.seq_len}, {args.warmup} warm-up steps "
        f"per run, then the median of the timed steps; {args.repeats} run(s) per row, the "
        f"lowest median shown; torch "
        f"threads {', '.join(map(str, sorted(threads))) or '-'}; torch {version('torch')}, "
        f"deepspeed {version('deepspeed')}; 1-minute load average {load_before[0]:.2f} "
        f"before, {load_after[0]:.2f} after"
        + (f", {min(loads):.2f}..{max(loads):.2f} as the systems ended" if loads else "")
    )
    print()
    print("\n".join(table(results, args.precisions, systems)))
    notes = verdicts(results, args.precisions) + engine_details(results)
    if args.repeats > 1:
        notes += [
            f"- per run: {system} {precision}: median s/step "
            + "/".join(f"{m:.3f}" for m in r["medians"])
            + ", peak RSS MiB "
            + "/".join(str(b >> 20) for b in r["peak_rss_runs"])
            for (system, precision), r in results.items()
            if "medians" in r
        ]
    if notes:
        print()
        print("\n".join(notes))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "args": {k: str(v) for k, v in vars(args).items()},
                    "load_average": [load_before, load_after],
                    "results": [{"key": list(k), **v} for k, v in results.items()],
                },
                indent=1,
            )
        )
    failed = [r for r in results.values() if "error" in r and not r.get("missing")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
