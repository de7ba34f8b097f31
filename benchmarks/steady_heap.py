"""What keeping glibc's heap steady costs and gives: step time, page faults and peak
resident memory, with engine.devices.host_memory.steady_heap and without, in fresh
processes taken in turn (the setting lasts a process's life).

    python benchmarks/steady_heap.py [--model opt-125m] [--policy auto] [--budget 975MiB]
                                     [--pairs 2] [--steps 8] [--seq-len 128]

--model is a zoo name or a model folder (its config is built as a model of its own, so
weights need not be there). Batch 2, fp32, simulated device, 1 thread. Medians of the steps
after the first two; the plan's host peak beside each for comparison.
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
from engine.devices.host_memory import steady_heap
from engine.models.zoo import KNOWN_MODELS, build_model
name, steady, policy, budget, steps, seq = sys.argv[1:7]
if steady == "1":
    assert steady_heap()
if name in KNOWN_MODELS:
    model = build_model(name, seed=0)
else:
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(name))
engine = Engine(model, EngineConfig(policy=policy, device_budget=budget, precision="fp32",
                                    simulate=True))
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
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()

    from engine import format_size
    from engine.planning.planner import plan

    forecast = plan(args.model, device_mem=args.budget, host_mem="1TiB", precision="fp32",
                    simulated=True, batch_size=2, seq_len=args.seq_len)
    print(f"{args.model}, {args.policy} at {args.budget}, batch 2 x {args.seq_len}, fp32, "
          f"1 thread; plan's host peak {format_size(forecast.policies[args.policy].host_peak)}")
    print(f"{'heap':<8}{'CPU s/step':>12}{'faults/step':>13}{'peak RSS':>12}")
    for _ in range(args.pairs):
        for steady in ("0", "1"):
            done = subprocess.run(
                [sys.executable, "-c", RUN, args.model, steady, args.policy, args.budget,
                 str(args.steps), str(args.seq_len)],
                capture_output=True, text=True, check=True)
            row = json.loads(done.stdout.splitlines()[-1])
            print(f"{'steady' if steady == '1' else 'glibc':<8}{row['cpu']:>12.3f}"
                  f"{row['faults']:>13.0f}{format_size(row['peak']):>12}", flush=True)


if __name__ == "__main__":
    main()
