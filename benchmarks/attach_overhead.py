"""What a headless run pays for its attach socket while nobody is attached.

    python benchmarks/attach_overhead.py [--model tiny] [--steps 40] [--rounds 2]

Each round runs the same headless run twice, in turn: as shipped (tuitrain.served: the
socket, its accepting thread, every event handed to the listener, the run's record
rewritten now and then) and with no socket at all. Measured per run: the median step time
the worker reported (the first step left out), the headless process's own CPU seconds (its
threads included, the worker process not), the worker process's CPU seconds (less moved by
the machine's other load than its step times) and the wall time from start to summary. The
last line gives each as a ratio, socket / none; the machine's load average is printed with
it, since on a shared machine it moves the figures more than the socket does.

Then, apart from any machine noise, what the runner's loop spends per event on the socket
while nobody is attached: `poll` of the served worker against `poll` of the worker alone,
over a worker that has one step ready at every poll (`--polls` of them), in microseconds
and as a fraction of the median step.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

from tuitrain import headless
from tuitrain.events import Step
from tuitrain.headless import run_headless
from tuitrain.served import serve
from tuitrain.settings import Settings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' scripted events
from tests.tuitrain.fakeworker import fake_stats  # noqa: E402


def one_run(settings: Settings, folder: Path, *, socket: bool) -> dict[str, float]:
    """Run `settings` headless; the step median, this process's CPU and the wall time."""
    metrics = folder / f"run-{time.monotonic_ns()}.jsonl"
    settings = settings.model_copy(
        update={"logging": settings.logging.model_copy(update={"metrics": str(metrics)})})
    usage = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    with mock.patch.object(headless, "serve", headless.serve if socket else
                           (lambda *a, **k: None)):
        code = run_headless(settings, out=io.StringIO(), err=io.StringIO(),
                            log_path=str(folder / "worker.log"))
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_SELF)
    after_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    if code != 0:
        raise SystemExit(f"the run failed (exit {code}); see {folder / 'worker.log'}")
    steps = [json.loads(line) for line in metrics.read_text().splitlines()
             if line.startswith('{"step"')]
    return {
        "step_seconds": statistics.median(s["seconds"] for s in steps[1:]),
        "cpu_seconds": (after.ru_utime + after.ru_stime) - (usage.ru_utime + usage.ru_stime),
        "worker_cpu_seconds": (after_children.ru_utime + after_children.ru_stime)
        - (children.ru_utime + children.ru_stime),
        "wall_seconds": wall,
    }


class _OneStep:
    """A worker with a step ready at every poll."""

    def __init__(self, step: Step) -> None:
        self.step = step

    def poll(self) -> list[Step]:
        return [self.step]


def per_event_seconds(polls: int, folder: Path) -> tuple[float, float]:
    """Seconds per poll of a bare worker and of the same worker served, nobody attached."""
    step = Step(fake_stats(1))
    bare = _OneStep(step)
    served = serve(bare, Settings(model="tiny"), err=io.StringIO())
    assert served is not None
    try:
        timings = {}
        for name, worker in (("bare", bare), ("served", served), ("bare2", bare)):
            started = time.perf_counter()
            for _ in range(polls):
                worker.poll()
            timings[name] = (time.perf_counter() - started) / polls
    finally:
        served.close()
    return min(timings["bare"], timings["bare2"]), timings["served"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--polls", type=int, default=20_000)
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
        for key in ("step_seconds", "cpu_seconds", "worker_cpu_seconds", "wall_seconds")
    }
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TUITRAIN_RUNTIME_DIR"] = str(Path(tmp) / "runtime")
        bare, served = per_event_seconds(args.polls, Path(tmp))
    step = statistics.median(r["step_seconds"] for r in results[True] + results[False])
    print(f"per event, nobody attached: {(served - bare) * 1e6:.1f} us on the socket "
          f"({bare * 1e6:.2f} us bare, {served * 1e6:.2f} us served), "
          f"{(served - bare) / step:.2e} of a median step ({step:.3f} s)")
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{args.model}, {args.steps} steps x {args.rounds} rounds, socket / none: "
          + ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
          + f" (load average {load}, {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
