"""The disk tier against the disk it runs on, and against the same run with enough host memory.

opt-125m shape (built from its config, no download), fp32, batch 1 x 128, policy cpu, with a
host budget that sends every chunk's optimizer state (the AdamW moments, 8 B/param) to the
scratch folder and keeps the payloads on the host: about 1 GB read and 1 GB written per step.

    python benchmarks/disk_tier.py [--steps 8] [--cycles 3] [--disk-dir DIR] [--threads 1]

In one run:
  (a) the raw sequential write and read bandwidth of the scratch folder's disk, for the bytes
      the tier moves per step, in I/Os of the tier's own piece size (O_DIRECT where the
      filesystem takes it, as the tier does);
  (b) the tier's achieved read and write throughput during steps: bytes over the time its
      I/O threads spent in reads and writes;
  (c) step time with the tier against the same engine with no host budget: per cycle, steps
      without the tier, the same steps with it back to back (its update overlaps the next
      forward, so its time per step runs to the end of the last update), then (a); medians
      over cycles, so that machine noise hits all three alike.
Targets: (b) >= 70% of (a); (c) tier <= 1.2 x max(step without it, bytes moved at raw speed).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import time
from pathlib import Path

import torch

from engine import Engine, EngineConfig, format_size
from engine.devices.disk import (
    ALIGN,
    ScratchFolder,
    default_disk_dir,
    direct_io_supported,
)
from engine.devices.disk.files import sequential_bandwidth
from engine.models.zoo import build_model
from engine.placement import rules


def state_on_disk_budget(eng: Engine) -> int:
    """The host budget that puts every chunk's optimizer state on disk and no payload:
    the payload side of every chunk plus the state I/O buffers (rules.disk_placement)."""
    costs = [rules.disk_cost(c.numel, c.itemsize, ALIGN) for c in eng.chunks]
    buffers = rules.STATE_BUFFERS * (max(c.state_piece for c in costs) + ALIGN)
    return sum(c.host_payload for c in costs) + buffers


def gbps(rate: float) -> str:
    return f"{rate / 1e9:.2f} GB/s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--steps", type=int, default=8, help="steps per cycle, of each engine")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--device-mem", default="4GiB", help="the device budget of both engines")
    ap.add_argument("--disk-dir", default=None, help="scratch folder (default: the engine's)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 is steadier on a shared machine (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    disk_dir = Path(args.disk_dir) if args.disk_dir else default_disk_dir()

    base = build_model(args.model, seed=0)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(args.steps + args.warmup):
        ids = torch.randint(0, base.config.vocab_size, (args.batch_size, args.seq_len),
                            generator=g)
        batches.append({"input_ids": ids, "labels": ids})

    config = {"policy": "cpu", "device_budget": args.device_mem, "precision": "fp32"}
    plain = Engine(copy.deepcopy(base), EngineConfig(**config))
    budget = state_on_disk_budget(plain)
    tier_engine = Engine(copy.deepcopy(base), EngineConfig(
        **config, host_budget=budget, disk_dir=disk_dir))
    del base
    levels = [c.disk_level for c in tier_engine.chunks]
    assert levels == [1] * len(levels), f"not every state on disk, no payload: {levels}"
    tier = tier_engine.manager.spill.tier
    print(f"{args.model}, fp32, batch {args.batch_size} x {args.seq_len}, policy cpu, "
          f"{torch.get_num_threads()} thread(s); load average {os.getloadavg()[0]:.1f}")
    print(f"host: without the tier {format_size(plain.manager.host_bytes)}; with it, budget "
          f"{format_size(budget)} = chunks {format_size(tier_engine.manager.host_bytes)} + "
          f"I/O buffers {format_size(tier_engine.manager.io_buffer_bytes)}; on disk "
          f"{format_size(tier_engine.manager.disk_bytes)} in {tier.path.parent} "
          f"({'O_DIRECT' if tier.direct else 'buffered'})")

    piece = tier_engine.manager.spill.placement.state_buffer
    folder = ScratchFolder(disk_dir)  # for the raw measurement, beside the tier's
    direct = direct_io_supported(folder.path)
    for batch in batches[:args.warmup]:
        plain.step(batch)
        tier_engine.step(batch)
    tier_engine.manager.flight.wait()
    measured = batches[args.warmup:]
    cycles = []
    try:
        for _ in range(args.cycles):
            cycles.append(cycle(plain, tier_engine, measured, folder.path, piece, direct))
    finally:
        folder.remove()
        tier_engine.close()
        plain.close()

    def median(key: str) -> float:
        return statistics.median(c[key] for c in cycles)

    read_bytes, written = median("read"), median("written")
    raw_write, raw_read = median("raw_write"), median("raw_read")
    t_plain, t_tier, t_io = median("plain"), median("tier"), median("raw_io")
    # Raw, the disk doing one thing at a time: both directions one after the other. The
    # tier reads and writes at once, and a disk that shares its bandwidth between the two
    # gives each less; "combined" compares (bytes both ways) / (time either of the tier's
    # threads was in I/O) with the raw one-after-the-other rate.
    raw_both = median("raw_both")
    got_read, got_write, got_both = median("got_read"), median("got_write"), median("got_both")
    bound = max(t_plain, t_io)

    print(f"\n(a) raw, {format_size(piece)} I/Os, {'O_DIRECT' if direct else 'buffered'}: "
          f"write {gbps(raw_write)}, read {gbps(raw_read)}, both one after the other "
          f"{gbps(raw_both)} ({format_size(written)} written, {format_size(read_bytes)} read "
          f"per step)")
    print(f"(b) tier during steps (reads and writes at once): read {gbps(got_read)} = "
          f"{got_read / raw_read:.0%} of raw, write {gbps(got_write)} = "
          f"{got_write / raw_write:.0%} of raw; combined {gbps(got_both)} = "
          f"{got_both / raw_both:.0%} of raw (target >= 70%)")
    print(f"(c) step: without the tier {t_plain:.3f} s, with it {t_tier:.3f} s "
          f"({t_tier / t_plain:.2f}x); bytes moved at raw speed {t_io:.3f} s; "
          f"tier / max(without, raw I/O) = {t_tier / bound:.2f} (target <= 1.2)")
    print(f"    per step with the tier: the step waited for the disk {median('wait'):.3f} s "
          f"(the update's own waits overlap the next forward); forward + backward "
          f"{median('tier_compute'):.3f} s (without the tier {median('compute'):.3f} s); "
          f"the last update's tail after the last step {median('tail'):.3f} s (in the "
          f"time per step, spread over {args.steps} steps)")
    print("    cycles (without s/step, with s/step, raw write, raw read): " + ", ".join(
        f"({c['plain']:.2f}, {c['tier']:.2f}, {gbps(c['raw_write'])}, {gbps(c['raw_read'])})"
        for c in cycles))


def cycle(plain: Engine, tier_engine: Engine, batches: list[dict], folder: Path, piece: int,
          direct: bool) -> dict[str, float]:
    """One cycle: the steps without the tier, the same steps with it back to back (its
    update overlaps the next step's forward, so the time per step is the wall time of all
    of them, up to the end of the last update), then the raw disk for the same bytes."""
    n = len(batches)
    t0 = time.perf_counter()
    compute = 0.0  # forward + backward, copies to and from the device included
    for batch in batches:
        stats = plain.step(batch)
        compute += stats.forward + stats.backward + stats.transfer
    t_plain = (time.perf_counter() - t0) / n
    tier = tier_engine.manager.spill.tier
    before = (tier.bytes_read, tier.bytes_written, tier.read_seconds, tier.write_seconds,
              tier.busy_seconds)
    t0 = time.perf_counter()
    wait = tier_compute = 0.0
    for batch in batches:
        stats = tier_engine.step(batch)
        wait += stats.disk_wait
        tier_compute += stats.forward + stats.backward + stats.transfer
    t_last = time.perf_counter()
    tier_engine.manager.flight.wait()
    tail = time.perf_counter() - t_last
    t_tier = (time.perf_counter() - t0) / n
    read, written, read_s, write_s, busy = (
        b - a for a, b in zip(before, (tier.bytes_read, tier.bytes_written, tier.read_seconds,
                                       tier.write_seconds, tier.busy_seconds), strict=True))
    raw_write, raw_read = sequential_bandwidth(folder, write_bytes=written // n,
                                               read_bytes=read // n, piece=piece, direct=direct)
    raw_io = read / n / raw_read + written / n / raw_write
    return {"plain": t_plain, "tier": t_tier, "wait": wait / n, "tail": tail,
            "compute": compute / n, "tier_compute": tier_compute / n, "read": read / n,
            "written": written / n, "raw_write": raw_write, "raw_read": raw_read,
            "raw_io": raw_io, "raw_both": (read + written) / n / raw_io,
            "got_read": read / read_s, "got_write": written / write_s,
            "got_both": (read + written) / busy}


if __name__ == "__main__":
    main()
