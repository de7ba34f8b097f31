"""Why a traced step does not fit its device budget (Engine's check after tracing)."""

from __future__ import annotations

from engine.config import format_size
from engine.placement.rules import BudgetTooSmall
from engine.placement.trace import Trace

__all__ = ["overrun_error"]


def overrun_error(trace: Trace, capacity: int, overrun: int, policy: str) -> BudgetTooSmall:
    """The error for a step that needed more than `capacity`: below the working set no
    policy fits; above it, what `policy` kept on the device plus the activations overran
    by `overrun`. Either way with the bytes that were needed."""
    shape = "x".join(map(str, trace.shape))
    what, need = ("the minimum working set", trace.working_set) if (
        trace.working_set > capacity) else (
        f"what policy {policy} keeps on the device plus activations", capacity + overrun)
    return BudgetTooSmall(
        f"device budget {format_size(capacity)} is below {what}, {format_size(need)}, "
        f"for batches of {shape} tokens")
