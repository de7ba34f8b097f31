"""The collectives the engine issues, on a process group of its own.

Every collective is bounded by a timeout and fails with a CollectiveError that names this
rank, the operation and the chunk: a dead rank or one that issued something else is an
error within `timeout` seconds, never a hang. On gloo each wait carries the timeout. On
NCCL a wait with a timeout would block the host until the collective ends (and a gather
started ahead of use would overlap nothing), so a wait only orders the compute stream after
the collective, and the process group's own timeout and watchdog end a hung one.
Collectives pair up across ranks by the order they are issued in, so every rank must issue
the same ones in the same order; each one is also added to a running digest (kind, chunk,
size), and `agree_step` compares the digests of all ranks once per step, so a divergence
that happened to pair collectives of equal sizes is still an error (with the counts), never
silently mixed gradients.

Collectives run outside any dispatch mode: their outputs are the caller's own tensors,
written in place, which a counter of new storages (engine.step.non_model) would otherwise
take for new allocations.
"""

from __future__ import annotations

import datetime
import struct
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

DEFAULT_TIMEOUT = 600.0  # seconds; torch.distributed's own default for gloo and NCCL
_DIGEST_MOD = 2**61 - 1
_KINDS = {"all-gather": 1, "reduce-scatter": 2, "all-reduce": 3, "all-gather of rows": 4}

