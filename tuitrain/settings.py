"""Settings: one validated model for a run, shared by the CLI, presets, the worker and the TUI.

Precedence: built-in defaults < preset file < command-line flags.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.fields import FieldInfo

from engine.config import parse_size

SETTINGS_VERSION = 1  # the `version:` a preset must carry; bumped when a key changes meaning


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class EngineSettings(_Strict):
    policy: Literal["cuda", "cpu", "auto"] = "auto"
    margin_ratio: float = Field(0.0, ge=0.0, le=1.0)
    # None: the whole GPU on CUDA, 6 GiB (the laptop story) on the simulated device.
    device_budget: str | None = None
    # None: bf16 on a GPU that has it, fp16 on older GPUs, fp32 on the simulated device
    # (CPUs without bf16 units run bf16 matmuls several times slower than fp32).
    precision: Literal["fp32", "bf16", "fp16"] | None = None
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

    def precision_for(self, simulated: bool) -> str:
        """The compute precision: the one asked for, else the best for this device."""
        if self.engine.precision is not None:
            return self.engine.precision
        if simulated:
            return "fp32"
        import torch

        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"

    def budget_bytes(self, simulated: bool) -> int | None:
        """The device budget in bytes; the laptop's 6 GiB when simulating with none given."""
        if self.engine.device_budget is not None:
            return parse_size(self.engine.device_budget)
        return 6 * 1024**3 if simulated else None


class InvalidSettings(ValueError):
    """A settings value that does not validate; `key` is its dotted path, e.g. engine.margin_ratio.

    The message is one line, `<key>: <problem>`, so that callers can prefix a file name or swap
    the key for the command-line flag that set it.
    """

    def __init__(self, key: str, problem: str, *, more: int = 0) -> None:
        self.key = key
        self.problem = problem
        self.more = more  # further errors left out of the message
        tail = f" (and {more} more)" if more else ""
        super().__init__(f"{key}: {problem}{tail}")


def validate_settings(data: Mapping[str, Any]) -> Settings:
    """Settings from plain data (a parsed preset, a merged dump), or InvalidSettings.

    Only the first problem is reported in full: one clear line beats a page of them, and the
    count of the rest tells the user there is more to fix.
    """
    try:
        return Settings.model_validate(data)
    except ValidationError as error:
        errors = error.errors()
        first = errors[0]
        key = ".".join(str(part) for part in first["loc"]) or "(top level)"
        raise InvalidSettings(key, describe_error(first), more=len(errors) - 1) from None


_COMPARISONS = {
    "greater_than": "greater than",
    "greater_than_equal": "at least",
    "less_than": "less than",
    "less_than_equal": "at most",
}


def describe_error(error: Mapping[str, Any]) -> str:
    """A short, human sentence for one pydantic error (one item of ValidationError.errors())."""
    kind = error["type"]
    loc = tuple(error["loc"])
    ctx = error.get("ctx") or {}
    got = error.get("input")
    if kind == "extra_forbidden":
        owner = _model_at(loc[:-1])
        known = ", ".join(owner.model_fields) if owner else ""
        return f"unknown key (known: {known})" if known else "unknown key"
    if kind == "missing":
        return "missing"
    if loc == ("version",):
        return (
            f"unsupported preset version {_shown(got)} "
            f"(this tuitrain reads version {SETTINGS_VERSION})"
        )
    if kind in _COMPARISONS:
        bounds = _bounds(loc)
        if bounds is not None:
            problem = f"must be within {bounds[0]:g}..{bounds[1]:g}"
        else:
            problem = f"must be {_COMPARISONS[kind]} {next(iter(ctx.values()))}"
    elif kind == "literal_error":
        problem = f"must be {ctx.get('expected', 'one of the allowed values')}"
    elif kind in ("int_parsing", "int_type", "int_from_float"):
        problem = "must be a whole number"
    elif kind in ("float_parsing", "float_type"):
        problem = "must be a number"
    elif kind in ("bool_parsing", "bool_type"):
        problem = "must be true or false"
    elif kind == "string_type":
        problem = "must be text"
    elif kind in ("model_type", "model_attributes_type", "dict_type"):
        problem = "must be a mapping of keys to values"
    elif kind == "value_error" and "error" in ctx:
        return str(ctx["error"])  # our own validators already name the value
    else:
        problem = str(error.get("msg", kind))
    return f"{problem} (got {_shown(got)})"


def _shown(value: object) -> str:
    """The offending value as the user wrote it, short."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _model_at(loc: tuple) -> type[BaseModel] | None:
    """The settings model found by walking `loc` from Settings, or None past a leaf."""
    model: type[BaseModel] = Settings
    for part in loc:
        field = model.model_fields.get(str(part))
        if field is None or not _is_model(field.annotation):
            return None
        model = field.annotation
    return model


def _is_model(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _bounds(loc: tuple) -> tuple[float, float] | None:
    """(low, high) when the field at `loc` has both an inclusive lower and upper bound."""
    owner = _model_at(loc[:-1])
    field: FieldInfo | None = owner.model_fields.get(str(loc[-1])) if owner else None
    if field is None:
        return None
    low = next((m.ge for m in field.metadata if isinstance(m, annotated_types.Ge)), None)
    high = next((m.le for m in field.metadata if isinstance(m, annotated_types.Le)), None)
    if low is None or high is None:
        return None
    return float(low), float(high)
