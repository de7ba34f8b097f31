"""Which steps count every op's bytes on the simulated device (or read the allocator at every
sample on CUDA), and what the others report.

Counting (engine.step.non_model) puts a Python call in front of every op: measured, 20-40 us
an op, 10-20% of a small model's step on this CPU. A step whose batch shape, activation
checkpointing and trainable set are the trace's (its step key) runs the same ops on the same
shapes, so its non-model bytes are the trace's; what can still differ is where the chunks
are, and that shows in the model bytes at each trace point and the bytes copied between
them (the step's *fingerprint*). So a step counts when it is traced, when it is one of the
first two of its micro-batch since the trace or a settings change (until two counted ones
in a row have one fingerprint: the chunks have settled into their places), when the
previous one's fingerprint differed from the last counted one's, and on the simulated
device every RECOUNT_EVERY steps (data-dependent shapes, such as routed experts, are not in
the key; on CUDA every step's true peak is the allocator's, read once after it, so no
backstop is needed there). The rest run without the dispatch mode, and on CUDA without
reading the allocator between trace points (about 20 us a read, a few reads at each of a
step's thousands of samples and placement decisions: 10x plain PyTorch's step on opt-125m
on an H200 before, when every step read; a counted step of opt-1.3b bf16 at 8 x 1024 with
checkpointing still took 0.44 s there against 0.20 s):

- their placement decisions are the counted ones': the rules keep room for the interval's
  traced non-model peak less what is alive, and with the count replaced by that peak the
  room left is the same (capacity - model - peak), so the same chunks move;
- their peaks are the last counted step's when the fingerprint matches (the same ops and
  the same chunks at the same points reach the same bytes); otherwise each interval
  reports the most chunk bytes it held beside its traced non-model peak, an upper bound,
  and the next step counts again. So between two points such a step only tracks the
  chunk bytes, where a counted one samples everything (engine.step.measuring).

A step that does not count and whose chunks are all resident (their device copies are
their homes: nothing can move, so its fingerprint is the counted one's by construction) is
*quiet*: it reports the last count's peaks and timeline (`repeat`), and the runner's hooks
do nothing in it but watch for an interrupt and give a tied weight's uses their aliases
(engine.step.tied_uses: so the gradients add up in the counted order and no use's is kept
longer than counted). Measured on a 6-layer OPT under cuda: the hooks' work was 2% of a
step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from engine.telemetry import TimelinePoint

__all__ = ["CountedSteps", "RECOUNT_EVERY"]

# Steps between two counted ones when nothing changed: a backstop for activations the step
# key cannot see, at a cost of one counted step in this many (under 1% of the time).
RECOUNT_EVERY = 32


@dataclass
class _Counted:
    """What a counted micro-batch reached, and how to recognise one like it."""

    fingerprint: tuple[tuple[int, int, int], ...]
    peak: int
    non_model_peak: int
    # The counted micro-batch's, interval by interval: (model, non-model) bytes at each
    # interval's peak, which a step like it reports, and a quiet one repeats whole.
    timeline: list[TimelinePoint]
    since: int = 0  # uncounted steps that reused these figures
    # Whether the count before this one had the same fingerprint: the placement has
    # settled (after a trace or a change, chunks may still be moving into their places).
    settled: bool = False


@dataclass
class CountedSteps:
    """The runner's choice, micro-batch by micro-batch, of counting or not; see the module
    docstring. `counting` is this micro-batch's."""

    counting: bool = True
    # Every step counts (data parallel: a rank's gathers and evictions follow the other
    # ranks' timing, so its placement is no step's twin, and an upper bound is no answer).
    every_step: bool = False
    # A settled micro-batch counts again every RECOUNT_EVERY steps (the simulated device).
    recount: bool = True
    _last: dict[int, _Counted] = field(default_factory=dict)  # micro-batch -> its last count
    _marks: list[tuple[int, int, int]] = field(default_factory=list)
    _micro: int = 0
    _tracing: bool = False

    def begin(self, *, tracing: bool, accumulate: bool) -> bool:
        """A micro-batch starts (`accumulate`: a later one of the same step); returns
        whether it counts."""
        self._micro = self._micro + 1 if accumulate else 0
        self._marks = []
        self._tracing = tracing
        if tracing:
            # A new trace, new figures; not this step's, placed by the tracing rules.
            self._last.clear()
        last = self._last.get(self._micro)
        self.counting = (self.every_step or tracing or last is None or not last.settled
                         or (self.recount and last.since + 1 >= RECOUNT_EVERY))
        return self.counting

    def forget(self) -> None:
        """The settings changed (policy, margin, budget): the next step places its chunks
        anew, so it counts."""
        self._last.clear()

    def mark(self, model_bytes: int, bytes_h2d: int, bytes_d2h: int) -> None:
        """At a trace point, once its module's chunks are in: the step's fingerprint."""
        self._marks.append((model_bytes, bytes_h2d, bytes_d2h))

    def abort(self) -> None:
        """A failed micro-batch: count the next one."""
        self._last.pop(self._micro, None)

    def finish(self, peak: int, non_model_peak: int, timeline: list[TimelinePoint]
               ) -> tuple[int, int, list[tuple[int, int]]]:
        """The micro-batch is over: returns its (peak, non-model peak, interval tops), those
        it measured when counting, else the counted ones its fingerprint matches, else the
        upper bounds it sampled (`timeline`'s)."""
        fingerprint = tuple(self._marks)
        tops = _tops(timeline)
        if self.counting:
            if not self._tracing:
                before = self._last.get(self._micro)
                self._last[self._micro] = _Counted(
                    fingerprint, peak, non_model_peak,
                    [dataclasses.replace(p) for p in timeline],
                    settled=before is not None and before.fingerprint == fingerprint)
            return peak, non_model_peak, tops
        last = self._last.get(self._micro)
        if last is None or last.fingerprint != fingerprint:
            self._last.pop(self._micro, None)
            return peak, non_model_peak, tops
        last.since += 1
        return last.peak, last.non_model_peak, _tops(last.timeline)

    def repeat(self) -> tuple[int, int, list[TimelinePoint]]:
        """A quiet micro-batch is over (see the module doc; it does not count, so a settled
        count of its micro-batch exists): that count's (peak, non-model peak, timeline)."""
        last = self._last[self._micro]
        last.since += 1
        # The count's own points, not copies: nothing changes a point once its step is
        # over (the runner fills only the points of the step it runs), and a copy of each
        # was 6% of a quiet step of a small model (hundreds of points).
        return last.peak, last.non_model_peak, list(last.timeline)


def _tops(timeline: list[TimelinePoint]) -> list[tuple[int, int]]:
    return [(p.model_bytes, p.non_model_bytes) for p in timeline]
