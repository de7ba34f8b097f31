"""The tuner against the whole grid it searches: does its pick come close to the best, for
far fewer steps, and does it pick alike twice in a row?

For each device budget: one run measures every setting of the tuner's space that the plan
lets fit (each applied to the running worker, the step after the change skipped, the median
of `--steps` steps), then two runs tune (tuitrain.tune.search on the run's steps). Per
budget: the grid's best, the tuner's picks and, for the lower of them by the grid's own
measure, its tokens/s as a share of the best's (target at least 95%), the longer search's
steps as a share of the grid's (at most 30%), and the two picks' times as their searches
measured them (within 3% of each other).

A median of a few steps moves by 10% from one trial of a setting to the next on a shared
machine, and the fastest of some fifty such medians is the luckiest of them. So a third
run measures again, head to head, the grid's `--top` fastest settings and the picks: in
`--rounds` rounds, each setting in turn (the order reversed every other round, so a drift
of the machine's speed does not favour one), the step after each change skipped, `--steps`
steps each; every setting's median over all its rounds. The targets are judged on those
medians: the pick's share of the fastest of them, the two picks apart. The single-pass
figures are printed beside them.

    python benchmarks/tune.py                          # opt-125m fp32, 8 x 128, 1 and 2 GiB
    python benchmarks/tune.py --model tiny --batch 2 --seq-len 32 --budgets 64MiB --steps 3
    python benchmarks/tune.py --budgets 2GiB --top 3 --rounds 3

The space is what a running run can change: policy and margin at the run's budget (see
tuitrain/tune_setup.py). With no GPU, the simulated device.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

from tuitrain.presets import merge
from tuitrain.settings import Settings, Size
from tuitrain.tune import Candidate, search
from tuitrain.tune_setup import run_budget, start_fitting, tune_forecaster, tune_space
from tuitrain.tune_worker import WorkerTrainer, client_events, wait_for_start
from tuitrain.worker import ProcessWorker

ENOUGH_SHARE = 0.95
MOST_STEPS = 0.30
SAME_PICK = 0.03


@dataclass(frozen=True)
class Row:
    budget: str
    best: Candidate  # the grid's, by its single pass
    seconds: float
    picks: list[tuple[Candidate, float, int]]  # setting, as its search measured it, steps
    share: float  # the lower pick's, by the grid's single pass
    steps: float  # the longer search's, of the grid's
    apart: float  # the picks, as their searches measured them
    medians: dict[Candidate, float]  # head to head


def run_settings(args: argparse.Namespace, budget: str, steps: int) -> Settings:
    return merge(Settings(model=args.model), {
        "engine.precision": "fp32", "engine.device_budget": budget,
        "training.batch_size": args.batch, "training.seq_len": args.seq_len,
        "training.steps": steps})


def on_worker(settings: Settings, work) -> object:
    """`work(trainer)` on a fresh run of `settings`."""
    worker = ProcessWorker(settings=settings)
    worker.start()
    try:
        if not wait_for_start(worker, lambda event: None):
            sys.exit(f"the run did not start: {getattr(worker.result, 'reason', '')}")
        engine = worker.started.settings.get("engine", {})
        trainer = WorkerTrainer(
            worker.send, client_events(worker), batch_size=settings.training.batch_size,
            grad_accum=settings.training.grad_accum,
            checkpointing=settings.training.activation_checkpointing,
            policy=engine.get("policy", "auto"), margin_ratio=engine.get("margin_ratio", 0.0),
            device_budget=run_budget(settings, simulated=True))
        return work(trainer)
    finally:
        worker.stop()


def grid(trainer: WorkerTrainer, space: list[Candidate], steps: int) -> dict[Candidate, float]:
    measured = {}
    for candidate in space:
        trainer.apply(candidate)
        trainer.step()  # the step after the change
        measured[candidate] = statistics.median(trainer.step().seconds for _ in range(steps))
        print(f"  grid: {candidate.describe()}: {measured[candidate]:.3f} s/step", flush=True)
    return measured


def head_to_head(trainer: WorkerTrainer, settings: list[Candidate], rounds: int,
                 steps: int) -> dict[Candidate, list[float]]:
    """Every setting's steps over `rounds` rounds of each in turn (reversed every other)."""
    times: dict[Candidate, list[float]] = {c: [] for c in settings}
    for r in range(rounds):
        for candidate in settings if r % 2 == 0 else settings[::-1]:
            trainer.apply(candidate)
            trainer.step()  # the step after the change
            times[candidate] += [trainer.step().seconds for _ in range(steps)]
            print(f"  again, round {r + 1}: {candidate.describe()}: "
                  f"{statistics.median(times[candidate][-steps:]):.3f} s/step", flush=True)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="opt-125m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--budgets", nargs="+", default=["1GiB", "2GiB"])
    parser.add_argument("--steps", type=int, default=3, help="measured steps per setting")
    parser.add_argument("--top", type=int, default=3,
                        help="the grid's fastest settings measured again beside the picks")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of measuring again")
    args = parser.parse_args()
    rows = []
    for budget in args.budgets:
        Size(budget)  # a bad size fails here, not in the worker
        base = run_settings(args, budget, 1)
        forecast, _ = tune_forecaster(base, simulated=True, say=print)
        space = [c for c in tune_space(base, device_budget=run_budget(base, True))
                 if forecast(c).fits]
        grid_steps = len(space) * (args.steps + 1)
        # Where the run's own split does not fit, it starts as `tuitrain tune` starts it.
        start, _ = start_fitting(base, space, forecast)
        # The run gets twice that: steps that run while a change is on its way are not counted.
        run = merge(start, {"training.steps": 2 * grid_steps + 4})
        print(f"{budget}: {len(space)} settings fit; measuring the grid", flush=True)
        measured = on_worker(run, lambda t, s=space: grid(t, s, args.steps))
        best = min(measured, key=measured.get)
        picks = []
        for _ in range(2):
            result = on_worker(run, lambda t, s=space, f=forecast: search(
                s, f, t, trial_steps=args.steps))
            assert result.best is not None, result.log
            picks.append((result.best.candidate, result.best.measured, result.steps))
            print(f"  tune: {result.best.candidate.describe()}: {result.best.measured:.3f} "
                  f"s/step measured, {result.steps} steps ({result.stopped_by})", flush=True)
            for line in result.log:
                print(f"    {line}", flush=True)
        # Each pick by the grid's own measure of it, and the steps of the longer search.
        share = min(measured[best] / measured[pick] for pick, _, _ in picks)
        steps = max(ran for _, _, ran in picks) / grid_steps
        contenders = list(dict.fromkeys([*sorted(measured, key=measured.get)[:args.top],
                                         *(pick for pick, _, _ in picks)]))
        print(f"{budget}: measuring {len(contenders)} settings again, head to head", flush=True)
        again = on_worker(
            merge(start, {"training.steps": 2 * args.rounds * len(contenders)
                          * (args.steps + 1) + 4}),
            lambda t, c=contenders: head_to_head(t, c, args.rounds, args.steps))
        medians = {c: statistics.median(times) for c, times in again.items()}
        for c in contenders:
            print(f"  again: {c.describe()}: {medians[c]:.3f} s/step over {len(again[c])} "
                  f"steps (grid {measured[c]:.3f})", flush=True)
        rows.append(Row(budget, best, measured[best], picks, share, steps,
                        abs(picks[0][1] / picks[1][1] - 1), medians))
    print("\n| budget | grid best | s/step | tuner picks (2 runs) | share of best tok/s "
          "(the lower pick) | steps vs grid (the longer search) | picks apart | fastest "
          "head to head | s/step | share, head to head | picks apart, head to head |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    ok = True
    for row in rows:
        (first, _, _), (second, _, _) = row.picks
        fastest = min(row.medians, key=row.medians.get)
        share = min(row.medians[fastest] / row.medians[pick] for pick in (first, second))
        apart = abs(row.medians[first] / row.medians[second] - 1)
        print(f"| {row.budget} | {row.best.describe()} | {row.seconds:.3f} | "
              f"{first.describe()} / {second.describe()} | {row.share:.0%} | "
              f"{row.steps:.0%} | {row.apart:.1%} | {fastest.describe()} | "
              f"{row.medians[fastest]:.3f} | {share:.0%} | {apart:.1%} |")
        ok &= share >= ENOUGH_SHARE and row.steps <= MOST_STEPS and apart <= SAME_PICK
    print("targets met (head to head)" if ok else "targets NOT met (head to head)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
