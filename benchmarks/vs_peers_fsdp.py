"""vs_peers system (d): PyTorch FSDP2 (`fully_shard`) with parameters offloaded to the CPU.

One rank on a gloo CPU mesh, launched by torchrun. Each decoder layer is its own FSDP
unit and the root holds the rest (embeddings, final norm, the tied head), the usual
wrapping. CPUOffloadPolicy keeps the sharded parameters, gradients and optimizer state on
the host; pinning needs CUDA, hence pin_memory=False. AdamW(fused=True) steps the sharded
parameters. bf16 is FSDP2's mixed precision: bf16 compute copies, fp32 gradients reduced
into the fp32 parameters. Run by benchmarks/vs_peers.py; by hand:

    torchrun --standalone --nproc_per_node=1 benchmarks/vs_peers_fsdp.py --out /tmp/fsdp.json
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import vs_peers_harness as harness
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard


def main() -> None:
    args = harness.parse_args("fsdp2")
    dist.init_process_group("gloo")
    try:
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        model = harness.build(args)
        vocab = model.config.vocab_size
        options = {"mesh": mesh, "offload_policy": CPUOffloadPolicy(pin_memory=False)}
        if args.precision == "bf16":
            options["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32
            )
        for layer in model.model.decoder.layers:
            fully_shard(layer, **options)
        fully_shard(model, **options)
        opt = harness.fused_adamw(model.parameters())

        def step(batch: harness.Batch) -> float:
            loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return float(loss.detach())

        result = harness.measure(args, step, harness.batches(args, vocab))
        harness.report(args, result, extra={"world_size": dist.get_world_size()})
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
