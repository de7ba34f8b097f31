"""Data parallel runs: what each rank of a `torchrun` launch does differently.

    torchrun --nproc-per-node 2 -m tuitrain run tiny --headless --steps 5

starts one `tuitrain run` per rank; each starts its worker as a single run would, and the
worker joins the others through torch.distributed (gloo on CPUs, NCCL on GPUs) before it
builds the engine, which then shards its chunks over the ranks (engine.distributed).

- Batches: `batch_size` is the global batch. Every rank reads the same stream of global
  batches (so a run's batches depend on the seed and the global batch size, never on the
  world size) and trains on its own contiguous slice of each.
- Outputs: rank 0 alone writes the metrics file, the summary and the model folder of each
  checkpoint; every rank writes its own shard of the checkpoint's optimizer state
  (tuitrain.checkpoint). Every rank's worker logs to a file of its own (its rank in the
  name).
- Ending: a rank that is asked to stop (Ctrl-C reaches every rank, not always in the same
  step) stops at a step boundary the ranks agree on, so none waits for the others forever.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.distributed.collectives import Collectives

# torchrun's environment (torch.distributed.run), read once where a run starts.
WORLD_ENV, RANK_ENV, LOCAL_RANK_ENV = "WORLD_SIZE", "RANK", "LOCAL_RANK"
LOCAL_WORLD_ENV = "LOCAL_WORLD_SIZE"  # ranks on this node (torchrun sets it)
# Where torchrun's agent (and tuitrain.launch, the same agent) reads why a rank failed.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


@dataclass(frozen=True)
class Ranks:
    """This process's place in the launch: rank `rank` of `world`, `local` on its node."""

    rank: int = 0
    world: int = 1
    local: int = 0

    @property
    def parallel(self) -> bool:
        return self.world > 1

    @property
    def leader(self) -> bool:
        """Rank 0: the one that writes the run's files and prints its progress."""
        return self.rank == 0

    def label(self) -> str:
        """"rank 1 of 2", for messages; empty for a single process."""
        return f"rank {self.rank} of {self.world}" if self.parallel else ""

    def slice(self, batch: dict, parts: int = 1) -> dict:
        """This rank's part of a global batch of `parts` micro-batches (every tensor along
        its first dimension; a micro-batch is a multiple of the world size, see
        check_batch): its contiguous part of each micro-batch, in order. So the ranks'
        k-th micro-batches together are one process's k-th, and each rank's dropout masks
        are its rows of that process's (engine.step.dropout)."""
        if not self.parallel:
            return batch
        micro = batch["input_ids"].shape[0] // parts
        size = micro // self.world
        rows = [slice(k * micro + self.rank * size, k * micro + (self.rank + 1) * size)
                for k in range(parts)]

        def part(v):
            if parts == 1:
                return v[rows[0]]
            import torch

            return torch.cat([v[r] for r in rows])

        return {k: part(v) if hasattr(v, "shape") else v for k, v in batch.items()}

    def eval_part(self, batch: dict) -> tuple[dict, int]:
        """(the rows this rank scores of a held-out batch, how many of them count). Held-out
        batches need not split evenly (the last is often short): the first ranks take one
        row more; a rank left without a row scores the first one, which counts for nothing,
        so that it still takes part in the engine's collectives."""
        rows = batch["input_ids"].shape[0]
        if not self.parallel:
            return batch, rows
        base, extra = divmod(rows, self.world)
        count = base + (self.rank < extra)
        lo = self.rank * base + min(self.rank, extra)
        if count == 0:
            lo, count, counted = 0, 1, 0
        else:
            counted = count
        part = {k: v[lo:lo + count] if hasattr(v, "shape") else v for k, v in batch.items()}
        return part, counted

    def check_batch(self, batch_size: int) -> None:
        """ValueError (bad input) when the global batch does not split evenly."""
        if self.parallel and batch_size % self.world:
            raise ValueError(f"batch_size {batch_size} does not split evenly over "
                             f"{self.world} ranks; use a multiple of {self.world}")


def from_environment(env: dict[str, str] | None = None) -> Ranks:
    """The ranks torchrun describes in the environment; one process without it. Raises
    ValueError for values torchrun would never set."""
    env = os.environ if env is None else env
    try:
        world = int(env.get(WORLD_ENV, "1"))
        rank = int(env.get(RANK_ENV, "0"))
        local = int(env.get(LOCAL_RANK_ENV, str(rank)))
    except ValueError:
        raise ValueError(f"{WORLD_ENV}, {RANK_ENV} and {LOCAL_RANK_ENV} must be whole "
                         f"numbers") from None
    if world < 1 or not 0 <= rank < world or local < 0:
        raise ValueError(f"{RANK_ENV}={rank} is not a rank of {WORLD_ENV}={world}")
    return Ranks(rank, world, local)


