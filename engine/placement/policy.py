"""Placement policies: where chunks live between uses.

- CUDA: all model data, optimizer state included, stays on the device.
- CPU:  chunks live on the host, are copied in right before use and dropped right after.
- AUTO: chunks stay on the device while there is room; when room is needed the chunk whose
        next use (from the warm-up trace) is farthest away is evicted.
"""

from __future__ import annotations

from enum import Enum


class Policy(str, Enum):
    CUDA = "cuda"
    CPU = "cpu"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: str | Policy) -> Policy:
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(p.value for p in cls)
            raise ValueError(f"unknown policy {value!r} (choose {names})") from None

    def next(self) -> Policy:
        """The policy after this one in the cycle cuda -> cpu -> auto -> cuda."""
        order = list(Policy)
        return order[(order.index(self) + 1) % len(order)]
