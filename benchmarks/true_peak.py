"""True device peak of a steady step, measured by the allocator, against the budget and
against what the engine and the planner report.

    python benchmarks/true_peak.py [--threads 1]

For each model, policy (cpu, auto) and budget factor (1.05, 2): a throwaway engine with an
ample budget takes one step to learn the minimum working set (Engine.min_working_set());
a fresh engine gets `factor` times that as its budget, takes its traced warm-up step, and
then a steady step is measured.

How the true peak is measured, independently of the engine's own accounting: on the
simulated device "device" tensors are CPU tensors, so every byte the step puts on the
device goes through the CPU allocator, whose allocations and frees the profiler reports as
`[memory]` events (ProfilerActivity.CPU, profile_memory=True). Their running total is what
the allocator holds beyond what it held when the profiler started. Over the window of the
step's forward and backward the device peak is

    model bytes on the device when forward starts (resident chunks)
    + the running total's highest rise over its value at the window's start.

Host memory is left out by construction, not by subtraction (and the device's kept chunk
buffers, by keeping none in the measured step): the chunks' host buffers (payload, master,
moments) and the copy staging buffers are allocated when the engine is built and never
freed during a step, the buffers fp32 gradients land in on the host, which a step makes as
they land, are made before the measured one (`measured_step`), and forward and backward
allocate nothing else on the host (the batch is already where the device is; gradients
are copied into existing host buffers). Everything that does rise during the window is the device's:
the engine's own device copies of chunks and its gradient buffers, activations, autograd's
gradients and backward temporaries, kernel workspaces. The optimizer runs after the window
(on the host for these policies, margin 0), so its temporaries are not counted.

The planner's forecast (engine.planning.planner.plan with simulated=True) for the same
config, batch, policy and budget is printed beside it.
"""

from __future__ import annotations

import argparse
import copy
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile, record_function
from transformers import LlamaConfig, LlamaForCausalLM, OPTConfig, OPTForCausalLM

from engine import Engine, EngineConfig, StepStats
from engine.placement import rules
from engine.planning.planner import plan

MiB = 2**20
AMPLE = 64 * 2**30
WINDOW = "forward_backward"  # the profiler annotation around the measured window

OPT = OPTConfig(vocab_size=8192, hidden_size=256, num_hidden_layers=4, ffn_dim=1024,
                num_attention_heads=4, word_embed_proj_dim=256, max_position_embeddings=128)
# Tied embedding and head, a 32k vocabulary: the logits and their gradients dominate.
LLAMA = LlamaConfig(vocab_size=32000, hidden_size=128, intermediate_size=344,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=128, tie_word_embeddings=True,
                    bos_token_id=0, eos_token_id=0)
CONFIGS = {"opt": (OPT, OPTForCausalLM), "llama-tied-32k": (LLAMA, LlamaForCausalLM)}
BATCH_SIZE, SEQ_LEN = 4, 64
POLICIES = ("cpu", "auto")
FACTORS = (1.05, 2.0)


@dataclass
class Measurement:
    model: str
    policy: str
    factor: float
    budget: int
    true_peak: int  # the allocator's, see the module docstring
    reported: int  # StepStats.memory.device_peak of the measured step
    planned: int  # the planner's device peak for the same run

    @property
    def over_budget(self) -> float:
        return self.true_peak / self.budget

    @property
    def reported_share(self) -> float:
        return self.reported / self.true_peak

    @property
    def planned_share(self) -> float:
        return self.planned / self.true_peak


