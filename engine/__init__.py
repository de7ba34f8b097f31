"""The offload engine: train a model larger than the device by moving parameter chunks.

Stands alone: it never imports the application or any UI.
"""

from engine.config import EngineConfig, format_size, parse_size
from engine.engine import Engine
from engine.policy import Policy
from engine.state import TensorState
from engine.telemetry import ChunkInfo, MemorySnapshot, StepStats

__all__ = [
    "ChunkInfo",
    "Engine",
    "EngineConfig",
    "MemorySnapshot",
    "Policy",
    "StepStats",
    "TensorState",
    "format_size",
    "parse_size",
]
