"""Settings: one validated model for a run, shared by the CLI, presets, the worker and the TUI.

Precedence: built-in defaults < preset file < command-line flags.
"""

from __future__ import annotations

import types
from collections.abc import Collection, Mapping
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_core import core_schema

from engine.config import EngineConfig, parse_size
from engine.planning.hardware import HARDWARE

SETTINGS_VERSION = 1  # the `version:` a preset must carry; bumped when a key changes meaning
# The laptop story's GPU: the simulated device's budget when none is given.
SIMULATED_DEVICE_BUDGET = 6 * 1024**3
# The margin ratio is a share of the spare device memory.
MARGIN_RATIO_MIN, MARGIN_RATIO_MAX = 0.0, 1.0
# Holding out more than half of the data leaves less to train on than to judge by.
EVAL_FRACTION_MAX = 0.5
# A week: far past any wait a run has reason for, and well within what the backends' timers
# (and datetime.timedelta) hold.
COLLECTIVE_TIMEOUT_MAX = 7 * 24 * 3600
# LoRA's point is a low rank; past this the adapters of the largest zoo layers outgrow them.
LORA_RANK_MAX = 4096
# A seed is a 64-bit whole number, as torch's generators take it.
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
# What a setting of evaluation says without held-out text to evaluate on.
NOTHING_HELD_OUT = ("nothing is held out to evaluate on: set data.eval_fraction or "
                    "data.eval_path (--eval-fraction F or --eval-data PATH)")


class Size(str):
    """A memory budget as the user wrote it ("5.5GiB"), read once: `nbytes` is its bytes.

    Text, so that a preset keeps what the user wrote; it carries its byte count, so nothing
    after the settings reads the text again. The rule is the engine's parse_size: bytes, or
    a size such as 6GiB or 512MiB. Whether it is enough is the engine's to say.
    """

    nbytes: int

    def __new__(cls, value: object) -> Size:
        if isinstance(value, Size):
            return value
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError(f"not a size: {value!r}")
        return cls._read(str(value), parse_size(value))

    @classmethod
    def of_bytes(cls, nbytes: int) -> Size:
        """`nbytes` written in the largest binary unit that holds it exactly: "6GiB"."""
        for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
            if nbytes % scale == 0:
                return cls._read(f"{nbytes // scale}{unit}", nbytes)
        return cls._read(str(nbytes), nbytes)

    @classmethod
    def _read(cls, text: str, nbytes: int) -> Size:
        size = super().__new__(cls, text)
        size.nbytes = nbytes
        return size

    def __reduce__(self) -> tuple:
        # Pickled (to the worker process, in a deep copy) with its bytes, not read again.
        return (Size._read, (str(self), self.nbytes))

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: object, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        # Plain text in JSON and YAML; a Python dump (merge's) keeps the Size, read once.
        return core_schema.no_info_plain_validator_function(
            cls,
            serialization=core_schema.plain_serializer_function_ser_schema(
                str, return_schema=core_schema.str_schema(), when_used="json"
            ),
        )


HardwareName = Literal[tuple(HARDWARE)]  # type: ignore[valid-type]


class _Strict(BaseModel):
    # No infinity or nan for a number: `lr: .inf` would train to a nan loss from step 2.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_true_or_false_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML's true and false are Python's bools, which pydantic takes for 1 and 0:
        # `batch_size: true` would train one sequence a batch.
        if isinstance(value, bool):
            kinds = _number_kinds(cls.model_fields[info.field_name].annotation)
            if int in kinds:
                raise ValueError(f"must be a whole number (got {_shown(value)})")
            if float in kinds:
                raise ValueError(f"must be a number (got {_shown(value)})")
        return value


def _number_kinds(annotation: object) -> set[type]:
    """int and float among what `annotation` (a field's type, maybe `X | None`) takes, when
    it takes no bool."""
    kinds = set(get_args(annotation)) if get_origin(annotation) in (Union, types.UnionType) \
        else {annotation}
    return set() if bool in kinds else kinds & {int, float}


class EngineSettings(_Strict):
    # "auto" until the run settles it; unless the user gave it (Settings.policy_chosen), the
    # plan's recommendation for this machine replaces it before anything is built.
    policy: Literal["cuda", "cpu", "auto"] = "auto"
    margin_ratio: float = Field(0.0, ge=MARGIN_RATIO_MIN, le=MARGIN_RATIO_MAX)
    # None: the whole GPU on CUDA, SIMULATED_DEVICE_BUDGET on the simulated device.
    device_budget: Size | None = None
    # The host's share of chunk bytes and disk I/O buffers; what does not fit goes to a
    # scratch folder under disk_dir (optimizer state first, then payloads). None: no limit
    # unless the state would not fit this machine's memory (then the run says what it chose).
    host_budget: Size | None = None
    disk_dir: str | None = None  # None: a folder under the user cache folder
    # None: bf16 on a GPU that has it, fp16 on older GPUs; on the simulated device bf16 where
    # the CPU has bf16 units, fp32 elsewhere (engine.devices.device.default_precision).
    precision: Literal["fp32", "bf16", "fp16"] | None = None
    chunk_size: int | None = Field(None, gt=0)  # elements; None = searched
    # Data parallel: seconds a rank waits for the others in any one collective (the
    # engine's, and the ranks' own agreements at step boundaries) before the run fails with
    # a message naming the rank and the operation. A rank that hangs rather than dies costs
    # the others this long; a start or a checkpoint where one rank runs ahead waits too.
    collective_timeout: float = Field(EngineConfig.collective_timeout, gt=0,
                                     le=COLLECTIVE_TIMEOUT_MAX)

    @field_validator("device_budget", "host_budget")
    @classmethod
    def _check_budget(cls, value: Size | None) -> Size | None:
        # No bytes at all is no budget to run in: said here, before anything starts.
        if value is not None and value.nbytes <= 0:
            raise ValueError(f"a budget must be more than 0 bytes (got {str(value)!r})")
        return value


