"""Settings: one validated model for a run, shared by the CLI, presets, the worker and the TUI.

Precedence: built-in defaults < preset file < command-line flags.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.config import parse_size


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EngineSettings(_Strict):
    policy: Literal["cuda", "cpu", "auto"] = "auto"
    margin_ratio: float = Field(0.0, ge=0.0, le=1.0)
    # None: the whole GPU on CUDA, 6 GiB (the laptop story) on the simulated device.
    device_budget: str | None = None
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    chunk_size: int | None = Field(None, gt=0)  # elements; None = searched

    @field_validator("device_budget", mode="before")
    @classmethod
    def _budget(cls, value: object) -> str | None:
        if value is None:
            return None
        parse_size(value)  # raises ValueError naming the text
        return str(value)


class TrainingSettings(_Strict):
    batch_size: int = Field(2, gt=0)
    seq_len: int = Field(128, gt=1)
    steps: int = Field(200, gt=0)
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    max_grad_norm: float | None = Field(None, gt=0)
    seed: int = 0
    grad_accum: int = Field(1, gt=0)
    activation_checkpointing: bool = False


class DataSettings(_Strict):
    path: str | None = None  # text file, folder, JSONL or `datasets` folder; None = built-in


class LoggingSettings(_Strict):
    metrics: str | None = None  # JSONL file, one StepStats per line
    every: int = Field(1, gt=0)


class CheckpointSettings(_Strict):
    dir: str | None = None
    every: int | None = Field(None, gt=0)
    resume: str | None = None


class Settings(_Strict):
    version: Literal[1] = 1
    model: str = "opt-125m"
    engine: EngineSettings = Field(default_factory=EngineSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    data: DataSettings = Field(default_factory=DataSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)

    def budget_bytes(self, simulated: bool) -> int | None:
        """The device budget in bytes; the laptop's 6 GiB when simulating with none given."""
        if self.engine.device_budget is not None:
            return parse_size(self.engine.device_budget)
        return 6 * 1024**3 if simulated else None
