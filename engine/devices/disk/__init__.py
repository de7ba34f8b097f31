"""The scratch disk as the third memory tier (after the device and the host).

- scratch: the run's own folder (private, locked, removed at close and at exit; folders
  of dead runs removed at the next start).
- files: positioned, aligned reads and writes; O_DIRECT where the filesystem takes it.
- tier: regions of scratch files, the I/O buffers and the two threads that move them.

What goes to disk and when is decided by engine.placement.rules (disk_placement) and carried
out on chunks by engine.chunks.spill.
"""

from engine.devices.disk.files import ALIGN, ScratchFile, aligned, direct_io_supported
from engine.devices.disk.scratch import (
    ScratchFolder,
    default_disk_dir,
    rank_folder,
    remove_all,
    remove_if_empty,
    remove_stale,
    remove_stale_beside,
)
from engine.devices.disk.tier import (
    DiskTier,
    DiskTierError,
    Region,
    probe_bytes,
    space_needed,
)

__all__ = [
    "ALIGN",
    "DiskTier",
    "DiskTierError",
    "Region",
    "ScratchFile",
    "ScratchFolder",
    "aligned",
    "default_disk_dir",
    "direct_io_supported",
    "probe_bytes",
    "rank_folder",
    "remove_all",
    "remove_if_empty",
    "remove_stale",
    "remove_stale_beside",
    "space_needed",
]
