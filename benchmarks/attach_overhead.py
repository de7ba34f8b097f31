"""What a headless run pays for its attach socket while nobody is attached.

    python benchmarks/attach_overhead.py [--model tiny] [--steps 40] [--rounds 2]

Each round runs the same headless run twice, in turn: as shipped (tuitrain.served: the
socket, its accepting thread, every event handed to the listener, the run's record
rewritten now and then) and with no socket at all. Measured per run: the median step time
the worker reported (the first step left out), the headless process's own CPU seconds (its
threads included, the worker process not) and the wall time from start to summary. The
last line gives each as a ratio, socket / none; the machine's load average is printed with
it, since on a shared machine it moves the figures more than the socket does.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

from tuitrain import headless
from tuitrain.headless import run_headless
from tuitrain.settings import Settings


def one_run(settings: Settings, folder: Path, *, socket: bool) -> dict[str, float]:
    """Run `settings` headless; the step median, this process's CPU and the wall time."""
    metrics = folder / f"run-{time.monotonic_ns()}.jsonl"
    settings = settings.model_copy(
        update={"logging": settings.logging.model_copy(update={"metrics": str(metrics)})})
    usage = resource.getrusage(resource.RUSAGE_SELF)
    started = time.perf_counter()
    with mock.patch.object(headless, "serve", headless.serve if socket else
                           (lambda *a, **k: None)):
        code = run_headless(settings, out=io.StringIO(), err=io.StringIO(),
                            log_path=str(folder / "worker.log"))
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    if code != 0:
        raise SystemExit(f"the run failed (exit {code}); see {folder / 'worker.log'}")
    steps = [json.loads(line) for line in metrics.read_text().splitlines()
             if line.startswith('{"step"')]
    return {
        "step_seconds": statistics.median(s["seconds"] for s in steps[1:]),
        "cpu_seconds": (after.ru_utime + after.ru_stime) - (usage.ru_utime + usage.ru_stime),
        "wall_seconds": wall,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args(argv)
    settings = Settings(
        model=args.model,
        engine={"policy": "auto", "precision": "fp32"},
        training={"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len},
    )
    results: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ.setdefault("TUITRAIN_RUNTIME_DIR", str(folder / "runtime"))
        for round_ in range(args.rounds):
            # Which goes first alternates, so a machine warming up favours neither.
            for socket in (True, False) if round_ % 2 == 0 else (False, True):
                result = one_run(settings, folder, socket=socket)
                results[socket].append(result)
                print(f"round {round_ + 1} {'socket' if socket else 'none  '}  "
                      + "  ".join(f"{k} {v:.4f}" for k, v in result.items()), flush=True)
    ratios = {
        key: statistics.median(r[key] for r in results[True])
        / statistics.median(r[key] for r in results[False])
        for key in ("step_seconds", "cpu_seconds", "wall_seconds")
    }
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{args.model}, {args.steps} steps x {args.rounds} rounds, socket / none: "
          + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
          + f" (load average {load}, {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
