"""What the tuner's search (tuitrain.tune) ranges over: a candidate setting of a running
run, the space of them at the run's global batch, and a candidate's forecast (does it fit,
and how fast; tuitrain.tune_plan makes them)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Candidate", "Forecast", "Forecaster", "candidates"]


@dataclass(frozen=True)
class Candidate:
    """One setting of the run, at the run's global batch (batch_size x grad_accum)."""

    policy: str
    margin_ratio: float
    batch_size: int  # sequences per micro-batch
    grad_accum: int
    activation_checkpointing: bool
    device_budget: int
    host_budget: int | None = None

    def settings(self) -> dict[str, dict[str, object]]:
        """The setting under the keys of a preset's `engine:` and `training:` sections."""
        engine: dict[str, object] = {"policy": self.policy, "margin_ratio": self.margin_ratio,
                                     "device_budget": self.device_budget}
        if self.host_budget is not None:
            engine["host_budget"] = self.host_budget
        return {"engine": engine,
                "training": {"batch_size": self.batch_size, "grad_accum": self.grad_accum,
                             "activation_checkpointing": self.activation_checkpointing}}

    def describe(self) -> str:
        ckpt = ", checkpointing" if self.activation_checkpointing else ""
        return (f"{self.policy} margin {self.margin_ratio:.2f}, {self.batch_size} x "
                f"{self.grad_accum}{ckpt}")


def candidates(*, global_batch: int, device_budgets: Iterable[int],
               policies: Iterable[str] = ("cuda", "auto", "cpu"),
               margins: Iterable[float] = (0.0, 0.5, 1.0),
               checkpointing: Iterable[bool] = (False, True),
               host_budget: int | None = None) -> list[Candidate]:
    """The space: every policy, margin, split of the global batch into micro-batches,
    activation checkpointing and device budget. cuda keeps every chunk on the device, so
    its margin is moot: one candidate per other choice."""
    splits = [(global_batch // accum, accum) for accum in range(1, global_batch + 1)
              if global_batch % accum == 0]
    out: list[Candidate] = []
    for budget in device_budgets:
        for policy in policies:
            for margin in ((0.0,) if policy == "cuda" else tuple(margins)):
                for micro, accum in splits:
                    for ckpt in checkpointing:
                        out.append(Candidate(policy, margin, micro, accum, ckpt, budget,
                                             host_budget))
    return out


@dataclass(frozen=True)
class Forecast:
    fits: bool
    seconds: float  # predicted seconds per step (meaningless when it does not fit)
    reason: str = ""  # why it does not fit: which budget, by how much
    over: str = ""  # the same in a few words: which budget and how much more it needs


class Forecaster(Protocol):
    def __call__(self, candidate: Candidate) -> Forecast: ...