class LoraSettings(_Strict):
    """LoRA adapters (engine.models.lora): the base weights stay frozen, in payload-only
    chunks, and only the adapters train."""

    rank: int = Field(gt=0, le=LORA_RANK_MAX)
    alpha: float | None = Field(None, gt=0)  # None: 2 x rank
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # "all-linear" (every linear layer but the output head), or module names separated by
    # commas, as peft matches them: "q_proj,v_proj" (a preset may list them instead).
    targets: str = "all-linear"

    @field_validator("targets", mode="before")
    @classmethod
    def _targets_from_a_list(cls, value: Any) -> Any:
        # A preset may list the names, as YAML lists things: [q_proj, v_proj].
        if not isinstance(value, list):
            return value
        if value == ["all-linear"]:
            return "all-linear"
        # Each item one module name, as written: not all-linear among names, nor names
        # separated by commas inside one item.
        other = next((name for name in value
                      if not (isinstance(name, str) and _module_name(name))), None)
        if value and other is None:
            return ",".join(value)
        got = f"a list holding {_shown(other)}" if value else "an empty list"
        raise ValueError(f"must be all-linear or module names (got {got})")

    @field_validator("targets")
    @classmethod
    def _check_targets(cls, value: str) -> str:
        names = [n.strip() for n in value.split(",")]
        if value != "all-linear" and not all(_module_name(n) for n in names):
            raise ValueError(f"must be all-linear or module names separated by commas "
                             f"(got {value!r})")
        return value if value == "all-linear" else ",".join(names)

    def as_lora(self) -> Any:
        """The engine's engine.models.lora.Lora for these settings."""
        from engine.models.lora import Lora

        targets = self.targets if self.targets == "all-linear" else tuple(self.targets.split(","))
        return Lora(rank=self.rank, alpha=self.alpha, dropout=self.dropout, targets=targets)


