"""vs_peers system (c): the offload engine (`from engine import Engine, EngineConfig`).

The device budget is the step's working set plus half the parameters in the compute dtype:
under `auto` about half the chunks stay on the device, under `cpu` none do. The working set
(largest chunks in use at once, their gradient buffers and the activations between two uses)
is known only after a traced step, so the first step runs under `cpu` with an ample budget,
and the measured policy and budget take effect from the second step on, through the same
live-change calls the TUI uses. Both are warm-up steps, never timed.

On a machine without CUDA the engine runs on its simulated device: "device" tensors are
separate CPU tensors and every move is a real copy, so the numbers show what the placement
machinery costs, not PCIe. Run by benchmarks/vs_peers.py; by hand:

    python benchmarks/vs_peers_engine.py --system engine-cpu --out /tmp/cpu.json
"""

from __future__ import annotations

import statistics

import vs_peers_harness as harness

from engine import Engine, EngineConfig, StepStats

AMPLE = 1 << 40  # the first, traced step: any placement fits
DTYPE_BYTES = {"fp32": 4, "bf16": 2}


def main() -> None:
    args = harness.parse_args("engine-cpu")
    policy = args.system.removeprefix("engine-")
    model = harness.build(args)
    vocab = model.config.vocab_size
    eng = Engine(
        model,
        EngineConfig(
            policy="cpu",
            device_budget=AMPLE,
            precision=args.precision,
            lr=harness.LR,
            betas=harness.BETAS,
            eps=harness.EPS,
            weight_decay=harness.WEIGHT_DECAY,
            seed=args.seed,
        ),
    )
    del model
    stats: list[StepStats] = []
    budget = {}

    def step(batch: harness.Batch) -> float:
        s = eng.step(batch)
        if not stats:
            working_set = eng.trace.working_set
            half = eng.num_parameters * DTYPE_BYTES[args.precision] // 2
            budget.update(
                working_set=working_set, half_parameters=half, device_budget=working_set + half
            )
            eng.set_budget(working_set + half)
            eng.set_policy(policy)
        stats.append(s)
        return s.loss

    result = harness.measure(args, step, harness.batches(args, vocab))
    timed = stats[args.warmup :]
    breakdown = {
        part: statistics.median(getattr(s, part) for s in timed)
        for part in ("forward", "backward", "optimizer", "transfer")
    }
    last = timed[-1]
    harness.report(
        args,
        result,
        extra={
            **budget,
            "policy": last.policy,
            "breakdown_seconds": breakdown,
            "bytes_h2d": last.bytes_h2d,
            "bytes_d2h": last.bytes_d2h,
            "device_model": last.memory.device_model,
            "device_peak": last.memory.device_peak,
            "host_model": last.memory.host_model,
            "chunks": len(eng.chunks),
        },
    )


if __name__ == "__main__":
    main()
