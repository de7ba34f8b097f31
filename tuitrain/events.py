"""The two one-way channels between the UI and the worker.

Commands go UI -> worker, each with an id, and are answered by Applied(id, step) or
Rejected(id, reason). Events go worker -> UI. All are small picklable dataclasses.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.telemetry import ChunkInfo, StepStats

# --- commands (UI -> worker) -------------------------------------------------------------


@dataclass(frozen=True)
class Command:
    id: int = -1  # assigned by the client when sent


@dataclass(frozen=True)
class SetPolicy(Command):
    policy: str = "auto"


@dataclass(frozen=True)
class SetMargin(Command):
    margin_ratio: float = 0.0


@dataclass(frozen=True)
class SetBudget(Command):
    device_budget: int | str = "6GiB"  # bytes, or a size as the user wrote it (Size)


@dataclass(frozen=True)
class SetShape(Command):
    """How the run builds a step from its global batch, from the next step: micro-batches
    of `batch_size` sequences, `grad_accum` of them (their product is the run's global
    batch, which never changes: the same sequences, the same update), and whether layers
    recompute their activations in backward. A field left None keeps its value; one of
    batch_size and grad_accum gives the other."""

    batch_size: int | None = None
    grad_accum: int | None = None
    activation_checkpointing: bool | None = None


@dataclass(frozen=True)
class Pause(Command):
    pass


@dataclass(frozen=True)
class Resume(Command):
    pass


@dataclass(frozen=True)
class Stop(Command):
    pass


@dataclass(frozen=True)
class Checkpoint(Command):
    pass


# --- events (worker -> UI) ---------------------------------------------------------------


@dataclass
class Event:
    pass


@dataclass
class Started(Event):
    model: str
    parameters: int  # unique parameter elements
    device: str  # e.g. "simulated, 6.0 GiB" or "NVIDIA GeForce RTX 3060, 6.0 GiB"
    chunks: list[ChunkInfo]
    settings: dict  # the settings actually used (Settings.as_used, dumped)
    pid: int = 0
    log_path: str = ""
    device_budget: int | None = None  # bytes the engine got; None: the whole GPU
    ranks: int = 1  # processes training the run data parallel (rank 0 reports); 1: one
    trainable: int | None = None  # parameter elements that train (LoRA's adapters); None: all


@dataclass
class Step(Event):
    stats: StepStats
    time: float = 0.0  # wall clock (time.time()) when the step ended in the worker


@dataclass
class RankStep(Event):
    """A step as a rank other than 0 of a data-parallel run saw it: its own memory above all
    (its shards, its gathers, its process), which rank 0's Step does not tell."""

    rank: int
    stats: StepStats


@dataclass
class Log(Event):
    message: str
    level: str = "info"  # "info" | "warning" | "error"


@dataclass
class Applied(Event):
    id: int
    step: int  # the first step that ran with the change (or the step after which it acted)
    # What was done: "paused", "checkpoint <path>", or a setting as the engine words it
    # (engine.config.describe_setting), e.g. "policy cpu".
    what: str = ""


@dataclass
class Rejected(Event):
    id: int
    reason: str

    @property
    def too_late(self) -> bool:
        """Whether the command came after the run's last step, which the run ends as it is."""
        return self.reason == TRAINING_FINISHED


TRAINING_FINISHED = "training has finished"  # why a command after the last step is refused
STEP_NOT_KEPT = "; nothing of it was kept"  # how the worker's word on a step cut short ends


@dataclass
class Failed(Event):
    reason: str
    exitcode: int | None = None  # process exit code; negative = killed by that signal
    log_tail: list[str] = field(default_factory=list)
    rank: int | None = None  # data parallel: the rank that failed (None: a single process)
    log_path: str = ""  # that rank's log, when it is not the run's (rank 0's)


@dataclass
class Finished(Event):
    summary: dict  # steps, tokens, mean step seconds, peak device/host bytes, ...


@dataclass
class Eval(Event):
    """The loss on the held-out text after a step, with no gradient and no update."""

    step: int  # the optimizer step it was measured after
    loss: float  # mean over every predicted token of the fixed evaluation batches
    perplexity: float  # exp(loss)
    tokens: int  # tokens in those batches
    seconds: float = 0.0  # how long the evaluation took
