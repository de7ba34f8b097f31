"""Step-time overhead of the offload engine against plain PyTorch, in one process.

opt-125m shape (built from its config, no download), batch 2 x 128, fp32. Each round runs
one step of every system in turn (each round starting one system further on), so machine
noise hits them alike; medians after warm-up.

    python benchmarks/engine_overhead.py [--rounds 6] [--model opt-125m | small-opt]

`small-opt` is a 6-layer OPT (hidden 512, 8 heads, FFN 2048, vocab 8192), where the ops are
small and the engine's own per-op cost shows most.

Systems: plain PyTorch with AdamW(fused=True); the engine with policy cuda (ample budget),
auto (a budget that holds the working set plus half the parameters), and cpu. On a machine
with CUDA everything runs on the GPU (the engine on a CudaDevice capped at those budgets);
elsewhere on the simulated device.

Every system's step is timed from the host with a device synchronize before and after it,
so that no system's queued GPU work lands in the next one's time. The last line sums it up.

`--uncounted` adds, for auto and cpu, a second engine whose non-model counter (the dispatch
mode that sees every op's allocations, engine.step.non_model) is switched off after its
traced step: the same placement at the same budget, so the difference between the two rows
is what counting every live byte costs. Only a measurement: an uncounted engine reports no
non-model bytes and makes room for none beyond its trace.

Paired ratios: in each round every system steps right after the others, so a round's
ratio to plain's step of the same round leaves out what the machine's speed does over
minutes (here it moves by a fifth within a minute, quiet or not). Each row prints the
median of its rounds' wall ratios and a 90% interval for that median (resampling the
rounds; seeded, so a rerun of the same numbers gives the same interval): a target is met
when the interval's top is under it, missed when its bottom is over it, and otherwise this
run cannot tell.

Fresh pages: every row shows the page faults of a step. Plain PyTorch takes its gradients
and its large activations as fresh memory at every step (glibc maps each tensor over its
mmap threshold and unmaps it when freed); the engine keeps its gradient buffers and chunk
copies. What a fresh page costs is the machine's: on a virtual machine whose freed pages go
back to the host (a balloon's free page reporting), touching one again waits for the host,
and that wait moves with what the host does (measured here: 0.35 s to 8 s for the same
800 MiB). `--kept-heap` takes that out of every system alike: glibc maps nothing and keeps
what is freed (engine.devices.host_memory.kept_heap, set before anything is built), so after
the warm-up no system touches a fresh page and the ratios are the compute and the engine's
own work.

Copies: on the simulated device a copy between host and device is a memcpy. A fetch ahead
of use runs on the device's copy thread beside the step, as a GPU's copy engine runs it
beside the kernels; every other copy (a fetch the step waits for, a gradient's way home)
runs on the stepping thread. The last column estimates what the engine's own work costs
without those: the paired ratio of each round's step less the seconds the stepping thread
spent in copies (`copies_in_line`, the wall clock around each copy, and around each
fetch ahead's submission, over one more step after the rounds), over plain's step. An
estimate: what the copy thread's memcpy takes from the step's compute (the memory bus, the
shared cache) stays in it. The bytes per second those copies ran at is printed beside a
probe's (`copy_bandwidth`: the same chunk-sized copy, alone, after the rounds): inside a
step they ran at half the probe's speed (benchmarks/README.md, "The step's parts by the
wall clock"), which an estimate from the probe's speed took as twice as fast. That is the
speed of memory no cache holds, which a second probe measures (`cold_copy_bandwidth`: 640
MiB of chunk-sized copies); the line after the table prints what the bytes copied in line
would add to plain's step at it alone, the least a policy's ratio can be on this machine.
"""

from __future__ import annotations

import argparse
import copy
import random
import resource
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from engine import Engine, EngineConfig, format_size
from engine.devices.host_memory import kept_heap
from engine.devices.streams import spare_core
from engine.models.training import prepare_for_training
from engine.models.zoo import build_model
from engine.step.non_model import NonModelCounter


