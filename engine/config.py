"""EngineConfig: every knob of the engine in one place."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from engine.placement.policy import Policy
from engine.sizes import format_size, parse_size

PRECISIONS = ("fp32", "bf16", "fp16")

@dataclass
class EngineConfig:
    """How the engine places, updates and measures a model.

    Optimizer defaults follow torch.optim.AdamW so that a plain-PyTorch loop and the engine
    agree out of the box.
    """

    policy: str = "auto"  # "cuda" | "cpu" | "auto"; see engine.placement.policy
    margin_ratio: float = 0.0  # share of the spare device memory that holds optimizer state
    device_budget: int | str | None = None  # bytes or "6GiB"; None = the whole real GPU
    # Bytes or "16GiB": the host's share of chunk bytes and disk I/O buffers. What does not
    # fit goes to a scratch folder under `disk_dir` (optimizer state first, then payloads;
    # engine.placement.rules.disk_placement). None = no limit: nothing goes to disk.
    host_budget: int | str | None = None
    # Where scratch folders go (one per engine, removed at close); None = $TUITRAIN_CACHE/
    # scratch, else the user cache folder's tuitrain/scratch. Used only if the budget needs it.
    disk_dir: str | Path | None = None
    precision: str = "fp32"  # compute dtype of the chunks; master weights are always fp32
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float | None = None  # global-norm clipping; None = no clipping
    lr_schedule: str = "constant"  # "constant" | "cosine" | "linear" (warm-up then decay)
    warmup_steps: int = 0
    total_steps: int | None = None  # needed by the decaying schedules
    seed: int = 0
    # Micro-batches per optimizer step: step() splits its batch into this many equal parts
    # in order, runs forward and backward on each and sums their gradients, so a batch of
    # N x b sequences trains as it would in one piece, with a micro-batch's memory.
    grad_accum: int = 1
    chunk_size: int | None = None  # elements per chunk; None = searched to waste little
    initial_loss_scale: float = 2.0**16  # fp16 only: dynamic loss scaling starts here
    simulate: bool | None = None  # None = simulate when there is no CUDA
    # Data parallel over torch.distributed (engine.distributed): None = shard the chunks
    # over the ranks whenever torch.distributed is initialized with more than one (torchrun
    # then init_process_group), so the same script runs on one process or many; True =
    # require that; False = never (each process trains a whole model of its own).
    data_parallel: bool | None = None
    # Seconds any one collective may take before it is an error naming the rank and chunk
    # (a dead rank, or ranks that ran different modules), rather than a hang.
    collective_timeout: float = 600.0
    extra: dict = field(default_factory=dict)  # room for callers; never read by the engine

    def __post_init__(self) -> None:
        self.policy = Policy.parse(self.policy).value
        self.margin_ratio = check_margin(self.margin_ratio)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, "
                             f"not {self.precision!r}")
        if self.device_budget is not None:
            self.device_budget = parse_size(self.device_budget)
        if self.host_budget is not None:
            self.host_budget = parse_size(self.host_budget)
            if self.host_budget <= 0:
                raise ValueError("host_budget must be positive")
        if self.disk_dir is not None:
            self.disk_dir = Path(self.disk_dir).expanduser()
        if self.lr <= 0:
            raise ValueError(f"lr must be positive, not {self.lr}")
        self.grad_accum = check_grad_accum(self.grad_accum)
        if self.chunk_size is not None and self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, not {self.chunk_size}")
        if not self.collective_timeout > 0:
            raise ValueError(f"collective_timeout must be positive, not "
                             f"{self.collective_timeout}")
        if self.lr_schedule not in ("constant", "cosine", "linear"):
            raise ValueError(f"lr_schedule must be constant, cosine or linear, "
                             f"not {self.lr_schedule!r}")
        if self.lr_schedule != "constant" and not self.total_steps:
            raise ValueError(f"lr_schedule {self.lr_schedule!r} needs total_steps")

    def lr_at(self, step: int) -> float:
        """Learning rate of optimizer step `step` (counted from 1)."""
        if self.warmup_steps and step <= self.warmup_steps:
            return self.lr * step / self.warmup_steps
        if self.lr_schedule == "constant":
            return self.lr
        import math

        span = max(1, (self.total_steps or step) - self.warmup_steps)
        progress = min(1.0, (step - self.warmup_steps) / span)
        if self.lr_schedule == "linear":
            return self.lr * (1.0 - progress)
        return self.lr * 0.5 * (1.0 + math.cos(math.pi * progress))


def check_margin(value: float) -> float:
    value = float(value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"margin_ratio must be within 0..1, not {value}")
    return value


def check_budget_bytes(value: int | str) -> int:
    """A device budget in bytes from bytes or text ("6GiB"); it must be positive."""
    nbytes = parse_size(value)
    if nbytes <= 0:
        raise ValueError("device_budget must be positive")
    return nbytes


@dataclass(frozen=True)
class LiveSettings:
    """What a running engine lets its caller change between steps.

    One immutable value: a pending change is a new LiveSettings that replaces the live one at
    the next step boundary, so the engine never runs on a half-applied mix.
    """

    policy: Policy
    margin_ratio: float
    device_budget: int
    # How a step is built from its batch: the micro-batches it is split into, in order (the
    # same sequences and the same update whatever their number), and whether the layers
    # recompute their activations in backward. Either one makes the next step trace again.
    grad_accum: int = 1
    activation_checkpointing: bool = False

    def replace(self, *, policy: str | Policy | None = None, margin_ratio: float | None = None,
                device_budget: int | str | None = None, grad_accum: int | None = None,
                activation_checkpointing: bool | None = None) -> LiveSettings:
        """A copy with the given fields changed, each checked here (ValueError if bad)."""
        return LiveSettings(
            policy=self.policy if policy is None else Policy.parse(policy),
            margin_ratio=self.margin_ratio if margin_ratio is None else check_margin(margin_ratio),
            device_budget=(self.device_budget if device_budget is None
                           else check_budget_bytes(device_budget)),
            grad_accum=self.grad_accum if grad_accum is None else check_grad_accum(grad_accum),
            activation_checkpointing=(self.activation_checkpointing
                                      if activation_checkpointing is None
                                      else check_flag(activation_checkpointing)))

    @property
    def shape(self) -> tuple[int, bool]:
        """What a trace depends on among these: (grad_accum, activation_checkpointing)."""
        return self.grad_accum, self.activation_checkpointing

    def changes_from(self, before: LiveSettings) -> list[str]:
        """How each field that differs from `before` is worded (see describe_setting)."""
        return [describe_setting(name, getattr(self, name)) for name in LIVE_FIELDS
                if getattr(self, name) != getattr(before, name)]

    def as_row(self) -> list[float]:
        """The settings as numbers (data parallel: rank 0 sends them to every rank)."""
        return [list(Policy).index(self.policy), self.margin_ratio, self.device_budget,
                self.grad_accum, float(self.activation_checkpointing)]

    @classmethod
    def from_row(cls, row: list[float]) -> LiveSettings:
        """The settings as_row() wrote."""
        return cls(list(Policy)[int(row[0])], row[1], int(row[2]), int(row[3]), bool(row[4]))


LIVE_FIELDS = ("device_budget", "policy", "margin_ratio", "grad_accum",
               "activation_checkpointing")


def check_grad_accum(value: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < 1:
        raise ValueError(f"grad_accum must be a whole number of micro-batches, at least 1, "
                         f"not {value!r}")
    return int(value)


def check_flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"activation_checkpointing must be true or false, not {value!r}")
    return value


def describe_setting(field: str, value: object) -> str:
    """A live setting as every part of the tool words it: "policy cpu", "margin_ratio 0.3",
    "device_budget 4.0 GiB", "grad_accum 4", "activation_checkpointing on"."""
    if field == "device_budget":
        return f"device_budget {format_size(int(value))}"
    if field == "margin_ratio":
        return f"margin_ratio {float(value):g}"
    if field == "policy":
        return f"policy {Policy.parse(value).value}"
    if field == "grad_accum":
        return f"grad_accum {int(value)}"
    if field == "activation_checkpointing":
        return f"activation_checkpointing {'on' if value else 'off'}"
    raise ValueError(f"not a live setting: {field!r}")
