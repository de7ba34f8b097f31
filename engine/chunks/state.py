"""TensorState: the life of one parameter during a step, and the legal moves between states.

An illegal transition is a bug in the engine: it raises, it is never ignored.
"""

from __future__ import annotations

from enum import Enum


class TensorState(str, Enum):
    FREE = "FREE"  # payload not materialised on the compute device
    HOLD = "HOLD"  # materialised, not in use
    COMPUTE = "COMPUTE"  # in use by the running module
    HOLD_AFTER_FWD = "HOLD_AFTER_FWD"  # used in this forward, may be released
    HOLD_AFTER_BWD = "HOLD_AFTER_BWD"  # gradient taken in this backward, may be released


S = TensorState
# COMPUTE -> COMPUTE: a module re-entered while in use (activation checkpointing recomputes
# a forward inside the backward of the same block).
TRANSITIONS: dict[TensorState, frozenset[TensorState]] = {
    S.FREE: frozenset({S.HOLD}),
    S.HOLD: frozenset({S.FREE, S.COMPUTE, S.HOLD}),
    S.COMPUTE: frozenset({S.COMPUTE, S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD, S.HOLD}),
    S.HOLD_AFTER_FWD: frozenset({S.COMPUTE, S.HOLD, S.FREE, S.HOLD_AFTER_BWD}),
    S.HOLD_AFTER_BWD: frozenset({S.HOLD, S.FREE, S.COMPUTE}),
}

# Most active first: the state a chunk shows is the first of these that any param has.
ACTIVITY = (S.COMPUTE, S.HOLD_AFTER_FWD, S.HOLD_AFTER_BWD, S.HOLD, S.FREE)


class IllegalTransition(RuntimeError):
    pass


def check_transition(name: str, old: TensorState, new: TensorState) -> None:
    if new not in TRANSITIONS[old]:
        raise IllegalTransition(f"parameter {name}: {old.value} -> {new.value} is not allowed")