class _Uncounted(NonModelCounter):
    """A non-model counter that never enters dispatch: `with counter:` does nothing."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


SMALL_OPT = "small-opt"


def build(name: str) -> torch.nn.Module:
    """The zoo's model `name`, or the small OPT, initialised from seed 0."""
    if name != SMALL_OPT:
        return build_model(name, seed=0)
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    config = OPTConfig(vocab_size=8192, hidden_size=512, num_hidden_layers=6, ffn_dim=2048,
                       num_attention_heads=8, max_position_embeddings=512,
                       word_embed_proj_dim=512)
    return OPTForCausalLM(config)


def policy_budgets(base: torch.nn.Module, batch: dict[str, torch.Tensor], *,
                   simulate: bool | None = None) -> tuple[dict[str, int], int]:
    """(the device budget of each policy, the working set): cuda ample (everything
    resident), auto the working set plus half the parameters' fp32 bytes, cpu twice the
    working set. The working set needs one traced step of `batch`: a throwaway engine on a
    copy of `base` measures it."""
    with Engine(copy.deepcopy(base), EngineConfig(policy="cpu", device_budget="64GiB",
                                                  simulate=simulate)) as probe:
        probe.step(batch)
        working_set = probe.trace.working_set
    payload = sum(p.numel() * 4 for p in base.parameters())
    return ({"cuda": 64 * 2**30, "auto": working_set + payload // 2, "cpu": working_set * 2},
            working_set)


def clocked(method: Callable, spent: Callable[[float], None]) -> Callable:
    """`method`, passing the wall seconds of each call to `spent`."""
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent(time.perf_counter() - t0)
    return wrapper


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(step) -> tuple[float, float, int]:
    """(wall, process CPU seconds, minor page faults) of `step()`, the device idle before it
    starts and after it ends. On a shared machine the CPU seconds are the steadier of the
    two: other jobs stretch the wall time, not this process's own work (with one thread)."""
    synchronize()
    t0, c0 = time.perf_counter(), time.process_time()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    synchronize()
    return (time.perf_counter() - t0, time.process_time() - c0,
            resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)


def uncounted_step(eng: Engine, batch) -> None:
    """One step of `eng`; after its first (traced) step its counter no longer counts."""
    eng.step(batch)
    eng.runner.counter.__class__ = _Uncounted


def paired(values: list[float], base: list[float], *, resamples: int = 2000,
           seed: int = 0) -> tuple[float, float, float]:
    """The median of the rounds' ratios `values[i] / base[i]`, and a 90% interval for it
    (percentiles of the medians of `resamples` rounds drawn with replacement)."""
    ratios = [v / b for v, b in zip(values, base, strict=True)]
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios)))
                     for _ in range(resamples))
    return (statistics.median(ratios), medians[int(0.05 * resamples)],
            medians[int(0.95 * resamples) - 1])


def copy_bandwidth(nbytes: int = 32 * 2**20, runs: int = 10) -> float:
    """Bytes per second of `Tensor.copy_` between two CPU tensors of `nbytes` (about a
    chunk), median of `runs` after one, on this process's threads."""
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times)


