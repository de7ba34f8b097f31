"""vs_peers system (a): plain PyTorch, the whole model and AdamW(fused=True) in one process.

bf16 runs the fp32 model under CPU autocast, the usual way to train in bf16 without an
offload system. Run by benchmarks/vs_peers.py; by hand:

    python benchmarks/vs_peers_plain.py --out /tmp/plain.json [--precision bf16]
"""

from __future__ import annotations

import contextlib

import torch
import vs_peers_harness as harness


def main() -> None:
    args = harness.parse_args("plain")
    model = harness.build(args)
    opt = harness.fused_adamw(model.parameters())
    bf16 = args.precision == "bf16"

    def step(batch: harness.Batch) -> float:
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    result = harness.measure(args, step, harness.batches(args, model.config.vocab_size))
    harness.report(args, result)


if __name__ == "__main__":
    main()
