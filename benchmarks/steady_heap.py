"""What keeping glibc's heap steady costs and gives: step time, page faults and peak
resident memory, with engine.devices.host_memory.steady_heap and without, and with the
simulated device's kept chunk buffers (engine.devices.buffer_pool) and without, in fresh
processes taken in turn (the heap setting lasts a process's life), round after round so
that the machine's load hits every mode alike.

    python benchmarks/steady_heap.py [--model opt-125m] [--policy auto] [--budget 975MiB]
                                     [--rounds 2] [--steps 8] [--seq-len 128]
                                     [--modes glibc steady steady+pool]

Modes: `glibc` (glibc's own heap, no kept buffers: a run before the pool, where memory was
not tight), `steady` (the heap steady, no kept buffers: a tight run then), `steady+pool`
(every run now), `glibc+pool`, `kept+pool` (glibc maps nothing and keeps what is freed:
engine.devices.host_memory.kept_heap). --model is a zoo name or a model folder (its config is built
as a model of its own, so weights need not be there). Batch 2, fp32, simulated device, 1
thread. Process CPU seconds (not wall time: a neighbour's load does not stretch them),
medians of the steps after the first two; the plan's host peak above for comparison.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

# One process: steps of one model with the heap steady or not, then its figures as JSON.
RUN = """
import json, resource, statistics, sys, time
import torch
torch.set_num_threads(1)
from engine import Engine, EngineConfig
from engine.devices.host_memory import kept_heap, steady_heap
from engine.models.zoo import KNOWN_MODELS, build_model
name, mode, policy, budget, steps, seq = sys.argv[1:7]
if mode.startswith("steady"):
    assert steady_heap()
if mode.startswith("kept"):
    assert kept_heap()
if name in KNOWN_MODELS:
    model = build_model(name, seed=0)
else:
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name))
engine = Engine(model, EngineConfig(policy=policy, device_budget=budget, precision="fp32",
                                    simulate=True))
if not mode.endswith("+pool"):
    engine.device.pool.bytes.keeps = False  # every buffer new, as before the pool
g = torch.Generator().manual_seed(0)
cpu, faults = [], []
for _ in range(int(steps)):
    ids = torch.randint(0, model.config.vocab_size, (2, int(seq)), generator=g)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    c0 = time.process_time()
    engine.step({"input_ids": ids, "labels": ids})
    cpu.append(time.process_time() - c0)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM"))
print(json.dumps({"cpu": statistics.median(cpu[2:]), "faults": statistics.median(faults[2:]),
                  "peak": peak}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--policy", default="auto")
    ap.add_argument("--budget", default="975MiB")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=["glibc", "steady", "steady+pool"],
                    choices=["glibc", "steady", "steady+pool", "glibc+pool", "kept+pool"])
    args = ap.parse_args()

    from engine import format_size
    from engine.planning.planner import plan

    forecast = plan(args.model, device_mem=args.budget, host_mem="1TiB", precision="fp32",
                    simulated=True, batch_size=2, seq_len=args.seq_len)
    print(f"{args.model}, {args.policy} at {args.budget}, batch 2 x {args.seq_len}, fp32, "
          f"1 thread; plan's host peak {format_size(forecast.policies[args.policy].host_peak)}")
    print(f"{'mode':<13}{'CPU s/step':>12}{'faults/step':>13}{'peak RSS':>12}")
    for _ in range(args.rounds):
        for mode in args.modes:
            done = subprocess.run(
                [sys.executable, "-c", RUN, args.model, mode, args.policy, args.budget,
                 str(args.steps), str(args.seq_len)],
                capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.splitlines()[-1])
            print(f"{mode:<13}{row['cpu']:>12.3f}{row['faults']:>13.0f}"
                  f"{format_size(row['peak']):>12}", flush=True)


if __name__ == "__main__":
    main()
