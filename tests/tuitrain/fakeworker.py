"""FakeWorker: a scripted stand-in for the training process, so the UI can be driven in tests.

It speaks the same protocol as the real worker (tuitrain.client.WorkerClient): events come
from a script instead of an engine, and commands are answered the way the worker answers
them. Everything is a pure function of the script and the commands, never of the clock, so
a screen drawn from it is the same on every run.

The helpers `fake_stats`, `fake_started` and `fake_run` make plausible telemetry (memory
split by policy, chunk placement, the step interval by interval, time split, a decaying
loss; under a host budget, the disk tier's bytes and I/O) for screens and demos.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator

from engine.chunks.state import TensorState
from engine.config import LiveSettings, describe_setting, format_size
from engine.placement.policy import Policy
from engine.telemetry import ChunkInfo, MemorySnapshot, StepStats, TimelinePoint
from tuitrain.events import (
    Applied,
    Checkpoint,
    Command,
    Event,
    Failed,
    Finished,
    Pause,
    RankStep,
    Rejected,
    Resume,
    SetBudget,
    SetMargin,
    SetPolicy,
    SetShape,
    Started,
    Step,
    Stop,
)

GiB = 1024**3
MiB = 1024**2

# A script yields events; a None means "time passes here": the current poll ends.
Script = Iterable[Event | None] | Callable[[], Iterable[Event | None]]

# Parameters (tensors) packed in each chunk: a transformer layer's dozen or so, roughly.
TENSORS_PER_CHUNK = 8
# Bytes per parameter element of optimizer-side data: fp32 master + two AdamW moments + a bf16 grad.
_OPTIMIZER_BYTES_PER_PARAM = 4 + 4 + 4 + 2
# The engine's own checks of a live setting, asked of a value that stands for no run.
_LIVE = LiveSettings(policy=Policy.AUTO, margin_ratio=0.0, device_budget=1)
# Chunks a step under cpu or auto holds besides the resident ones: the one in use, the
# next one prefetched, and the gradient buffer on its way home.
_TRANSIENT_CHUNKS = 3
# Throughputs that make the time split look like a laptop GPU on PCIe 3.
_DEVICE_FLOPS = 5e12
_HOST_ADAM_BYTES_PER_S = 20e9
_PCIE_BYTES_PER_S = 12e9
# The disk tier of a laptop's NVMe: its I/O buffers (three state pieces of 4M elements'
# fp32 master and moments, four bf16 payload pieces) and its speed. Its I/O overlaps the
# compute and the update; the step waits for the rest.
_STATE_BUFFERS = 3 * 48 * MiB
_PAYLOAD_BUFFERS = 4 * 8 * MiB
_DISK_BYTES_PER_S = 2.5e9


class FakeWorker:
    """A WorkerClient that plays a script of events and records every command it receives.

    Args:
        script: the events to play, in order: a list, a generator, or a callable returning
            one (called at start()). A None in the script ends the current poll, which is
            how a generator says "the next events come later".
        steps_per_poll: how many Step events one poll() delivers at most (default 1, like a
            worker slower than the UI's timer). Events queued with `emit` come after the
            script.
        restep: how a scripted step looks under the settings changed so far: called with
            the scripted stats and the changed settings (policy, margin_ratio, device_budget
            in bytes). Default: the scripted stats with the new values written in, their
            memory and timings unchanged; `follow_settings` redraws them with fake_stats,
            so that each setting tried measures differently.

    Commands are answered as the real worker answers them: SetPolicy/SetMargin/SetBudget are
    Applied at the next scripted Step, whose stats (and all later ones) carry the new value;
    a bad value is Rejected at once; Pause/Resume/Checkpoint are Applied at once with the
    last step; Stop is Applied and followed by Finished. While paused no Step is delivered.
    A RankStep (another rank of a data-parallel run) carries the settings changed so far,
    as that rank takes them at the same step.
    """

    def __init__(
        self,
        script: Script = (),
        *,
        steps_per_poll: int = 1,
        restep: Callable[[StepStats, dict[str, object]], StepStats] | None = None,
    ) -> None:
        if steps_per_poll < 1:
            raise ValueError(f"steps_per_poll must be at least 1, not {steps_per_poll}")
        self.commands: list[Command] = []
        self.started = False
        self.stop_calls = 0
        self.steps_per_poll = steps_per_poll
        self.restep = restep
        self._source = script
        self._script: Iterator[Event | None] = iter(())
        self._emitted: deque[Event] = deque()
        self._answers: deque[Event] = deque()
        self._waiting: list[tuple[Command, str, object]] = []  # (command, field, value)
        self._overrides: dict[str, object] = {}
        self._shape: dict[str, object] = {}  # StepStats fields a SetShape set
        self._paused = False
        self._alive = False
        self._last_step = 0
        self._next_id = 1

    # --- WorkerClient ---------------------------------------------------------------------

    def start(self) -> None:
        if self.started:
            return
        self.started = True
        self._alive = True
        source = self._source() if callable(self._source) else self._source
        self._script = iter(source)

    def send(self, command: Command) -> int:
        command = dataclasses.replace(command, id=self._next_id)
        self._next_id += 1
        self.commands.append(command)
        if self._alive:
            self._answer(command)
        return command.id

    def poll(self) -> list[Event]:
        if not self.started:
            return []
        out: list[Event] = list(self._answers)
        self._answers.clear()
        if any(isinstance(event, Finished) for event in out):
            self._alive = False  # a Stop was answered: no step runs after it
        steps = 0
        while self._alive and not self._paused and steps < self.steps_per_poll:
            event = self._next_event()
            if event is None:
                break
            if isinstance(event, Step):
                event = self._apply_waiting(event, out)
                steps += 1
            elif isinstance(event, RankStep) and self._overrides:
                event = RankStep(event.rank, dataclasses.replace(event.stats, **self._overrides))
            out.append(event)
            if isinstance(event, Finished | Failed):
                self._alive = False
        return out

    def stop(self, timeout: float = 5.0) -> None:
        self.stop_calls += 1
        self._alive = False

    @property
    def alive(self) -> bool:
        return self._alive

    # --- for tests ------------------------------------------------------------------------

    def emit(self, *events: Event) -> None:
        """Queue more events, delivered after the script by later polls."""
        self._emitted.extend(events)

    @property
    def paused(self) -> bool:
        return self._paused

    # --- internals ------------------------------------------------------------------------

    def _next_event(self) -> Event | None:
        for event in self._script:
            return event
        if self._emitted:
            return self._emitted.popleft()
        return None

    def _answer(self, command: Command) -> None:
        try:
            if isinstance(command, SetPolicy):
                self._stage(command, "policy", command.policy)
            elif isinstance(command, SetMargin):
                self._stage(command, "margin_ratio", command.margin_ratio)
            elif isinstance(command, SetBudget):
                self._stage(command, "device_budget", command.device_budget)
            elif isinstance(command, SetShape):
                accum = command.grad_accum or 1
                self._waiting.append((command, "shape", {
                    "micro_batches": accum,
                    "activation_checkpointing": bool(command.activation_checkpointing)}))
            elif isinstance(command, Pause):
                self._paused = True
                self._answers.append(Applied(command.id, self._last_step, "paused"))
            elif isinstance(command, Resume):
                self._paused = False
                self._answers.append(Applied(command.id, self._last_step, "resumed"))
            elif isinstance(command, Checkpoint):
                what = f"checkpoint at step {self._last_step}"
                self._answers.append(Applied(command.id, self._last_step, what))
            elif isinstance(command, Stop):
                self._answers.append(Applied(command.id, self._last_step, "stop"))
                self._answers.append(Finished({"steps": self._last_step, "stopped": True}))
                self._paused = False
            else:
                self._answers.append(Rejected(command.id, f"unknown command {command!r}"))
        except ValueError as exc:
            self._answers.append(Rejected(command.id, str(exc)))

    def _stage(self, command: Command, field: str, value: object) -> None:
        """Check a setting as the engine does (ValueError), to apply at the next step."""
        checked = getattr(_LIVE.replace(**{field: value}), field)
        self._waiting.append((command, field, getattr(checked, "value", checked)))

    def _apply_waiting(self, event: Step, out: list[Event]) -> Step:
        stats = event.stats
        applied: list[str] = []
        for command, field, value in self._waiting:
            if field == "shape":
                self._shape.update(value)
                what = " ".join(f"{k} {v}" for k, v in value.items())
                applied.append(what)
                out.append(Applied(command.id, stats.step, what))
                continue
            self._overrides[field] = value
            what = describe_setting(field, value)
            applied.append(what)
            out.append(Applied(command.id, stats.step, what))
        self._waiting.clear()
        self._last_step = stats.step
        if not self._overrides and not applied and not self._shape:
            return event
        if self.restep is not None and self._overrides:
            stats = self.restep(stats, dict(self._overrides))
        stats = dataclasses.replace(stats, **self._overrides, **self._shape,
                                    applied=stats.applied + applied)
        if self._shape:  # each micro-batch more costs 5%, recomputing the layers 20%
            slower = (1 + 0.05 * (stats.micro_batches - 1)
                      + 0.2 * stats.activation_checkpointing)
            stats = dataclasses.replace(stats, seconds=stats.seconds * slower)
        if "device_budget" in self._overrides:
            memory = dataclasses.replace(
                stats.memory, device_capacity=self._overrides["device_budget"]
            )
            stats = dataclasses.replace(stats, memory=memory)
        return Step(stats)


# --- plausible telemetry -----------------------------------------------------------------


def fake_chunks(
    step: int,
    *,
    policy: str = "auto",
    device_budget: int = 6 * GiB,
    n_chunks: int = 24,
    parameters: int = 125_239_296,
    non_model: int | None = None,
) -> tuple[list[ChunkInfo], dict[str, dict[str, int]]]:
    """Chunk placement and per-location TensorState counts in the middle of step `step`.

    Counts are of parameters (tensors), as the engine reports them: TENSORS_PER_CHUNK per
    chunk. The chunk in use moves with the step; chunks before it in the pass are
    HOLD_AFTER_FWD.
    """
    param_bytes = parameters * 2
    chunk_bytes = param_bytes // n_chunks
    non_model = _non_model(param_bytes) if non_model is None else non_model
    on_device = _chunks_on_device(policy, device_budget, n_chunks, chunk_bytes, non_model)
    in_use = (step * 7) % n_chunks
    chunks: list[ChunkInfo] = []
    states = {loc: dict.fromkeys((s.value for s in TensorState), 0) for loc in ("device", "host")}
    per_chunk = parameters // n_chunks
    for index in range(n_chunks):
        numel = per_chunk + (parameters - per_chunk * n_chunks if index == n_chunks - 1 else 0)
        nbytes = numel * 2
        if index == in_use:
            location, state = "device", TensorState.COMPUTE
        elif index in on_device:
            location = "device"
            state = TensorState.HOLD_AFTER_FWD if index < in_use else TensorState.HOLD
        else:
            location, state = "host", TensorState.FREE
        chunks.append(ChunkInfo(index, location, state.value, nbytes))
        states[location][state.value] += TENSORS_PER_CHUNK
    return chunks, states


def fake_stats(
    step: int,
    *,
    policy: str = "auto",
    margin_ratio: float = 0.0,
    device_budget: int = 6 * GiB,
    n_chunks: int = 24,
    parameters: int = 125_239_296,
    tokens: int = 256,
    non_model: int | None = None,
    host_budget: int | None = None,
) -> StepStats:
    """Plausible StepStats for step `step` of a bf16 run under the given settings.

    Deterministic in its arguments. Memory follows the policy (cuda keeps everything on the
    device, cpu keeps one chunk there, auto fills the budget); the margin brings optimizer
    state onto the device; under `host_budget` what the host cannot hold goes to disk (the
    optimizer state of the last chunks first, then their payloads: see fake_disk); the loss
    decays with a small wobble.
    """
    chunks, states = fake_chunks(
        step,
        policy=policy,
        device_budget=device_budget,
        n_chunks=n_chunks,
        parameters=parameters,
        non_model=non_model,
    )
    param_bytes = parameters * 2
    non_model = _non_model(param_bytes) if non_model is None else non_model
    on_device = _chunks_on_device(
        policy, device_budget, n_chunks, param_bytes // n_chunks, non_model
    )
    non_model = int(non_model * (1.0 + 0.05 * math.sin(step * 0.9)))
    optimizer_bytes = parameters * _OPTIMIZER_BYTES_PER_PARAM
    device_chunk_bytes = sum(c.nbytes for c in chunks if c.location == "device")
    host_chunk_bytes = param_bytes - device_chunk_bytes
    if policy == "cuda":
        device_optimizer = optimizer_bytes
    else:
        # Room left once the step's peak is in: resident chunks, the ones a step fetches
        # (the chunk in use, the next one prefetched, a gradient buffer) and the non-model
        # data at its highest.
        working = (len(on_device) + _TRANSIENT_CHUNKS) * (param_bytes // n_chunks)
        spare = max(0, device_budget - working - int(non_model * 1.05))
        device_optimizer = min(optimizer_bytes, int(margin_ratio * spare))
    device_model = device_chunk_bytes + device_optimizer
    host_model = host_chunk_bytes + optimizer_bytes - device_optimizer
    disk = fake_disk(chunks, states, host_model=host_model, host_budget=host_budget,
                     state_bytes=(optimizer_bytes - device_optimizer) // n_chunks)
    chunks, states, host_model = disk.chunks, disk.states, disk.host_model
    timeline = fake_timeline(
        [c.nbytes for c in chunks],
        resident=on_device,
        non_model=non_model,
        device_optimizer=device_optimizer,
        all_resident=policy == "cuda",
    )
    moved_h2d = sum(p.bytes_h2d for p in timeline)
    moved_d2h = sum(p.bytes_d2h for p in timeline)

    compute = parameters * tokens * 6 / _DEVICE_FLOPS
    host_share = 1.0 - device_optimizer / optimizer_bytes
    optimizer = optimizer_bytes * host_share / _HOST_ADAM_BYTES_PER_S + 0.002
    transfer = (moved_h2d + moved_d2h) / _PCIE_BYTES_PER_S
    wobble = 1.0 + 0.03 * math.sin(step * 1.3)
    forward, backward = compute / 3 * wobble, compute * 2 / 3 * wobble
    disk_io = (disk.read + disk.written) / _DISK_BYTES_PER_S
    disk_wait = max(0.0, disk_io - (forward + backward + optimizer))
    seconds = forward + backward + optimizer + transfer + disk_wait
    memory = MemorySnapshot(
        device_capacity=device_budget,
        device_model=device_model,
        device_non_model_peak=max(p.non_model_bytes for p in timeline),
        device_peak=max(p.model_bytes + p.non_model_bytes for p in timeline),
        host_model=host_model,
        # The simulated device its Started event names lives in this process too.
        process_rss=host_model + disk.io_buffers + device_model + int(1.4 * GiB),
        states=states,
        chunks=chunks,
        disk_model=disk.disk_model,
        host_io_buffers=disk.io_buffers,
        # Measured when the tier opens, which it does only when something goes to disk.
        disk_read_bandwidth=_DISK_BYTES_PER_S if disk.io_buffers else 0.0,
        disk_write_bandwidth=_DISK_BYTES_PER_S if disk.io_buffers else 0.0,
    )
    return StepStats(
        step=step,
        loss=2.2 + 8.6 * math.exp(-step / 60) + 0.08 * math.sin(step * 1.7),
        tokens=tokens,
        seconds=seconds,
        forward=forward,
        backward=backward,
        optimizer=optimizer,
        transfer=transfer,
        bytes_h2d=moved_h2d,
        bytes_d2h=moved_d2h,
        policy=policy,
        margin_ratio=margin_ratio,
        device_budget=device_budget,
        memory=memory,
        lr=3e-4,
        timeline=timeline,
        bytes_disk_read=disk.read,
        bytes_disk_written=disk.written,
        disk_wait=disk_wait,
    )


@dataclasses.dataclass
class FakeDisk:
    """What fake_disk sent to disk: the chunks and state counts as they are after it, the
    bytes left on the host, and the disk tier's own figures."""

    chunks: list[ChunkInfo]
    states: dict[str, dict[str, int]]
    host_model: int
    disk_model: int = 0
    io_buffers: int = 0
    read: int = 0  # bytes per step
    written: int = 0


def fake_disk(
    chunks: list[ChunkInfo],
    states: dict[str, dict[str, int]],
    *,
    host_model: int,
    host_budget: int | None,
    state_bytes: int,
) -> FakeDisk:
    """The disk tier under `host_budget`, in the engine's order: the optimizer state on the
    host (`state_bytes` per chunk), the last chunk's first, until the host holds its chunk
    bytes and the I/O buffers; then, if still needed, the payloads of chunks on the host
    (those are then located on "disk"). A budget too small even then is not refused here,
    as the engine would refuse it: the host keeps what is left. Each step reads a state on
    disk for the update and writes it back; a payload on disk is read for the forward, the
    backward and the update, and written with its gradients and after the update."""
    if host_budget is None or host_model <= host_budget:
        return FakeDisk(chunks, states, host_model)
    chunks = list(chunks)
    states = {loc: dict(counts) for loc, counts in states.items()}
    states["disk"] = dict.fromkeys((s.value for s in TensorState), 0)
    on_host = [i for i in reversed(range(len(chunks))) if chunks[i].location == "host"]
    state = payload = 0
    buffers = _STATE_BUFFERS
    for _ in chunks:
        if host_model + buffers <= host_budget:
            break
        host_model -= state_bytes
        state += state_bytes
    else:
        buffers += _PAYLOAD_BUFFERS
        for i in on_host:
            if host_model + buffers <= host_budget:
                break
            host_model -= chunks[i].nbytes
            payload += chunks[i].nbytes
            chunks[i] = dataclasses.replace(chunks[i], location="disk")
            states["host"][chunks[i].state] -= TENSORS_PER_CHUNK
            states["disk"][chunks[i].state] += TENSORS_PER_CHUNK
    return FakeDisk(chunks, states, max(0, host_model), disk_model=state + payload,
                    io_buffers=buffers, read=state + 3 * payload, written=state + 2 * payload)


def follow_settings(**run: object) -> Callable[[StepStats, dict[str, object]], StepStats]:
    """A FakeWorker `restep` that redraws each step with fake_stats under the settings in
    force: `run` are fake_stats' other arguments (parameters, n_chunks, ...), the run's
    starting settings among them."""

    def restep(stats: StepStats, settings: dict[str, object]) -> StepStats:
        return fake_stats(stats.step, **{**run, **settings})

    return restep


def module_names(n_chunks: int) -> list[str]:
    """The module that uses each chunk, in forward order: the embedding, one decoder layer
    per chunk between, the output head."""
    if n_chunks == 1:
        return ["model"]
    layers = [f"model.decoder.layers.{i}" for i in range(n_chunks - 2)]
    return ["model.decoder.embed_tokens", *layers, "lm_head"]


def fake_timeline(
    chunk_bytes: list[int],
    *,
    resident: set[int],
    non_model: int,
    device_optimizer: int = 0,
    all_resident: bool = False,
) -> list[TimelinePoint]:
    """A step interval by interval: forward over the modules (one chunk each), then
    backward in reverse.

    Chunks in `resident` stay on the device; any other is copied in before its module runs
    (forward and again in backward), the next one is prefetched beside it, and in backward
    its gradient is copied back out. Under `all_resident` (cuda) gradients stay on the
    device with the optimizer state. Activations grow through the forward; backward starts
    at the step's non-model peak (`non_model`: logits, their gradient, temporaries) and
    frees them layer by layer.
    """
    n = len(chunk_bytes)
    names = module_names(n)
    kept = sum(chunk_bytes[i] for i in resident) + device_optimizer
    points: list[TimelinePoint] = []

    def fetched(i: int) -> int:
        return 0 if i in resident or not 0 <= i < n else chunk_bytes[i]

    for i in range(n):
        activations = int(non_model * 0.6 * (i + 1) / n)
        points.append(
            TimelinePoint(
                phase="forward",
                module=names[i],
                model_bytes=kept + fetched(i) + fetched(i + 1),
                non_model_bytes=activations,
                bytes_h2d=fetched(i) if i == 0 else fetched(i + 1) if i + 1 < n else 0,
                bytes_d2h=0,
            )
        )
    if n > 1:  # the first fetch above brought chunk 0 and prefetched chunk 1
        first = points[0]
        points[0] = dataclasses.replace(first, bytes_h2d=fetched(0) + fetched(1))
    for i in reversed(range(n)):
        remaining = int(non_model * (0.35 + 0.65 * (i + 1) / n))
        grad = 0 if all_resident else chunk_bytes[i]
        previous = fetched(i - 1)
        points.append(
            TimelinePoint(
                phase="backward",
                module=names[i],
                model_bytes=kept + fetched(i) + previous + grad,
                non_model_bytes=remaining,
                bytes_h2d=(fetched(i) if i == n - 1 else 0) + previous,
                bytes_d2h=grad,
            )
        )
    return points


def fake_started(
    *,
    model: str = "opt-125m",
    parameters: int = 125_239_296,
    device_budget: int = 6 * GiB,
    n_chunks: int = 24,
    policy: str = "auto",
    settings: dict | None = None,
    ranks: int = 1,
) -> Started:
    """The Started event of a run on the simulated device (of `ranks` data-parallel ranks)."""
    chunks, _ = fake_chunks(
        0, policy=policy, device_budget=device_budget, n_chunks=n_chunks, parameters=parameters
    )
    device = f"simulated, {format_size(device_budget)}"
    if ranks > 1:
        device += f" per rank, {ranks} ranks (gloo)"
    return Started(
        model=model,
        parameters=parameters,
        device=device,
        chunks=chunks,
        settings=settings or {},
        pid=4242,
        log_path="runs/fake.log",
        device_budget=device_budget,
        ranks=ranks,
    )


def fake_run(
    steps: int,
    *,
    model: str = "opt-125m",
    policy: str = "auto",
    margin_ratio: float = 0.0,
    device_budget: int = 6 * GiB,
    n_chunks: int = 24,
    parameters: int = 125_239_296,
    tokens: int = 256,
    first_step: int = 1,
    host_budget: int | None = None,
    ranks: int = 1,
) -> list[Event]:
    """A Started event followed by `steps` Step events: a whole scripted run. With `ranks`
    above 1, each Step is followed by the other ranks' RankStep: every rank holds a shard
    of each chunk (a `ranks`-th of rank 0's chunk bytes) and a process of its own."""
    events: list[Event] = [
        fake_started(
            model=model,
            parameters=parameters,
            device_budget=device_budget,
            n_chunks=n_chunks,
            policy=policy,
            ranks=ranks,
        )
    ]
    for step in range(first_step, first_step + steps):
        stats = fake_stats(
            step,
            policy=policy,
            margin_ratio=margin_ratio,
            device_budget=device_budget,
            n_chunks=n_chunks,
            parameters=parameters,
            tokens=tokens,
            host_budget=host_budget,
        )
        events.append(Step(stats))
        events.extend(RankStep(rank, _rank_stats(stats, rank)) for rank in range(1, ranks))
    return events


def _rank_stats(stats: StepStats, rank: int) -> StepStats:
    """Rank `rank`'s view of a step rank 0 reported: the same step and settings, its own
    memory (a little more non-model on the higher ranks, a process a little larger)."""
    m = stats.memory
    extra = rank * 3 * MiB
    memory = dataclasses.replace(
        m,
        device_non_model_peak=m.device_non_model_peak + extra,
        device_peak=m.device_peak + extra,
        process_rss=m.process_rss + rank * 40 * MiB,
    )
    return dataclasses.replace(stats, memory=memory)


def _non_model(param_bytes: int) -> int:
    return max(64 * MiB, param_bytes // 2)


def _chunks_on_device(
    policy: str, device_budget: int, n_chunks: int, chunk_bytes: int, non_model: int
) -> set[int]:
    if policy == "cuda":
        return set(range(n_chunks))
    if policy == "cpu":
        return set()
    # Leave room for the non-model peak at its highest (fake_stats lets it wobble by 5%) and
    # for the chunks a step fetches besides the resident ones.
    room = max(0, device_budget - int(non_model * 1.05)) // max(1, chunk_bytes)
    return set(range(min(n_chunks, max(0, room - _TRANSIENT_CHUNKS))))
