"""How close the time model's forecast is to the measured step time, row by row.

For every setting of the grid, the plan's forecast (engine.planning.time_model, with this
machine's calibration) beside the median of the measured steps (warm-up excluded), and
their ratio; then every pair of rows whose measured times differ by more than 15%: does
the forecast order them the same way? Measured is the wall time of a step, which only a
quiet machine gives (the load average is printed on every row); the stepping thread's and
the process's CPU seconds beside it, and the seconds a step waited for the disk tier (DISK).

    python benchmarks/time_model.py                    # the whole grid (long)
    python benchmarks/time_model.py --quick            # a few rows, few steps
    python benchmarks/time_model.py --only opt-125m x1 # the rows whose label has both

The grid: opt-125m and a Llama-shaped model of similar size (`--models`; the Llama one is
written once to a temporary folder with random weights), policies cuda/auto/cpu, margins
0 and 0.5, two device budgets, activation checkpointing off and on, accumulation 1 and 4,
the disk tier off and on (a host budget that holds half the chunks). fp32 (`--precision
bf16`: the same grid in bf16), batch 2 x 128 per micro-batch. The calibration is this
machine's cached one (measured first if absent). A row with the disk tier is forecast
just before each of its visits, with a probe of the disk then (as `tuitrain plan` and a
tune forecast a plan that uses the disk: engine.planning.disk_speed); its forecast is
the mean of its visits'.

Each row is measured in VISITS visits (`--visits`), each through the whole grid in turn, a
process of its own per row and visit: its measured time is the median of the settled steps
of all its visits, beside each visit's own median. One process's steps sit in one spell of
a shared machine: the same rows in two grids measured 8-11% apart (st. dev. of the log
ratio, four pairs of grids of 68-136 rows, 2026-12-05), where the forecasts' own errors
hardly agreed between those grids (correlations of -0.2 to 0.4).

Each row runs in a process of its own, as a user's run does, with the heap a run keeps
(every tensor of a MiB or more mapped afresh: engine.devices.host_memory). Run one after
another in one process, rows with the same plan measured up to 38% apart (opt-125m, auto
margin 0.5 at 4 GiB, with and without an idle disk tier: 0.862 and 1.190 s, where each in
a process of its own took 0.940 and 0.961 s), and the process's first row took 1.5 s where
its own process gave 0.98 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import Engine, EngineConfig
from engine.config import format_size
from engine.devices.host_memory import steady_heap
from engine.models.zoo import build_model
from engine.planning.disk_speed import disk_now
from engine.planning.planner import plan
from engine.planning.time_model import step_times
from tuitrain.plan_forecast import machine_calibration

SEQ = 128
BATCH = 2  # sequences per micro-batch (--batch)
PRECISION = "fp32"  # --precision
TOLERANCE = 0.15
# Steps left out of the median: the traced one and the counted ones after it, until the
# chunks settle (engine.step.counting: two counted steps with one fingerprint).
WARM_UP = 3
# Visits to each row, and steps in each (warm-up included): four settled steps a row.
VISITS = 2
STEPS = WARM_UP + 2


@dataclass
class Row:
    model: str
    policy: str
    margin: float
    budget: int
    checkpointing: bool
    accum: int
    disk: bool
    predicted: float = 0.0
    forecasts: list = dataclasses.field(default_factory=list)  # each visit's, in turn
    duplex: list = dataclasses.field(default_factory=list)  # the disk both ways, each visit's
    # Wall seconds per step: what the user waits. Only a quiet machine measures it; the
    # clocks beside it tell a loaded one apart.
    measured: float = 0.0
    # The stepping thread's CPU seconds: the engine's Python and OpenMP's thread 0 in every
    # kernel, so close to the wall time on a quiet machine, except where the step waits on
    # the disk tier's reads and writes, which it does not count.
    thread: float = 0.0
    cpu: float = 0.0  # the process's CPU seconds per step, every thread's
    # Seconds a step waited for the disk tier (StepStats.disk_wait): its share of the wall
    # time, measured rather than inferred from the wall and thread clocks.
    disk_wait: float = 0.0
    note: str = ""
    # Each visit's settled steps: (wall, thread, cpu, disk wait) seconds, one list each.
    visits: list = dataclasses.field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.predicted / self.measured if self.measured else float("nan")

    def label(self) -> str:
        return (f"{Path(self.model).name} {self.policy} m{self.margin:g} "
                f"{format_size(self.budget)}"
                f"{' ckpt' if self.checkpointing else ''} x{self.accum}"
                f"{' disk' if self.disk else ''}")

    def visit(self, steps: list[list[float]]) -> float:
        """Keep one visit's settled steps; the medians over every visit so far, and this
        visit's own wall median."""
        self.visits.append(steps)
        pooled = [sum((v[i] for v in self.visits), []) for i in range(4)]
        self.measured, self.thread, self.cpu, self.disk_wait = (statistics.median(x)
                                                                for x in pooled)
        return statistics.median(steps[0])


