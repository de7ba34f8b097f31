"""Which modules' backward reads their parameters, found by watching what forward saves.

A module's backward needs the weights it computes with only where its forward saved them
for backward: a linear layer saves its weight (its input's gradient is the output's times
the weight), an embedding saves only its token ids (its weight's gradient is a scatter of
the output's, and it has no input gradient). Fetching an embedding's chunk again for its
backward copies it in for nothing and keeps it on the device at the end of backward, when
every gradient buffer is open: on opt-125m under cpu, 147 MiB more copied per step and
at the step's peak; on a model with a 128k vocabulary, its largest tensor.

So a traced step watches every tensor autograd saves in forward (a saved-tensors hook):
a module whose forward saved at least one tensor and none that views one of its
parameters is fetched in forward only. A module whose forward saved nothing this hook saw
(activation checkpointing saves through hooks of its own, which are the innermost) is
fetched as before, and so is one that saved a tensor this hook cannot place. A custom
autograd Function that keeps a weight on its context instead of saving it
(`ctx.save_for_backward`) is hidden from these hooks, as it is from activation
checkpointing's: torch's rule is that tensors go through `save_for_backward`.

The engine's StepRunner (real tensors) and the planner's recording (meta tensors) both use
this class, so the plan forecasts the fetches the engine makes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["BackwardReads"]


def _span(t: torch.Tensor) -> tuple[int, int, int]:
    """(storage, first byte, end byte) of `t` within its storage; the storage named by its
    C++ object, which meta tensors have too (they have no data pointer)."""
    lo = t.storage_offset() * t.element_size()
    return t.untyped_storage()._cdata, lo, lo + t.numel() * t.element_size()


class BackwardReads:
    """The modules (by key) whose backward reads none of their parameters, as the latest
    watched forward showed. `enter(key)` / `leave(key, params)` around each module's
    forward while `watching()` (the parameters it used, borrowed ones included, given as it
    ends); `reads(key)` after: True unless shown otherwise."""

    def __init__(self) -> None:
        self._none: set[int] = set()  # keys whose backward reads no parameter of theirs
        self._judged: set[int] = set()  # keys judged in this watch: a second use adds up
        # The modules running, each with what was saved while it ran: `_span` of each
        # tensor, None for one that could not be placed.
        self._running: list[tuple[int, list[tuple[int, int, int] | None]]] = []
        self._watching = False

    def reads(self, key: int) -> bool:
        return key not in self._none

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Watch the forward run inside: the modules entered anew are judged by it."""
        self._running.clear()
        self._judged.clear()
        self._watching = True
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._saved, _same):
                yield
        finally:
            self._watching = False
            self._running.clear()

    def enter(self, key: int) -> None:
        if self._watching and torch.is_grad_enabled():
            self._running.append((key, []))

    def leave(self, key: int, params: Iterable[torch.Tensor]) -> None:
        if not self._running or self._running[-1][0] != key:
            return
        _, saved = self._running.pop()
        spans = [_span(p) for p in params]
        # Overlapping bytes of the same storage: a view of the parameter, whatever its shape.
        own = any(s is None or any(s[0] == p and s[1] < b and a < max(s[2], s[1] + 1)
                                   for p, a, b in spans)
                  for s in saved)
        if saved and not own and (key in self._none or key not in self._judged):
            self._none.add(key)
        else:
            self._none.discard(key)
        self._judged.add(key)

    def _saved(self, t: torch.Tensor) -> torch.Tensor:
        if self._running:
            try:
                where: tuple[int, int, int] | None = _span(t)
            except (RuntimeError, NotImplementedError):  # no storage to place it by
                where = None
            for _, saved in self._running:
                saved.append(where)
        return t


def _same(t: torch.Tensor) -> torch.Tensor:
    return t
