"""Byte sizes: read from what a user types, and written for people to read.

Below everything else in the engine (engine.config re-exports both), so that the placement
rules can word their errors without importing the config that names their policies.
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Bytes from an int or a string such as "6GiB", "512MiB", "1.5GB" or "1000".

    Raises ValueError with the offending text when it cannot be read.
    """
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value!r}")
        return int(value)
    m = _SIZE.match(str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"not a size: {value!r} (use bytes or e.g. 6GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def format_size(nbytes: float) -> str:
    """Human-readable binary size: 6.0 GiB, 512.0 MiB, 3.2 KiB, 12 B."""
    for unit, scale in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"
