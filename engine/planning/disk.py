"""The disk tier in bytes: what the placement rules put in the scratch folder under a host
budget, and what a step then reads and writes there.

Where each chunk's parts go is rules.disk_placement's, asked with the costs the chunk
manager asks it with (rules.disk_cost at the disk's block size and rules.disk_piece) and the
same chunks on the host (every chunk not resident on the device). What the step reads and
writes follows from the spill's mechanics (engine.chunks.spill, engine.chunks.update_walk),
counted here from the replayed step's fetches and the chunks it updates on the host:

- a payload on disk is read, piece by piece, each time it is copied to the device (and
  pieces read ahead for a copy that does not come are read all the same); one whose
  gradients are home already is copied from the fp32 master (bf16/fp16: the first
  4 B/element of each state piece);
- the gradients of a chunk whose payload is on disk go to disk as they land (bf16/fp16: in
  the payload's region; fp32: a region of their own);
- the update of a chunk with state on disk reads the state (and, with its payload on disk,
  the payload and fp32's gradients) and writes the state (and the payload) back.

Counts are of a steady step; writes are counted when issued, as the tier counts them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from engine.devices.disk import ALIGN, aligned
from engine.placement import rules

__all__ = ["DiskTraffic", "chunk_costs", "folder_problem", "free_space", "placement",
           "traffic"]


def piece(numel: list[int], itemsize: int, host_budget: int | None,
          frozen: list[bool] | None = None) -> int:
    """Elements per piece of disk I/O, as ChunkManager.use_host_budget picks it
    (rules.disk_piece: the I/O buffers sized to the model under the budget). `frozen`:
    which chunks are payload-only (none: None)."""
    return rules.disk_piece(numel, itemsize, host_budget=host_budget, block=ALIGN,
                            frozen=frozen or ())


def chunk_costs(numel: list[int], itemsize: int, piece: int,
                frozen: list[bool] | None = None) -> list[rules.DiskCost]:
    """Each chunk's DiskCost, as ChunkManager.disk_placement asks for it."""
    frozen = frozen or [False] * len(numel)
    return [rules.disk_cost(n, itemsize, ALIGN, piece, frozen=f)
            for n, f in zip(numel, frozen, strict=True)]


def placement(costs: list[rules.DiskCost], resident: Iterable[int],
              host_budget: int | None) -> rules.DiskPlacement:
    """rules.disk_placement for the chunks not in `resident` (HostBudgetTooSmall when even
    all of them on disk do not fit)."""
    keep = set(resident)
    return rules.disk_placement(costs, on_host=[c for c in range(len(costs)) if c not in keep],
                                host_budget=host_budget, block=ALIGN)


@dataclass(frozen=True)
class DiskTraffic:
    """Bytes the disk tier reads and writes in one step, and of them those the step waits
    for: the update's, both ways (less the state read ahead while the step ran), and with
    gradient accumulation the later micro-batches' reads of what an earlier one sent to
    disk (the masters copied to the device, the gradients added to) and of the payloads of
    chunks whose gradients are home, which are not read ahead (opt-125m under cpu with
    half its chunks on disk, x4: 56 such fetches a step waited 0.41-0.47 s in line). The
    rest, payloads read ahead of use and gradients written behind, runs beside the
    compute."""

    read: int = 0
    written: int = 0
    update: int = 0
    later_read: int = 0


def traffic(where: rules.DiskPlacement, costs: list[rules.DiskCost], numel: list[int], *,
            fetches: Iterable[tuple[int, bool]], updated: Iterable[int],
            unused: dict[int, int] | None = None, piece: int | None = None,
            micro_batches: int = 1) -> DiskTraffic:
    """What a step reads and writes in the scratch folder.

    Args:
        where: the placement in force.
        costs: each chunk's DiskCost (chunk_costs).
        numel: elements per chunk.
        fetches: every copy of a payload to the device in the step, as (chunk, from the
            master): whether its gradients were home already (StepReplay.fetches).
        updated: the non-resident chunks whose gradients came home (updated on the host).
        unused: payload pieces read ahead and then not used, per chunk (read all the same).
        piece: elements per piece (the `piece` the costs were made with).
        micro_batches: a step's micro-batches (gradient accumulation), each a forward and
            backward as the replayed one, but with every updated chunk's gradients home
            from the start: its payload copied from the master, and the gradients of one
            whose payload is on disk added to those there (read and written again).
    """
    read = written = later_read = 0
    fetches, updated = list(fetches), list(updated)
    home = set(updated)
    # The state pieces read ahead for the update while the step runs (one state buffer
    # left free; Spill.read_ahead_state): a fetch of a master from them reads nothing more.
    ahead = [(c, p) for c in sorted(home & where.state) for p in range(costs[c].pieces)]
    ahead = set(ahead[:rules.STATE_BUFFERS - 1])
    for later in range(micro_batches):
        for chunk, pieces in (unused or {}).items():
            if not (later and chunk in home):  # no read ahead of a payload holding gradients
                read += pieces * costs[chunk].payload_piece
        for chunk, from_master in fetches:
            cost = costs[chunk]
            if (from_master or (later and chunk in home)) and not cost.aliased \
                    and chunk in where.state:
                master = sum(aligned(4 * (hi - lo)) for p, (lo, hi)
                             in enumerate(rules.piece_spans(numel[chunk], piece))
                             if (chunk, p) not in ahead)
                read += master
                later_read += master if later else 0
            elif chunk in where.payload:
                payload = cost.pieces * cost.payload_piece
                read += payload
                # Not read ahead where it holds gradients (as `unused` above): in line.
                later_read += payload if later and chunk in home else 0
        if later:
            for chunk in home & where.payload:
                grads = costs[chunk].pieces * (costs[chunk].grad_piece
                                               or costs[chunk].payload_piece)
                read, written = read + grads, written + grads
                later_read += grads
    update_read = update_written = 0
    for chunk in updated:
        cost = costs[chunk]
        if chunk in where.payload:
            # Gradients landing, then the update: state, payload (fp32: and the gradients).
            written += cost.pieces * (cost.grad_piece or cost.payload_piece)
            update_read += cost.state_region + cost.payload_region
            update_written += cost.state_region + cost.pieces * cost.payload_piece
        elif chunk in where.state:
            update_read += cost.state_region
            update_written += cost.state_region
    read_ahead = sum(costs[c].state_piece for c, _ in ahead)
    return DiskTraffic(read + update_read, written + update_written,
                       update=update_read - read_ahead + update_written,
                       later_read=later_read)


def _existing(folder: Path) -> Path:
    """`folder`, or the nearest folder above it that exists (the plan creates nothing)."""
    here = folder.expanduser().absolute()
    while not here.exists() and here != here.parent:
        here = here.parent
    return here


def free_space(folder: Path) -> int:
    """Bytes free on the filesystem that would hold `folder`, which need not exist yet."""
    return shutil.disk_usage(_existing(folder)).free


def folder_problem(folder: Path) -> str:
    """Why the engine could not make its scratch folder under `folder` (ScratchFolder), or
    "" when it could, as far as can be told without writing anything."""
    here = _existing(folder)
    if not here.is_dir():
        return f"scratch folder {folder} cannot be created: {here} is not a folder"
    if not os.access(here, os.W_OK | os.X_OK):
        return f"scratch folder {folder} is not writable"
    return ""
