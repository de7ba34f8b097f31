"""Warm-up trace: the order in which chunks are used, and non-model memory between uses.

Recorded on the first step, and again whenever the step changes: the batch shape (a new
sequence length changes activation sizes; memoising layouts across shapes is a known way to
OOM), activation checkpointing turned on or off, or the set of parameters that need a
gradient (a layer unfrozen mid-run). `key` holds what the trace was recorded for.

The working set counts, for every chunk whose gradients are coming in, room for a gradient
buffer, even where the chunk is resident and needs none: a trace recorded under the cuda
policy then still tells what cpu or auto would need after a switch.
The engine records it from a real step (engine.step), the planner from a replayed one
(engine.planning.replay): one type, read by the same placement rules.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class TracePoint:
    chunks: tuple[int, ...]  # chunks the module about to run needs
    phase: str  # "forward" | "backward"
    non_model_peak: int = 0  # peak non-model bytes from this point to the next
    working_set: int = 0  # peak of pinned chunks + gradient buffers + non-model, same span


@dataclass
class Trace:
    shape: tuple = ()
    key: tuple = ()  # what the step looked like when traced; another key means re-trace
    points: list[TracePoint] = field(default_factory=list)
    _uses: dict[int, list[int]] = field(default_factory=dict)

    def finish(self) -> None:
        self._uses = {}
        for pos, point in enumerate(self.points):
            for c in point.chunks:
                self._uses.setdefault(c, []).append(pos)

    def next_use(self, chunk: int, pos: int) -> float:
        """Position of the first use of `chunk` after `pos`; infinity if none this step."""
        uses = self._uses.get(chunk, [])
        i = bisect.bisect_right(uses, pos)
        return uses[i] if i < len(uses) else float("inf")

    def non_model_ahead(self, pos: int) -> int:
        """Non-model peak forecast for the interval starting at `pos`."""
        if 0 <= pos < len(self.points):
            return self.points[pos].non_model_peak
        return 0

    @property
    def non_model_peak(self) -> int:
        return max((p.non_model_peak for p in self.points), default=0)

    @property
    def working_set(self) -> int:
        """Least device bytes any placement needs: in-use chunks + live grads + activations."""
        return max((p.working_set for p in self.points), default=0)
