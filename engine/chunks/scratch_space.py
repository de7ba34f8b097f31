"""Opening the disk tier: a scratch folder with the room the host budget needs, checked
before anything is written, and the one-line error when the disk lacks it."""

from __future__ import annotations

import errno
import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from engine.chunks.chunk import Chunk
from engine.chunks.flight import UpdateInFlight
from engine.chunks.spill import ScratchTooSmall, Spill
from engine.devices.disk import DiskTier, DiskTierError, ScratchFolder, probe_bytes, space_needed
from engine.sizes import format_size


def open_spill(chunks: list[Chunk], *, disk_dir: Path, need: int, piece: int,
               flight: UpdateInFlight, empty: Callable[[int, torch.dtype], torch.Tensor],
               alloc: Callable[[int, torch.dtype], torch.Tensor],
               free: Callable[[torch.Tensor], None]) -> Spill:
    """A Spill over a new scratch folder under `disk_dir` that has room for `need` bytes
    of chunk parts (and for the tier's bandwidth probe before them: space_needed).

    Raises ValueError naming the folder when it cannot be written, ScratchTooSmall (with
    what is needed and what is free) when its filesystem lacks the space, now or when the
    probe finds the disk full after all."""
    folder = ScratchFolder(disk_dir)
    probe = probe_bytes(need)
    need = space_needed(need)
    available = folder.free_bytes()
    if need > available:
        folder.remove()
        raise too_small(folder.parent, need, available)
    try:
        tier = DiskTier(folder, empty=empty, probe=probe)
    except DiskTierError as e:
        folder.remove()
        if e.errno != errno.ENOSPC:
            raise
        raise too_small(folder.parent, need, free_space(folder.parent)) from None
    return Spill(chunks, tier, piece=piece, flight=flight, alloc=alloc, free=free)


def too_small(parent: Path, need: int, available: int) -> ScratchTooSmall:
    """The one-line error for a scratch folder whose filesystem lacks `need` bytes."""
    return ScratchTooSmall(
        f"the host budget needs {format_size(need)} on disk, but the scratch folder "
        f"{parent} has {format_size(available)} free; free some space, give "
        f"another folder (disk_dir) or a larger host budget")


def free_space(folder: Path) -> int:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0