def on_this_machine(ranks: Ranks, env: dict[str, str] | None = None) -> int:
    """How many of the ranks run on this machine and share its memory: torchrun's
    LOCAL_WORLD_SIZE, or all of them (ranks started without it are started here)."""
    env = os.environ if env is None else env
    try:
        local = int(env.get(LOCAL_WORLD_ENV, str(ranks.world)))
    except ValueError:
        local = ranks.world
    return min(max(local, 1), ranks.world)


def join(ranks: Ranks, *, cuda: bool, timeout: float) -> str | None:
    """Join the other ranks (torchrun's rendezvous in the environment) before the engine is
    built; returns the backend, None for a single process. On a GPU each rank takes the
    GPU of its local rank. `timeout` (seconds, the run's engine.collective_timeout) bounds
    every collective of the default process group, as the engine's own are bounded."""
    if not ranks.parallel:
        return None
    import torch
    import torch.distributed as dist

    backend = "nccl" if cuda else "gloo"
    if cuda:
        torch.cuda.set_device(ranks.local)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=ranks.rank, world_size=ranks.world,
                                timeout=datetime.timedelta(seconds=timeout))
    return backend


def gather_from_ranks(collectives: Collectives | None, value: Any) -> list[Any]:
    """Every rank's `value` (anything JSON writes: numbers, text, lists, mappings), in rank
    order: every rank calls this at the same point. `[value]` for a single process
    (`collectives` None).

    The small records the ranks exchange (rank 0's decision at a step boundary, a change
    each rank's engine refused, what a checkpoint wrote or what failed) go through the
    engine's `collectives` (Engine.collectives), so they wait at most their timeout
    (engine.collective_timeout) and a rank that died or hangs is a CollectiveError that
    names this rank and the operation. JSON, not pickle: a record is data, never code."""
    if collectives is None:
        return [value]
    import torch

    data = json.dumps(value).encode()
    longest = collectives.max_ints([len(data)])[0]
    row = torch.zeros(longest, dtype=torch.uint8, device=collectives.device)
    row[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(row.device)
    rows = collectives.all_gather_rows(row).cpu()
    return [json.loads(bytes(r.tolist()).rstrip(b"\0") or b"null") for r in rows]


def sum_over_ranks(collectives: Collectives | None, value: float) -> float:
    """`value` summed over the ranks (float64), through the engine's `collectives` as
    gather_from_ranks goes: every rank calls this at the same point. `value` itself for a
    single process (`collectives` None)."""
    if collectives is None:
        return value
    return collectives.sum_floats([value])[0]


@dataclass(frozen=True)
class FailureRecord:
    """What a rank that failed by itself tells its launcher: when it saw the failure (time.time()),
    whether its worker was killed by a signal (then it is the cause: the other ranks fail in
    a collective waiting for it, a moment later), and the exit status it ends with (which
    the launcher's SIGTERM, sent when another rank ended first, may pre-empt)."""

    at: float
    killed: bool
    exitcode: int = 1


def record_failure(reason: str, *, killed: bool, exitcode: int = 1,
                   env: dict[str, str] | None = None) -> None:
    """Under a launcher (torchrun, or tuitrain.launch), tell it that this rank failed, now:
    the error file its agent reads (torch.distributed.elastic's format: a message and a
    timestamp, which torchrun shows as the root cause), with a FailureRecord beside them,
    which failure_record reads back. Nothing without a launcher; a write that fails is
    left out (the exit status still says the rank failed)."""
    path = (os.environ if env is None else env).get(ERROR_FILE_ENV)
    if not path:
        return
    now = time.time()
    data = {"message": reason, "timestamp": int(now),
            "tuitrain": {"at": now, "killed": killed, "exitcode": exitcode}}
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
    except OSError:
        pass


def failure_record(error_file_data: Any) -> FailureRecord | None:
    """The FailureRecord in an error file's data (a ProcessFailure's error_file_data), or
    None when the rank wrote none (it was killed, or stopped by the launcher)."""
    record = error_file_data.get("tuitrain") if isinstance(error_file_data, dict) else None
    if not isinstance(record, dict):
        return None
    try:
        return FailureRecord(at=float(record["at"]), killed=bool(record["killed"]),
                             exitcode=int(record.get("exitcode", 1)))
    except (KeyError, TypeError, ValueError):
        return None


def leave(ranks: Ranks) -> None:
    """Leave the process group at the end of a run (nothing for a single process)."""
    if not ranks.parallel:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