def cold_copy_bandwidth(nbytes: int = 8 * 2**20, buffers: int = 40, runs: int = 5) -> float:
    """Bytes per second of `Tensor.copy_` from each of `buffers` tensors of `nbytes` (a
    chunk) into another, one after the other: 2 x 320 MiB, more than any cache here holds,
    so each copy reads and writes memory as a step's fetches and gradients do. The median
    of `runs` passes after one, on this process's threads."""
    srcs = [torch.ones(nbytes // 4) for _ in range(buffers)]
    dsts = [torch.ones(nbytes // 4) for _ in range(buffers)]
    times = []
    for _ in range(runs + 1):
        t0 = time.perf_counter()
        for src, dst in zip(srcs, dsts, strict=True):
            dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes * buffers / statistics.median(times[1:])


@contextmanager
def fetches_ahead(eng: Engine) -> Iterator[list[int]]:
    """The bytes `eng`'s simulated device copies on its copy thread meanwhile (a fetch ahead
    of use whose source stays put, where a core is spare: engine.devices.streams), one
    entry a copy; none on CUDA, whose copies all stream beside the kernels."""
    fetched: list[int] = []
    device = eng.device
    if not device.simulated:
        yield fetched
        return
    copy_ahead = device.copy_ahead

    def counting(dst, src, *, src_kept=False):
        if src_kept and spare_core():
            fetched.append(src.nbytes)
        return copy_ahead(dst, src, src_kept=src_kept)

    device.copy_ahead = counting
    try:
        yield fetched
    finally:
        del device.copy_ahead  # the class's method again


@contextmanager
def copies_in_line(eng: Engine) -> Iterator[list[float]]:
    """The wall seconds `eng`'s simulated device spends copying on the stepping thread
    meanwhile (its copies, and its fetches ahead, which are in line where no core is
    spare, else only submitted): one entry a copy; none on CUDA, whose copies stream."""
    seconds: list[float] = []
    device = eng.device
    if not device.simulated:
        yield seconds
        return
    copy, copy_ahead = device.copy, device.copy_ahead
    before = {name: vars(device).get(name) for name in ("copy", "copy_ahead")}

    device.copy = clocked(copy, seconds.append)
    device.copy_ahead = clocked(copy_ahead, seconds.append)
    try:
        yield seconds
    finally:
        for name, method in before.items():  # as they were: another wrapper, or the class's
            if method is None:
                delattr(device, name)
            else:
                setattr(device, name, method)


def plain_step(model, opt, batch) -> None:
    loss = model(**batch).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="opt-125m")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads (0: torch's default); 1 is steadier on a shared machine")
    ap.add_argument("--uncounted", action="store_true",
                    help="also auto and cpu with the non-model counter off after tracing")
    ap.add_argument("--kept-heap", action="store_true",
                    help="glibc keeps freed memory: no system pays for fresh pages")
    ap.add_argument("--dry-run", action="store_true",
                    help="the tiny model, one round: checks that it starts")
    args = ap.parse_args(argv)
    if args.dry_run:
        args.model, args.rounds, args.warmup, args.seq_len = "tiny", 1, 1, 32
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.kept_heap and not kept_heap():
        raise SystemExit("--kept-heap: this C library has no mallopt")

    base = build(args.model)
    # Every system runs the forward the engine runs: no generation cache (kept on, it cost
    # plain PyTorch 8% of its step on opt-125m, key/value tensors no training step reads).
    prepare_for_training(base)
    vocab = base.config.vocab_size
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, vocab, (args.batch_size, args.seq_len), generator=g)
               for _ in range(args.rounds + args.warmup)]
    batches = [{"input_ids": b, "labels": b} for b in batches]
    payload = sum(p.numel() * 4 for p in base.parameters())
    budgets, working_set = policy_budgets(base, batches[0])

    # On a GPU the baseline trains there too, the whole model resident.
    device = "cuda" if torch.cuda.is_available() else "cpu"
    plain = copy.deepcopy(base).to(device)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-3, fused=True)
    systems = {
        "plain": lambda b: timed(
            lambda: plain_step(plain, opt, {k: v.to(device) for k, v in b.items()})),
    }
    engines = {}
    for policy, budget in budgets.items():
        eng = Engine(copy.deepcopy(base), EngineConfig(policy=policy, device_budget=budget))
        engines[policy] = eng
        systems[policy] = lambda b, eng=eng: timed(lambda: eng.step(b))
    if args.uncounted:
        for policy in ("auto", "cpu"):
            name = f"{policy}-nc"
            budgets[name] = budgets[policy]
            eng = Engine(copy.deepcopy(base),
                         EngineConfig(policy=policy, device_budget=budgets[policy]))
            engines[name] = eng
            systems[name] = lambda b, eng=eng: timed(lambda: uncounted_step(eng, b))
    del base

    times: dict[str, list[float]] = {name: [] for name in systems}
    cpu: dict[str, list[float]] = {name: [] for name in systems}
    faults: dict[str, list[int]] = {name: [] for name in systems}
    moved: dict[str, int] = {}
    order = list(systems.items())
    for i, batch in enumerate(batches):
        # Each round starts one system further on, so none always follows the same other.
        for name, step in order[i % len(order):] + order[:i % len(order)]:
            seconds, cpu_seconds, step_faults = step(batch)
            if i >= args.warmup:
                times[name].append(seconds)
                cpu[name].append(cpu_seconds)
                faults[name].append(step_faults)
    ahead: dict[str, int] = {}
    in_line: dict[str, float] = {}
    for policy, eng in engines.items():
        with fetches_ahead(eng) as fetched, copies_in_line(eng) as copying:
            stats = eng.step(batches[-1])
        moved[policy] = stats.bytes_h2d + stats.bytes_d2h
        ahead[policy] = sum(fetched)
        in_line[policy] = sum(copying)

    bandwidth = 0.0 if torch.cuda.is_available() else copy_bandwidth()
    cold = 0.0 if torch.cuda.is_available() else cold_copy_bandwidth()
    base_median = statistics.median(times["plain"])
    base_cpu = statistics.median(cpu["plain"])
    print(f"{args.model}, batch {args.batch_size} x {args.seq_len}, fp32, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds"
          f"{', heap kept' if args.kept_heap else ''}; payload "
          f"{format_size(payload)}, working set {format_size(working_set)}")
    print(f"{'system':<8}{'budget':>12}{'median s':>10}{'ratio':>8}{'CPU s':>8}{'ratio':>8}"
          f"{'paired':>8}{'90% interval':>14}{'moved/step':>13}{'faults/step':>13}"
          f"{'less copies':>13}")
    for name, values in times.items():
        median, cpu_median = statistics.median(values), statistics.median(cpu[name])
        budget = format_size(budgets[name]) if name in budgets else "-"
        bytes_moved = format_size(moved[name]) if name in moved else "-"
        ratio, low, high = paired(values, times["plain"])
        less = "-"
        if bandwidth and name in moved:
            less = f"{paired([v - in_line[name] for v in values], times['plain'])[0]:.3f}"
        print(f"{name:<8}{budget:>12}{median:>10.3f}{median / base_median:>8.2f}"
              f"{cpu_median:>8.3f}{cpu_median / base_cpu:>8.2f}{ratio:>8.3f}"
              f"{f'{low:.3f}-{high:.3f}':>14}{bytes_moved:>13}"
              f"{statistics.median(faults[name]):>13,.0f}{less:>13}")
    if bandwidth:
        print(f"a lone copy at {bandwidth / 1e9:.1f} GB/s (Tensor.copy_ of 32 MiB, this "
              "process); of the bytes moved, on the copy thread: "
              + ", ".join(f"{name} {format_size(n)}" for name, n in ahead.items())
              + "; the rest in line: " + ", ".join(
                  f"{name} {in_line[name] * 1e3:.1f} ms"
                  + (f" ({(moved[name] - ahead[name]) / in_line[name] / 1e9:.1f} GB/s)"
                     if in_line[name] and moved[name] > ahead[name] else "")
                  for name in in_line))
        # The least a policy's copies add to plain's step where the engine cost nothing
        # else: what the stepping thread copies, at the speed of copies no cache holds.
        print(f"copies that no cache holds at {cold / 1e9:.1f} GB/s: the bytes copied in "
              "line alone would add " + ", ".join(
                  f"{name} {(moved[name] - ahead[name]) / cold / base_median:+.1%}"
                  for name in in_line if moved[name]) + " to plain's step")
    print(f"{args.model} on {device}: plain {base_median:.3f} s/step; " + ", ".join(
        f"{name} {statistics.median(values) / base_median:.2f}x"
        for name, values in times.items() if name != "plain")
        + f"; CPU: plain {base_cpu:.3f} s/step; " + ", ".join(
        f"{name} {statistics.median(values) / base_cpu:.2f}x"
        for name, values in cpu.items() if name != "plain")
        + "; paired: " + ", ".join(
        "{} {:.3f} ({:.3f}-{:.3f})".format(name, *paired(values, times["plain"]))
        for name, values in times.items() if name != "plain"))


if __name__ == "__main__":
    main()
