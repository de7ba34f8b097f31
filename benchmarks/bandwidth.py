"""Host <-> device bandwidth through the engine's staging ring, against the fastest plain
copy PyTorch offers: a pinned host tensor copied with `non_blocking=True`.

    python benchmarks/bandwidth.py [--gib 1] [--repeats 5] [--dry-run]

The engine keeps host tensors pageable and streams every copy through a small ring of
pinned buffers (engine.devices.transfers): the host's memcpy into one buffer overlaps the
DMA of another. This measures what that costs against a copy from memory that is already
pinned, the same bytes each way, each timed from the host with a device synchronize at the
end, best of `--repeats` after one warm-up. One line (GB/s, 1e9 bytes a second), then the
raw timings. Needs CUDA; `--dry-run` runs the same code on the CPU's simulated streams
with 16 MiB, to check that it starts.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from engine.devices.streams import CudaStreams, HostStreams
from engine.devices.transfers import Staging, Transfers


def best_seconds(copy, sync, repeats: int) -> list[float]:
    """Each timed run of `copy` (one warm-up first), `sync` before the clock stops."""
    copy()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        copy()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dry-run", action="store_true",
                    help="16 MiB on the CPU's simulated streams: checks that it starts")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("bandwidth: no CUDA device", file=sys.stderr)
        return 1
    nbytes = 16 * 2**20 if args.dry_run else int(args.gib * 2**30)
    numel = nbytes // 2  # bf16, as the engine's payloads
    if cuda:
        streams, device = CudaStreams(torch.cuda.current_device()), "cuda"
        sync = torch.cuda.synchronize
    else:
        streams, device = HostStreams(), "cpu"
        def sync() -> None:
            pass
    transfers = Transfers(streams, Staging())
    pageable = torch.randn(numel, dtype=torch.float32).to(torch.bfloat16)
    pinned = torch.empty(numel, dtype=torch.bfloat16, pin_memory=cuda)
    pinned.copy_(pageable)
    on_device = torch.empty(numel, dtype=torch.bfloat16, device=device)
    back = torch.empty_like(pageable)

    times = {
        "h2d staging": best_seconds(lambda: transfers.to_device(on_device, pageable), sync,
                                    args.repeats),
        "h2d pinned": best_seconds(lambda: on_device.copy_(pinned, non_blocking=True), sync,
                                   args.repeats),
        "d2h staging": best_seconds(
            lambda: transfers.to_host(back, on_device, host_reads=True), sync, args.repeats),
        "d2h pinned": best_seconds(lambda: pinned.copy_(on_device, non_blocking=True), sync,
                                   args.repeats),
    }
    if not torch.equal(back, pageable):
        print("bandwidth: the staged round trip changed the bytes", file=sys.stderr)
        return 1
    rate = {name: nbytes / min(t) / 1e9 for name, t in times.items()}
    print(json.dumps({"bytes": nbytes, "device": device, "seconds": times,
                      "pinned_staging_bytes": transfers.pinned_bytes()}))
    transfers.close()
    print(f"{nbytes / 2**30:.2f} GiB {'' if cuda else '(dry run, CPU) '}h2d "
          f"{rate['h2d staging']:.1f} GB/s staged vs {rate['h2d pinned']:.1f} pinned "
          f"({rate['h2d staging'] / rate['h2d pinned']:.2f}x); d2h "
          f"{rate['d2h staging']:.1f} vs {rate['d2h pinned']:.1f} "
          f"({rate['d2h staging'] / rate['d2h pinned']:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