class TrainingSettings(_Strict):
    batch_size: int = Field(2, gt=0)
    seq_len: int = Field(128, gt=1)
    steps: int = Field(200, gt=0)
    lr: float = Field(3e-4, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    max_grad_norm: float | None = Field(None, gt=0)
    seed: int = 0
    # Micro-batches of batch_size sequences per optimizer step: the step's gradient is that
    # of one batch of grad_accum x batch_size sequences, with one micro-batch's memory.
    grad_accum: int = Field(1, gt=0)
    activation_checkpointing: bool = False
    # After warmup_steps of linear warm-up from 0, the rate stays at lr (constant) or decays
    # to 0 at the run's last step (linear, cosine).
    lr_schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    # Loss on the held-out data (data.eval_path or data.eval_fraction) every eval_every steps
    # and after the last; None: after the last step only.
    eval_every: int | None = Field(None, gt=0)
    # Held-out sequences per evaluation, fixed for the run: eval_batches steps' worth
    # (grad_accum x batch_size each), scored a micro-batch at a time.
    eval_batches: int = Field(8, gt=0)
    # Data-parallel ranks on this machine (--nproc): a preset saved from N ranks runs on N.
    nproc: int = Field(1, gt=0)
    lora: LoraSettings | None = None  # None: every parameter trains

    @field_validator("seed")
    @classmethod
    def _check_seed(cls, value: int) -> int:
        if not SEED_MIN <= value <= SEED_MAX:
            raise ValueError(f"must be a 64-bit whole number, within -2**63..2**63-1 "
                             f"(got {value})")
        return value


class DataSettings(_Strict):
    path: str | None = None  # text file, folder, JSONL or `datasets` folder; None = built-in
    text_field: str = Field("text", min_length=1)  # the JSONL field or `datasets` column
    # Held-out text to evaluate on: another corpus (same formats as path), or a share of
    # path's documents (of the built-in corpus when path is None) kept out of training.
    eval_path: str | None = None
    eval_fraction: float | None = Field(None, gt=0, le=EVAL_FRACTION_MAX)


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
    # The GPU a preset was written for, one of the shipped hardware profiles
    # (engine.planning.hardware): `tuitrain plan --preset` plans for it, from its specs,
    # unless --hardware says otherwise. A run trains on the machine it is on. None: this one.
    hardware: HardwareName | None = None
    engine: EngineSettings = Field(default_factory=EngineSettings)
    training: TrainingSettings = Field(default_factory=TrainingSettings)
    data: DataSettings = Field(default_factory=DataSettings)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)

    @model_validator(mode="after")
    def _check_evaluation(self, info: ValidationInfo) -> Settings:
        # Keys of two sections: the one place both are seen. An InvalidSettings raised here
        # keeps its own key (see validate_settings), so a flag's name can replace it.
        if self.data.eval_path is not None and self.data.eval_fraction is not None:
            raise InvalidSettings(
                "data.eval_fraction",
                "give data.eval_path or data.eval_fraction, not both (held-out text comes "
                "from another corpus or from a share of this one)",
            )
        if self.evaluates:
            return self
        if self.training.eval_every is not None:
            raise InvalidSettings("training.eval_every", NOTHING_HELD_OUT)
        # A saved preset writes every key, this one too, with its default: only a value the
        # user chose (another number, or any typed as a flag) asks for evaluations that
        # would never run.
        typed = (info.context or {}).get("typed", ())
        if "training.eval_batches" in typed or self.changed("training.eval_batches"):
            raise InvalidSettings("training.eval_batches", NOTHING_HELD_OUT)
        return self

    def changed(self, key: str) -> bool:
        """Whether the dotted settings `key` holds other than its built-in default."""
        *sections, name = key.split(".")
        owner: BaseModel = self
        for section in sections:
            owner = getattr(owner, section)
            if owner is None:  # a section left out (training.lora): nothing in it was set
                return False
        field = type(owner).model_fields[name]
        return getattr(owner, name) != field.get_default(call_default_factory=True)

    @property
    def evaluates(self) -> bool:
        """Whether the run measures its loss on held-out text."""
        return self.data.eval_path is not None or self.data.eval_fraction is not None

    @property
    def policy_chosen(self) -> bool:
        """Whether the user gave the policy (a flag, a preset key): one left unset is the
        run's to choose, and it takes the plan's recommendation (tuitrain.fit.settle)."""
        return "policy" in self.engine.model_fields_set

    def lora(self) -> Any:
        """The run's LoRA adapters (engine.models.lora.Lora), None when every parameter
        trains."""
        return self.training.lora.as_lora() if self.training.lora is not None else None

    def precision_for(self, simulated: bool) -> str:
        """The compute precision: the one asked for, else the best for this device."""
        if self.engine.precision is not None:
            return self.engine.precision
        from engine.devices.device import default_precision

        return default_precision(cuda=not simulated)

    def device_budget_for(self, simulated: bool) -> int | None:
        """The device budget in bytes: the one asked for, else SIMULATED_DEVICE_BUDGET on
        the simulated device, else None (the whole GPU)."""
        if self.engine.device_budget is not None:
            return self.engine.device_budget.nbytes
        return SIMULATED_DEVICE_BUDGET if simulated else None

    def as_used(self, *, precision: str, device_budget: int | None) -> Settings:
        """A copy with the precision and the device budget a run resolved, so that it runs
        the same again on another machine; a budget the user gave keeps their spelling."""
        update: dict[str, object] = {"precision": precision}
        if self.engine.device_budget is None and device_budget is not None:
            update["device_budget"] = Size.of_bytes(device_budget)
        return self.model_copy(update={"engine": self.engine.model_copy(update=update)})


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


def check_engine_setting(field: str, value: object) -> Any:
    """`value` for the engine setting `field` (a key of EngineSettings), checked by the rules a
    preset or a flag is: for a value typed on the screen. Raises InvalidSettings."""
    try:
        return getattr(EngineSettings.model_validate({field: value}), field)
    except ValidationError as error:
        first = error.errors()[0]
        raise InvalidSettings(field, describe_error({**first, "loc": ("engine", field)})) from None


def validate_settings(data: Mapping[str, Any], *, typed: Collection[str] = ()) -> Settings:
    """Settings from plain data (a parsed preset, a merged dump), or InvalidSettings.

    `typed`: the dotted keys the user typed on the command line. A value given so is the
    user's choice whatever it is; in a preset, which a saved one writes whole, only a value
    other than the default is (Settings._check_evaluation).

    Only the first problem is reported in full: one clear line beats a page of them, and the
    count of the rest tells the user there is more to fix.
    """
    try:
        return Settings.model_validate(data, context={"typed": frozenset(typed)})
    except ValidationError as error:
        errors = error.errors()
        first = errors[0]
        own = (first.get("ctx") or {}).get("error")
        if isinstance(own, InvalidSettings):  # a check across keys names its own key
            raise InvalidSettings(own.key, own.problem, more=len(errors) - 1) from None
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
        if loc[-2:] == ("lora", "rank"):
            return "missing (the rank, which any other LoRA setting needs)"
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
    elif kind == "finite_number":
        problem = "must be a finite number"
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


def _module_name(name: str) -> bool:
    """Whether `name` can name a module (or a dotted path to one) as peft matches it."""
    return name.replace("_", "").replace(".", "").isalnum()


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