# Newer torch names them *_single; the *_tensor spellings are the same collectives.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the rank, the operation and the
    chunk, and says what usually causes it."""


def join(data_parallel: bool | None, *, timeout: float = DEFAULT_TIMEOUT) -> Collectives | None:
    """The engine's collectives when it is to shard its chunks, else None.

    Args:
        data_parallel: None (the default) shards when torch.distributed is initialized
            with more than one rank, which is what `torchrun` plus `init_process_group`
            gives; True requires that (ValueError otherwise); False never shards (each
            process trains its own whole model).
        timeout: seconds any one collective may take before it is an error.

    Every rank must call this at the same point (it creates a process group).
    """
    if data_parallel is False:
        return None
    ready = dist.is_available() and dist.is_initialized()
    if not ready or dist.get_world_size() == 1:
        if data_parallel:
            raise ValueError("data_parallel=True needs torch.distributed initialized with "
                             "more than one rank (torchrun, then init_process_group)")
        return None
    # A group of its own: the engine's collectives never pair up with the caller's.
    group = dist.new_group(timeout=datetime.timedelta(seconds=timeout))
    return Collectives(group, timeout=timeout)


@dataclass
class Pending:
    """An asynchronous collective on chunk `chunk`, until `Collectives.wait`."""

    work: object
    what: str
    chunk: int


class Collectives:
    """This rank's view of a process group: gathers, reduce-scatters and small agreements,
    each bounded by `timeout` seconds."""

    def __init__(self, group: dist.ProcessGroup | None = None, *,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self.timeout = float(timeout)
        # Where small tensors of agreements go: NCCL moves only CUDA tensors.
        self.nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.nccl else \
            torch.device("cpu")
        self.issued = 0  # collectives issued since the last agree_step
        self.digest = 0
        # Chunk bytes this rank exchanged since `reset_counters`: by all-gathers, what it
        # received (the other ranks' shards); by reduce-scatters, what it sent into the
        # other ranks' shards. Either is the whole tensor less this rank's own shard, which
        # is what each rank sends and receives in a ring. Agreements are not counted.
        self.bytes_gathered = 0
        self.bytes_reduce_scattered = 0

    def reset_counters(self) -> None:
        """Zero the byte counters (at a step's start, so that a step reports its own)."""
        self.bytes_gathered = self.bytes_reduce_scattered = 0

    def _note(self, what: str, chunk: int, numel: int) -> None:
        self.issued += 1
        self.digest = (self.digest * 1_000_003 + _KINDS[what] * 7919
                       + (chunk + 1) * 104_729 + numel) % _DIGEST_MOD

    def _fail(self, what: str, chunk: int, error: BaseException) -> CollectiveError:
        where = f"chunk {chunk}" if chunk >= 0 else "an agreement between the ranks"
        # gloo closes the connection when a collective times out, and a later one waiting
        # on it then fails with "Application timeout caused pair closure": a timeout too
        # (with collectives started ahead of use, the earlier one may be another's).
        timed_out = any(m in str(error).lower() for m in ("timed out", "timeout caused"))
        cause = (f"timed out after {self.timeout:g} s" if timed_out else f"failed: {error}")
        return CollectiveError(
            f"rank {self.rank} of {self.world}: {what} of {where} {cause} (another rank "
            f"died, or issued different collectives: every rank must run the same modules "
            f"in the same order)")

    def _start(self, what: str, chunk: int, numel: int, call, *args, **kwargs) -> Pending:
        self._note(what, chunk, numel)
        try:
            with _disable_current_modes():
                work = call(*args, group=self.group, async_op=True, **kwargs)
        except Exception as error:  # noqa: BLE001 - gloo and NCCL raise several types
            raise self._fail(what, chunk, error) from error
        return Pending(work, what, chunk)

    def wait(self, pending: Pending) -> None:
        """Until `pending` has completed on this rank (NCCL: until the compute stream has
        it, see the module docstring); CollectiveError past the timeout."""
        try:
            with _disable_current_modes():
                if self.nccl:
                    pending.work.wait()
                else:
                    pending.work.wait(timeout=datetime.timedelta(seconds=self.timeout))
        except Exception as error:  # noqa: BLE001
            raise self._fail(pending.what, pending.chunk, error) from error

    # --- chunks -------------------------------------------------------------------------

    def gather(self, full: torch.Tensor, chunk: int) -> None:
        """In place: this rank's shard is already at its place in `full` (rank * size
        onwards); afterwards `full` holds every rank's."""
        self.wait(self.start_gather(full, chunk))

    def start_gather(self, full: torch.Tensor, chunk: int) -> Pending:
        """`gather`, started: `full` holds every rank's shard once `wait` returns, and
        nothing may read or write it before."""
        size = full.numel() // self.world
        mine = full[self.rank * size:(self.rank + 1) * size]
        pending = self._start("all-gather", chunk, full.numel(), _all_gather, full, mine)
        self.bytes_gathered += full.nbytes - mine.nbytes
        return pending

    def reduce_scatter(self, full: torch.Tensor, chunk: int) -> Pending:
        """Start summing `full` over the ranks into this rank's shard of it, in place
        (`full[rank * size:(rank + 1) * size]`); the rest of `full` is scratch. Wait for it
        with `wait`, then divide by the world size (gloo's AVG is not reliable)."""
        size = full.numel() // self.world
        mine = full[self.rank * size:(self.rank + 1) * size]
        pending = self._start("reduce-scatter", chunk, full.numel(), _reduce_scatter, mine,
                              full, op=dist.ReduceOp.SUM)
        self.bytes_reduce_scattered += full.nbytes - mine.nbytes
        return pending

    # --- small agreements -------------------------------------------------------------

    def _all_reduce(self, values: list, dtype: torch.dtype, op: dist.ReduceOp) -> list:
        with _disable_current_modes():
            t = torch.tensor(values, dtype=dtype, device=self.device)
        self.wait(self._start("all-reduce", -1, len(values), dist.all_reduce, t, op=op))
        return t.tolist()

    def max_ints(self, values: list[int]) -> list[int]:
        """The element-wise maximum of `values` over the ranks (same length everywhere)."""
        return self._all_reduce(values, torch.int64, dist.ReduceOp.MAX)

    def sum_floats(self, values: list[float]) -> list[float]:
        """The element-wise sum of `values` over the ranks, in float64."""
        return self._all_reduce(values, torch.float64, dist.ReduceOp.SUM)

    def all_gather_rows(self, row: torch.Tensor) -> torch.Tensor:
        """Every rank's `row` (same length on every rank), stacked: [world, len(row)]."""
        with _disable_current_modes():
            rows = torch.empty(self.world * row.numel(), dtype=row.dtype, device=row.device)
        self.wait(self._start("all-gather of rows", -1, row.numel(), _all_gather, rows, row))
        return rows.view(self.world, row.numel())

    def agree_step(self, loss: float, tokens: int, used: list[bool]
                   ) -> tuple[float, int, list[bool]]:
        """The step's end, in one collective: the mean of the ranks' losses, their total
        tokens, and which parameters got a gradient on some rank (`used`, per parameter in
        the same order on every rank). Raises CollectiveError if the ranks issued
        different collectives since the last call."""
        head = [self.issued, self.digest, tokens, struct.unpack("<q", struct.pack("<d", loss))[0]]
        with _disable_current_modes():
            row = torch.tensor(head + [int(u) for u in used], dtype=torch.int64,
                               device=self.device)
        self.issued = self.digest = 0
        rows = self.all_gather_rows(row).cpu()
        self.issued = self.digest = 0
        counts = rows[:, :2].tolist()
        if any(c != counts[self.rank] for c in counts):
            seen = ", ".join(f"rank {r}: {n} (digest {d:x})" for r, (n, d) in enumerate(counts))
            raise CollectiveError(
                f"rank {self.rank} of {self.world}: the ranks issued different collectives "
                f"this step ({seen}); every rank must run the same modules in the same order")
        losses = [struct.unpack("<d", struct.pack("<q", int(b)))[0] for b in rows[:, 3].tolist()]
        flags = rows[:, 4:].amax(dim=0).tolist() if used else []
        return (sum(losses) / self.world, int(rows[:, 2].sum()), [bool(f) for f in flags])