def measured_step(engine: Engine, batch: dict[str, torch.Tensor]) -> tuple[StepStats, int]:
    """One step of `engine`; returns its stats and its true device peak (module docstring)."""
    runner = engine.runner
    run = runner.forward_backward
    resident: list[int] = []

    def annotated(*args, **kwargs):
        resident.append(engine.manager.device_bytes)
        with record_function(WINDOW):
            return run(*args, **kwargs)

    runner.forward_backward = annotated
    # Chunk buffers the device keeps (engine.devices.buffer_pool) are free device memory
    # that the allocator still holds, and a copy that takes one allocates nothing: the
    # measured step keeps none, so every byte it puts on the device goes through the
    # allocator. Where bytes are placed does not depend on it.
    pool = engine.device.pool
    pool.trim()
    pool.bytes.keeps = False
    # The host buffers gradients land in are host memory, not the device's, though the
    # profiler counts them with it: they are made before the step (the update frees them
    # as usual), so that what the window allocates is the device's alone.
    m = engine.manager
    for chunk in engine.chunks:
        if not (chunk.frozen or chunk.resident) and rules.grads_land_per_step(
                aliased=chunk.aliased, sharded=chunk.sharded, disk_tier=m.spill is not None):
            m.grad_home(chunk)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            stats = engine.step(batch)
    finally:
        del runner.forward_backward  # the bound method again
        pool.bytes.keeps = True
    events = prof.profiler.kineto_results.events()
    (window,) = [e for e in events if e.name() == WINDOW]
    memory = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    total = start = highest = 0
    inside = False
    for when, delta in memory:
        if not inside and when >= window.start_ns():
            inside, start = True, total
            highest = total
        if inside and when > window.end_ns():
            break
        total += delta
        if inside:
            highest = max(highest, total)
    return stats, resident[0] + highest - start


def batches(vocab: int, n: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (BATCH_SIZE, SEQ_LEN), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def min_working_set(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """What Engine.min_working_set() says after one step with an ample budget."""
    with Engine(copy.deepcopy(model), EngineConfig(policy="cpu", device_budget=AMPLE,
                                                   precision="fp32", simulate=True)) as probe:
        probe.step(batch)
        return probe.min_working_set()


def planned_peak(config, policy: str, budget: int) -> int:
    with tempfile.TemporaryDirectory() as folder:
        config.save_pretrained(folder)
        forecast = plan(folder, device_mem=budget, host_mem=AMPLE, precision="fp32",
                        batch_size=BATCH_SIZE, seq_len=SEQ_LEN, simulated=True)
    return forecast.policies[policy].device_peak


def measure(name: str, config, build: Callable[[object], torch.nn.Module], policy: str,
            factor: float) -> Measurement:
    torch.manual_seed(0)
    model = build(config)
    warm, steady = batches(config.vocab_size, 2)
    budget = int(factor * min_working_set(model, warm))
    with Engine(model, EngineConfig(policy=policy, device_budget=budget, precision="fp32",
                                    simulate=True)) as engine:
        engine.step(warm)  # the traced step
        stats, true_peak = measured_step(engine, steady)
    return Measurement(name, policy, factor, budget, true_peak, stats.memory.device_peak,
                       planned_peak(config, policy, budget))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: torch's default); 1 is steadier on a shared machine")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"batch {BATCH_SIZE} x {SEQ_LEN}, fp32, simulated device; sizes in MiB")
    print(f"{'model':<16}{'policy':<8}{'x min':>6}{'budget':>9}{'true':>9}{'reported':>10}"
          f"{'planned':>9}{'true/budget':>13}{'reported/true':>15}{'planned/true':>14}")
    for name, (config, build) in CONFIGS.items():
        for policy in POLICIES:
            for factor in FACTORS:
                m = measure(name, config, build, policy, factor)
                print(f"{m.model:<16}{m.policy:<8}{m.factor:>6.2f}{m.budget / MiB:>9.1f}"
                      f"{m.true_peak / MiB:>9.1f}{m.reported / MiB:>10.1f}"
                      f"{m.planned / MiB:>9.1f}{m.over_budget:>13.2f}"
                      f"{m.reported_share:>15.2f}{m.planned_share:>14.2f}", flush=True)


if __name__ == "__main__":
    main()
