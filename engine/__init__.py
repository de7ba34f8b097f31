"""The offload engine: train a model larger than the device by moving parameter chunks.

Stands alone: it never imports the application or any UI. `Engine` (and with it torch and
transformers) is imported on first use, so that reading the small modules (config,
telemetry, policy, state) stays cheap for a UI process that never trains.
"""

from typing import TYPE_CHECKING

from engine.chunks.state import TensorState
from engine.config import EngineConfig, format_size, parse_size
from engine.placement.policy import Policy
from engine.telemetry import ChunkInfo, MemorySnapshot, StepStats, TimelinePoint

if TYPE_CHECKING:
    from engine.distributed.collectives import CollectiveError
    from engine.step.engine import Engine

__all__ = [
    "ChunkInfo",
    "CollectiveError",
    "Engine",
    "EngineConfig",
    "MemorySnapshot",
    "Policy",
    "StepStats",
    "TensorState",
    "TimelinePoint",
    "format_size",
    "parse_size",
]


def __getattr__(name: str) -> object:
    if name == "Engine":
        from engine.step.engine import Engine

        return Engine
    if name == "CollectiveError":  # data parallel: a collective failed or timed out
        from engine.distributed.collectives import CollectiveError

        return CollectiveError
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
