"""SettingChanges: the Engine's settings, changed by its caller while it trains.

A change (set_policy, set_margin, set_budget, set_grad_accum, set_checkpointing) is
checked as it is staged: its value by LiveSettings (engine.config), a micro-batch split
against the latest batch, and the budget it leaves against the latest trace
(rules.check_budget), so that a bad one is refused to the caller at once. It then waits as
the pending settings, one immutable value, and replaces the live ones at the next step
boundary (`_apply_pending`): the chunks are placed again for them (`_place`,
rules.resident_chunks) and the next step counts its bytes again (engine.step.counting).
The budget is checked again against each trace a step records, as the micro-batch that
recorded it ends (`_end_trace`): a change that makes the step trace anew (a split,
checkpointing), or the first step, is refused there, BudgetTooSmall, if that micro-batch
overran it or a later one would (cuda, whose later micro-batches peak beside every
gradient); restore_settings(before) goes back.
Data parallel, rank 0's pending settings are every rank's (engine.step.rank_zero).

A part of engine.step.engine.Engine over the engine's state, as the chunk manager's parts
are of it (engine.chunks.manager).
"""

from __future__ import annotations

import torch

from engine.chunks.chunk import Chunk
from engine.chunks.manager import ChunkManager
from engine.config import LiveSettings, describe_setting
from engine.devices.device import ComputeDevice
from engine.distributed import Collectives
from engine.placement import rules
from engine.placement.policy import Policy
from engine.step import activation_checkpointing as checkpointing
from engine.step.micro_batches import check_split
from engine.step.optimizer import ChunkAdamW
from engine.step.overrun import overrun_error
from engine.step.runner import StepRunner

__all__ = ["SettingChanges"]


class SettingChanges:
    """The Engine's settings changes and the placement they ask for; see the module doc."""

    # The engine's state it reads and changes (engine.step.engine.Engine sets it).
    model: torch.nn.Module
    chunks: list[Chunk]
    device: ComputeDevice
    manager: ChunkManager
    runner: StepRunner
    collectives: Collectives | None
    optimizer: ChunkAdamW
    policy: str  # the live policy's name
    settings: LiveSettings  # the live settings
    _pending: LiveSettings | None  # replaces settings at the next step
    _rows: int | None  # sequences in the latest step's batch

    # --- staged, applied at the next step boundary --------------------------------------------

    def set_policy(self, policy: str | Policy) -> str:
        """Switch placement at the next step. Raises ValueError if it cannot fit.

        Returns the change as the engine words it when it applies it ("policy cpu")."""
        return self._stage("policy", policy)

    def set_margin(self, ratio: float) -> str:
        """Share (0..1) of the spare device memory that keeps optimizer state there."""
        return self._stage("margin_ratio", ratio)

    def set_budget(self, budget: int | str) -> str:
        """Change the device budget at the next step. Raises ValueError if it is too small."""
        return self._stage("device_budget", budget)

    def set_grad_accum(self, grad_accum: int) -> str:
        """Micro-batches per step from the next step (the same sequences and update); a
        ValueError if the latest batch does not split so. Traced anew at its first step, which
        checks the budget: BudgetTooSmall if it overruns; restore_settings(before) goes back."""
        return self._stage("grad_accum", grad_accum)

    def set_checkpointing(self, on: bool) -> str:
        """Recompute the layers' activations in backward (True) from the next step, or not."""
        return self._stage("activation_checkpointing", on)

    @property
    def staged(self) -> LiveSettings:
        """The settings the next step runs with: the live ones and what is staged."""
        return self._pending or self.settings

    def restore_settings(self, settings: LiveSettings) -> None:
        self._pending = settings

    def _stage(self, field: str, value: object) -> str:
        self.settings = checkpointing.as_the_model_has_it(self.settings, self.model)
        wanted = self.staged.replace(**{field: value})
        check_split(self._rows, wanted.grad_accum)
        if wanted.shape == self.settings.shape:  # else the trace is another shape's
            self._check_budget(wanted.device_budget, wanted.policy)
        self.manager.open_disk_tier(wanted.policy)  # one started under cuda may need it now
        self._pending = wanted
        return describe_setting(field, getattr(wanted, field))

    # --- the budget and the placement ---------------------------------------------------------

    def _check_budget(self, budget: int, policy: Policy) -> None:
        budget = self.device.capacity(budget)  # on a GPU, what it leaves the engine
        costs = [self.manager.resident_cost(c) for c in self.chunks]
        rules.check_budget(budget, policy, trace=self.runner.trace,
                           module_bytes=self._module_bytes(), resident_costs=costs,
                           sharded=self.collectives is not None)

    def _module_bytes(self) -> list[int]:
        return [sum(c.nbytes for c in cs) for cs in self.runner.module_chunks.values()]

    def min_working_set(self) -> int:
        """Least device bytes a step needs under any placement."""
        return rules.minimum_working_set(self.runner.trace, self._module_bytes())

    def _apply_pending(self) -> list[str]:
        if self._pending is None:
            return []
        wanted, self._pending = self._pending, None
        applied = wanted.changes_from(self.settings)
        self.settings = wanted
        self.device.set_budget(wanted.device_budget)
        self.manager.set_policy(wanted.policy)
        checkpointing.set_checkpointing(self.model, wanted.activation_checkpointing)  # traced anew
        if applied:
            self._place()
            self.runner.counts.forget()
        return applied

    def _place(self, *, margin: bool = True) -> None:
        """Make resident what the policy and the margin ask for (rules.resident_chunks)."""
        want = rules.resident_chunks(
            self.settings.policy, [self.manager.resident_cost(c) for c in self.chunks],
            trace=self.runner.trace, capacity=self.device.capacity(),
            margin_ratio=self.settings.margin_ratio if margin else 0.0)
        self.manager.apply_residency(want)

    def _end_trace(self) -> bool:
        """Close this step's trace, if it recorded one; refuse a budget it overran, or one
        that a later micro-batch would overrun (rules.cuda_peaks_beside_gradients: its
        peak is not the traced one's), before that one runs. Not with ranks: there the
        need (shards beside the whole working set) is a bound above the peak, which the
        plan holds a run to before it starts, and each rank's own capacity could refuse on
        one rank while the others wait in the next micro-batch's collectives."""
        trace = self.runner.end_trace()
        overrun = self.manager.overrun  # data parallel: every rank's, once the trace is
        if trace is None:
            return False
        try:
            if overrun > 0 or trace.working_set > self.device.capacity():
                raise overrun_error(trace, self.device.capacity(), overrun, self.policy)
            if self.collectives is None and rules.cuda_peaks_beside_gradients(
                    self.settings.grad_accum):
                self._check_budget(self.settings.device_budget, self.settings.policy)
        except rules.BudgetTooSmall:
            for chunk in self.chunks:
                self.optimizer.discard(chunk)
            self._place()
            raise
        return True
