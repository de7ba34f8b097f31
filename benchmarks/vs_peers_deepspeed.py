"""vs_peers system (b): DeepSpeed ZeRO-3 with parameters and optimizer offloaded to the CPU.

DeepSpeed runs on its CPU accelerator (DS_ACCELERATOR=cpu) as a one-rank gloo group, with
DeepSpeedCPUAdam in AdamW mode. Two settings make it train the same as torch.optim.AdamW:
`gradient_clipping` 0 (DeepSpeed clips at 1.0 by default) and weight decay 0.01 given
explicitly (DeepSpeedCPUAdam defaults to 0). bf16 is DeepSpeed's own bf16 mode: bf16
parameters, fp32 master weights in the optimizer.

The first run JIT-compiles DeepSpeed's cpu_adam and shared-memory ops with g++ and ninja
(about a minute, then cached under ~/.cache/torch_extensions); that happens while wrapping,
before the first step. Run it with its venv activated: another ninja first on PATH makes
every run rebuild. Run by benchmarks/vs_peers.py; by hand:

    DS_ACCELERATOR=cpu python benchmarks/vs_peers_deepspeed.py --out /tmp/ds.json
"""

from __future__ import annotations

import os
import socket

# Read by DeepSpeed at import; a one-rank group needs no launcher, only its environment.
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import vs_peers_harness as harness  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_config(args) -> dict:
    offload = {"device": "cpu", "pin_memory": False}
    return {
        "train_micro_batch_size_per_gpu": args.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "steps_per_print": 1 << 30,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": harness.LR,
                "betas": list(harness.BETAS),
                "eps": harness.EPS,
                "weight_decay": harness.WEIGHT_DECAY,
            },
        },
        "bf16": {"enabled": args.precision == "bf16"},
        "zero_optimization": {"stage": 3, "offload_param": offload, "offload_optimizer": offload},
    }


def main() -> None:
    args = harness.parse_args("deepspeed")
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(free_port())),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(key, value)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    model = harness.build(args)
    vocab = model.config.vocab_size
    config = ds_config(args)
    ds, optimizer, _, _ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )

    def step(batch: harness.Batch) -> float:
        loss = ds(**batch).loss
        ds.backward(loss)
        ds.step()
        return float(loss.detach())

    result = harness.measure(args, step, harness.batches(args, vocab))
    harness.report(
        args,
        result,
        extra={
            "deepspeed": deepspeed.__version__,
            "optimizer": type(optimizer).__name__,
            "inner_optimizer": type(getattr(optimizer, "optimizer", optimizer)).__name__,
        },
    )


if __name__ == "__main__":
    main()