def llama_folder(root: Path) -> str:
    """A Llama-shaped model of opt-125m's size (hidden 768, 12 layers), random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = root / "llama-125m"
    if not (folder / "config.json").exists():
        config = LlamaConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                             num_attention_heads=12, num_key_value_heads=4, vocab_size=32000,
                             max_position_embeddings=2048, tie_word_embeddings=True)
        LlamaForCausalLM(config).save_pretrained(folder)
    return str(folder)


def measure_apart(row: Row, steps: int, disk_dir: str) -> list[list[float]]:
    """`measure` in a new process (this script's `--measure`)."""
    fields = json.dumps({k: v for k, v in dataclasses.asdict(row).items() if k != "visits"})
    done = subprocess.run([sys.executable, __file__, "--measure", fields, "--steps", str(steps),
                           "--batch", str(BATCH), "--precision", PRECISION,
                           "--disk-dir", disk_dir],
                          capture_output=True, text=True, check=False)
    if done.returncode:
        last = done.stderr.strip().splitlines()[-1:] or [f"exit status {done.returncode}"]
        raise RuntimeError(f"{row.label()}: {last[0]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(row: Row, steps: int, disk_dir: str) -> list[list[float]]:
    """(wall, stepping thread's CPU, process CPU, disk wait) seconds of each steady step,
    the first WARM_UP steps excluded. With the heap a run keeps (tuitrain.training_run)."""
    steady_heap()
    model = build_model(row.model, seed=0)
    if row.checkpointing:
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (BATCH * row.accum, SEQ), generator=gen)
    host_budget = None
    if row.disk:
        host_budget = _half_the_chunks(row)
    config = EngineConfig(policy=row.policy, margin_ratio=row.margin, device_budget=row.budget,
                          precision=PRECISION, grad_accum=row.accum, host_budget=host_budget,
                          disk_dir=disk_dir if row.disk else None, seed=0)
    thread, wall, cpu, waits = [], [], [], []
    with Engine(model, config) as eng:
        for _ in range(steps):
            t0, w0, c0 = time.thread_time(), time.perf_counter(), time.process_time()
            stats = eng.step({"input_ids": ids, "labels": ids})
            waits.append(stats.disk_wait)
            thread.append(time.thread_time() - t0)
            wall.append(time.perf_counter() - w0)
            cpu.append(time.process_time() - c0)
    return [x[WARM_UP:] for x in (wall, thread, cpu, waits)]


def _half_the_chunks(row: Row) -> int:
    p = plan(row.model, device_mem=row.budget, host_mem="64GiB", precision=PRECISION,
             batch_size=BATCH, seq_len=SEQ, checkpointing=row.checkpointing)
    return p.model_bytes // 2


def predict(row: Row, cal, disk_dir: str, *, now: bool = True) -> float:
    """The row's forecast; with the disk tier, with the disk as probed now (`now`), or at
    the calibration's rates."""
    host_budget = _half_the_chunks(row) if row.disk else None
    p = plan(row.model, device_mem=row.budget, host_mem="64GiB", precision=PRECISION,
             batch_size=BATCH, seq_len=SEQ, checkpointing=row.checkpointing,
             margin_ratio=row.margin, host_budget=host_budget, disk_dir=disk_dir,
             simulated=not torch.cuda.is_available(), grad_accum=row.accum)
    if not p.policies[row.policy].fits:
        row.note = p.policies[row.policy].reason
    if p.uses_disk and now:
        cal = disk_now(cal, p.disk_dir, max_age=0.0)
        row.duplex.append(cal.disk_duplex)
    return step_times(p, cal, grad_accum=row.accum)[row.policy].total


def grid(models: list[str], quick: bool) -> list[Row]:
    if quick:
        return [Row(models[0], "cuda", 0.0, 4 * 2**30, False, 1, False),
                Row(models[0], "cpu", 0.0, 1 * 2**30, False, 1, False),
                Row(models[0], "cpu", 0.0, 1 * 2**30, True, 1, False)]
    rows = []
    for model, policy, margin, budget, ckpt, accum, disk in itertools.product(
            models, ("cuda", "auto", "cpu"), (0.0, 0.5), (1 * 2**30, 4 * 2**30),
            (False, True), (1, 4), (False, True)):
        if policy == "cuda" and (margin or disk):
            continue  # cuda keeps everything on the device: no margin, nothing on disk
        rows.append(Row(model, policy, margin, budget, ckpt, accum, disk))
    return rows


def main() -> None:
    global BATCH, PRECISION
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["opt-125m", "llama"])
    parser.add_argument("--steps", type=int, default=STEPS,
                        help=f"steps a visit, the first {WARM_UP} left out")
    parser.add_argument("--visits", type=int, default=VISITS,
                        help="visits to each row, each in a process of its own")
    parser.add_argument("--quick", action="store_true", help="three rows of the first model")
    parser.add_argument("--only", nargs="+", default=[], metavar="TEXT",
                        help="the rows whose label contains every TEXT (e.g. cpu ckpt)")
    parser.add_argument("--rows", nargs="+", default=[], metavar="LABEL",
                        help="these rows alone, by their label as the table prints it")
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences per micro-batch")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default=PRECISION,
                        help="the grid's compute precision (the acceptance grid is fp32)")
    parser.add_argument("--measure", metavar="ROW", help=argparse.SUPPRESS)  # measure_apart's
    parser.add_argument("--disk-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    BATCH, PRECISION = args.batch, args.precision
    if args.steps <= WARM_UP:
        parser.error(f"--steps must be more than the {WARM_UP} warm-up steps")
    if args.visits < 1:
        parser.error("--visits must be at least 1")
    if args.measure:
        print(json.dumps(measure(Row(**json.loads(args.measure)), args.steps, args.disk_dir)))
        return
    with tempfile.TemporaryDirectory() as root:
        models = [llama_folder(Path(root)) if m == "llama" else m for m in args.models]
        # The model alone: what tunes taught this machine (the learned correction) is left
        # out, so that the table says how good the terms are.
        # Measured, if it must be, in the heap the rows keep (measure), as tuitrain does.
        cal = dataclasses.replace(machine_calibration(say=print), correction=1.0)
        print(f"calibration: {cal.machine} ({cal.measured_at}); load "
              f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        rows = [r for r in grid(models, args.quick)
                if all(text in r.label() for text in args.only)
                and (not args.rows or r.label() in args.rows)]
        header = (f"{'ROW':<44} {'PREDICTED':>9} {'MEASURED':>9} {'RATIO':>6} {'THREAD':>8} "
                  f"{'CPU':>8} {'DISK':>6} {'LOAD':>5}")
        for row in rows:
            row.predicted = predict(row, cal, root, now=False)  # the disk's: at each visit
        for visit in range(1, args.visits + 1):
            print(f"visit {visit} of {args.visits}: "
                  + ("the medians of every visit so far, and this one's (VISIT)" if visit > 1
                     else "this visit's medians"))
            print(header + (f" {'VISIT':>6}" if visit > 1 else ""))
            for row in rows:
                if row.note:
                    if visit == 1:
                        print(f"{row.label():<44} {row.predicted:9.3f} {'-':>9} {'-':>6}  "
                              f"{row.note}")
                    continue
                if row.disk:
                    row.forecasts.append(predict(row, cal, root))
                    row.predicted = statistics.fmean(row.forecasts)
                own = row.visit(measure_apart(row, args.steps, root))
                print(f"{row.label():<44} {row.predicted:9.3f} {row.measured:9.3f} "
                      f"{row.ratio:6.2f} {row.thread:8.3f} {row.cpu:8.3f} {row.disk_wait:6.3f} "
                      f"{os.getloadavg()[0]:5.1f}" + (f" {own:6.3f}" if visit > 1 else "")
                      + (f"  disk {row.duplex[-1] / 2**30:.2f} GiB/s both ways, forecast "
                         f"{row.forecasts[-1]:.3f}" if row.disk else ""), flush=True)
        done = [r for r in rows if r.measured]
        within = sum(abs(r.ratio - 1) <= TOLERANCE for r in done)
        pairs = [(a, b) for a, b in itertools.combinations(done, 2)
                 if max(a.measured, b.measured) > (1 + TOLERANCE) * min(a.measured, b.measured)]
        ordered = sum((a.measured < b.measured) == (a.predicted < b.predicted) for a, b in pairs)
        print(f"within {TOLERANCE:.0%}: {within}/{len(done)} rows; ordered as measured: "
              f"{ordered}/{len(pairs)} pairs; load now {os.getloadavg()[0]:.1f}")
        if args.visits > 1:
            alone = [sum(abs((r.forecasts[v] if r.forecasts else r.predicted)
                             / statistics.median(r.visits[v][0]) - 1) <= TOLERANCE
                         for r in done) for v in range(args.visits)]
            print(f"each visit alone, within {TOLERANCE:.0%}: "
                  + ", ".join(f"{n}/{len(done)}" for n in alone))
        for a, b in pairs:
            if (a.measured < b.measured) != (a.predicted < b.predicted):
                print(f"  out of order: {a.label()} / {b.label()}")


if __name__ == "__main__":
    main()
