"""Warm-up trace: the order in which chunks are used, and non-model memory between uses.

Recorded on the first step, and again whenever the step changes: the batch shape (a new
sequence length changes activation sizes; memoising layouts across shapes is a known way to
OOM), activation checkpointing turned on or off, or the set of parameters that need a
gradient (a layer unfrozen mid-run). `key` holds what the trace was recorded for.

The working set counts, for every chunk whose gradients are coming in, room for a gradient
buffer, even where the chunk is resident and needs none: a trace recorded under the cuda
policy then still tells what cpu or auto would need after a switch.
Within an interval, gradients arrive (and with them gradient buffers open and autograd's
gradients go): `rest[k - 1]` is the interval's non-model peak from its k-th arrival on, so
that room is kept only for the peak still to come (`arrived_at`), and the working set is
the most chunk bytes held in each part of the interval beside that part's peak to come.
The engine records it from a real step (engine.step), the planner from a replayed one
(engine.planning.replay): one type, read by the same placement rules.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class TracePoint:
    chunks: tuple[int, ...]  # chunks the module about to run needs (a run's first)
    phase: str  # "forward" | "backward"
    non_model_peak: int = 0  # peak non-model bytes from this point to the next
    working_set: int = 0  # peak of pinned chunks + gradient buffers + non-model, same span
    rest: tuple[int, ...] = ()  # rest[k - 1]: the non-model peak from the k-th gradient on
    # The chunks whose gradients may arrive in this interval, where they are not `chunks`:
    # a backward that reads none of its module's parameters fetches nothing, yet its
    # gradients open buffers (engine.step.backward_reads).
    grads_to: tuple[int, ...] | None = None

    @property
    def grad_chunks(self) -> tuple[int, ...]:
        return self.chunks if self.grads_to is None else self.grads_to

    def close(self, parts: list[tuple[int, int]]) -> None:
        """The interval's parts, split at each gradient arrival, as (most chunk bytes held,
        non-model peak) each: its peaks and its working set."""
        to_come, ahead = [], 0
        for _, peak in reversed(parts):
            ahead = max(ahead, peak)
            to_come.append(ahead)
        to_come.reverse()
        self.non_model_peak = to_come[0] if to_come else 0
        self.rest = tuple(to_come[1:])
        self.working_set = max((held + ahead for (held, _), ahead in zip(parts, to_come,
                                                                         strict=True)),
                               default=0)


@dataclass
class Trace:
    shape: tuple = ()
    key: tuple = ()  # what the step looked like when traced; another key means re-trace
    points: list[TracePoint] = field(default_factory=list)
    _uses: dict[int, list[int]] = field(default_factory=dict)
    # Where the step that forecasts from this trace is: (position, gradients arrived there).
    _cursor: tuple[int, int] = (-1, 0)
    # The first backward point: gradients arrive from there on (recomputed forwards too).
    backward_from: int = 0

    def finish(self) -> None:
        self.backward_from = next(
            (i for i, p in enumerate(self.points) if p.phase == "backward"), len(self.points))
        self._uses = {}
        for pos, point in enumerate(self.points):
            for c in point.chunks:
                self._uses.setdefault(c, []).append(pos)

    def next_use(self, chunk: int, pos: int) -> float:
        """Position of the first use of `chunk` after `pos`; infinity if none this step."""
        uses = self._uses.get(chunk, [])
        i = bisect.bisect_right(uses, pos)
        return uses[i] if i < len(uses) else float("inf")

    def arrived_at(self, pos: int, arrived: int) -> None:
        """The step forecasting from this trace is at `pos`, where `arrived` gradients
        have arrived so far: what is forecast there from now on is the peak still to come."""
        self._cursor = (pos, arrived)

    def non_model_ahead(self, pos: int) -> int:
        """Non-model peak forecast for the interval starting at `pos`, from the latest
        gradient arrival there on (`arrived_at`)."""
        if not 0 <= pos < len(self.points):
            return 0
        point = self.points[pos]
        at, arrived = self._cursor
        if at != pos or arrived == 0 or not point.rest:
            return point.non_model_peak
        return point.rest[min(arrived, len(point.rest)) - 1]

    @property
    def non_model_peak(self) -> int:
        return max((p.non_model_peak for p in self.points), default=0)

    @property
    def working_set(self) -> int:
        """Least device bytes any placement needs: in-use chunks + live grads + activations."""
        return max((p.working_set for p in self.points), default=0)
