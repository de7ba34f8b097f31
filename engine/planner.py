"""Planner: the device and host memory a run will need, per policy, before anything runs.

    p = plan("opt-1.3b", device_mem=6 * 2**30, host_mem=32 * 2**30, precision="bf16")
    p.cpu.device_peak, p.cpu.host_peak, p.cpu.fits, p.recommended.policy

Nothing is allocated. The step is run once on fake tensors (shapes and dtypes on the meta
device, no data) through the engine's own hooks, which records what the engine would see:
the modules in the order they run, the bytes autograd saves for backward (counted the way the
engine counts them on the simulated device), and when each gradient arrives. That recording is
then replayed against the engine's own chunk layout under each policy, with the manager's
rules (fetch before use, evict the chunk used farthest ahead, gradient buffers until a chunk's
last gradient is in, optimizer state resident for cuda and the margin), in bytes only.

Decoder stacks repeat one layer, so a large model is traced with TRACE_LAYERS layers and its
inner layer is repeated in the recording: opt-30b plans in about as long as opt-125m.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import AutoModelForCausalLM, PretrainedConfig

from engine.chunk import chunk_numel, layout
from engine.config import PRECISIONS, format_size
from engine.hooks import install, wrap_outputs
from engine.policy import Policy
from engine.tracer import tensor_bytes
from engine.zoo import BadCheckpoint, meta_model, model_config

__all__ = ["Plan", "PolicyPlan", "Recommendation", "plan", "process_baseline"]

# Decoder layers traced for a deeper model: the first, one inner layer that stands for every
# inner layer, and the last.
TRACE_LAYERS = 3

# Resident bytes of a training process before any model: Python, torch, transformers and the
# autograd engine, measured with psutil after a few steps of `tiny` (about 400 MiB with its
# ~30 MB of model and activations). A process using CUDA adds its context, see CUDA_CONTEXT.
RUNTIME_BYTES = 370 * 2**20
CUDA_CONTEXT = 500 * 2**20

# Host bytes per element beside the payload: fp32 master weights and the two AdamW moments.
OPTIMIZER_BYTES = 12

# On a real GPU the caching allocator rounds and fragments; a plan that fills the device to
# the last byte would fail there, so the recommendation keeps this share free.
CUDA_HEADROOM = 0.10
MARGIN_STEP = 0.05  # granularity of the recommended margin ratio (the TUI's +/- step)


@dataclass
class PolicyPlan:
    """The forecast for one placement policy."""

    policy: str
    device_peak: int  # peak device bytes of a step: model data + activations
    host_peak: int  # peak resident bytes of the training process (RSS)
    fits: bool
    reason: str = ""  # why it does not fit, with the numbers; empty when it fits


@dataclass
class Recommendation:
    policy: str | None  # None when no policy fits
    margin_ratio: float
    why: str  # one line


@dataclass
class Plan:
    """What `plan` found. Byte counts are for one step at the given batch shape."""

    model: str
    precision: str
    batch_size: int
    seq_len: int
    checkpointing: bool
    device_mem: int
    host_mem: int
    simulated: bool  # the device lives in host memory, so device bytes count towards host_peak
    parameters: int
    chunk_size: int  # elements per chunk (searched like the engine does)
    chunks: int
    model_bytes: int  # payload + fp32 master + moments of every chunk
    working_set: int  # least device bytes any policy needs: chunks in use, gradients, activations
    non_model_peak: int  # activations: peak bytes saved for backward, plus the latest output
    cuda: PolicyPlan
    cpu: PolicyPlan
    auto: PolicyPlan
    recommended: Recommendation

    @property
    def policies(self) -> dict[str, PolicyPlan]:
        return {"cuda": self.cuda, "cpu": self.cpu, "auto": self.auto}

    def to_dict(self) -> dict:
        """The plan as plain data: one entry per policy, the recommendation, the inputs."""
        out: dict = {
            name: {"device_peak": p.device_peak, "host_peak": p.host_peak, "fits": p.fits,
                   "reason": p.reason}
            for name, p in self.policies.items()
        }
        out["recommended"] = asdict(self.recommended)
        for key in ("model", "precision", "batch_size", "seq_len", "checkpointing",
                    "device_mem", "host_mem", "simulated", "parameters", "chunk_size", "chunks",
                    "model_bytes", "working_set", "non_model_peak"):
            out[key] = getattr(self, key)
        return out


# --- recording one step on fake tensors ---------------------------------------------------
#
# A recording is a flat list of events, in the order the engine would see them:
#   ("point", module name, phase)  a module's chunks are fetched (engine._point)
#   ("post", module name)          a module's forward is done (its parameters leave COMPUTE)
#   ("nm", delta)                  non-model bytes change by delta (saved activations, output)
#   ("grad", parameter name)       a parameter's gradient arrives
#   ("backward",)                  forward is over; the loss's backward starts

Event = tuple


class _Saved:
    """One saved activation; its bytes leave the count when autograd drops it."""

    __slots__ = ("tensor", "key", "recorder")

    def __init__(self, tensor: torch.Tensor, key: int, recorder: _Recorder) -> None:
        self.tensor, self.key, self.recorder = tensor, key, recorder

    def __del__(self) -> None:
        self.recorder.drop(self.key)


class _Recorder:
    """engine.tracer.NonModelCounter for fake tensors, writing events instead of peaks.

    Storages are told apart by their StorageImpl (fake tensors have no data pointer), and
    parameter storages are model data, exactly as the engine skips its chunk payloads.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model_storages = {p.untyped_storage()._cdata for p in model.parameters()}
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.events: list[Event] = []
        self.output = 0
        self._live: dict[int, list[int]] = {}

    def pack(self, tensor: torch.Tensor) -> object:
        storage = tensor.untyped_storage()
        key = storage._cdata
        if key in self.model_storages or storage.nbytes() == 0:
            return tensor
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [storage.nbytes(), 1]
            self.events.append(("nm", storage.nbytes()))
        else:
            entry[1] += 1
        return _Saved(tensor, key, self)

    @staticmethod
    def unpack(packed: object) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def drop(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.events.append(("nm", -entry[0]))

    def set_output(self, nbytes: int) -> None:
        if nbytes != self.output:
            self.events.append(("nm", nbytes - self.output))
            self.output = nbytes


def _fake_model(config: PretrainedConfig, dtype: torch.dtype, mode: FakeTensorMode,
                checkpointing: bool) -> torch.nn.Module:
    """The model with fake parameters of the compute dtype (tied ones stay tied)."""
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError as error:
            raise BadCheckpoint(f"not a causal language model: {error}") from error
    made: dict[int, torch.Tensor] = {}
    with mode:
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is None:
                    continue
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(torch.empty(p.shape, dtype=dtype),
                                                     requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = torch.empty(b.shape, dtype=b.dtype)
    model.config.use_cache = False
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    return model


def _record(model: torch.nn.Module, mode: FakeTensorMode, batch_size: int, seq_len: int
            ) -> list[Event]:
    """Run forward and backward of one batch with the engine's hooks, on fake tensors."""
    rec = _Recorder(model)
    names = {m: n for n, m in model.named_modules()}
    modules = list(model.modules())
    events = rec.events

    def pre_forward(key: int) -> None:
        events.append(("point", names[modules[key]], "forward"))

    def post_forward(key: int, output: object) -> object:
        events.append(("post", names[modules[key]]))
        rec.set_output(tensor_bytes(output))
        if torch.is_grad_enabled():
            return wrap_outputs(output, lambda: events.append(
                ("point", names[modules[key]], "backward")))
        return output

    def on_grad(param: torch.nn.Parameter) -> None:
        events.append(("grad", rec.names[id(param)]))
        param.grad = None

    handles, _ = install(model, pre_forward=pre_forward, post_forward=post_forward,
                         on_grad=on_grad)
    try:
        with mode, torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
            ids = torch.zeros(batch_size, seq_len, dtype=torch.long)
            loss = model(input_ids=ids, labels=ids).loss
            rec.set_output(0)
            events.append(("backward",))
            loss.backward()
            del loss
    finally:
        for h in handles:
            h.remove()
    return events


# --- repeating the inner layer ------------------------------------------------------------


def _layer_stack(model: torch.nn.Module, layers: int) -> str | None:
    """Name of the ModuleList that holds the decoder layers, if there is exactly one."""
    found = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == layers]
    return found[0] if len(found) == 1 else None


def _expand(events: list[Event], stack: str, traced: int, layers: int) -> list[Event] | None:
    """The recording of a `layers`-deep model from one of a `traced`-deep one.

    Splits the recording into segments (before the stack, each layer, after it; forward and
    backward) and repeats the inner layer's segments, renaming modules and parameters. Byte
    changes are deltas, so a repeated segment carries its activations forward by itself.
    Returns None if the recording is not laid out as such a stack (then trace it all).
    """
    pattern = re.compile(re.escape(stack) + r"\.(\d+)\.")

    def layer_of(name: str) -> int | None:
        m = pattern.match(name)
        return int(m.group(1)) if m else None

    segments: list[tuple[object, list[Event]]] = []
    backward = False
    seen_layer = False
    for event in events:
        if event[0] == "backward":
            backward, seen_layer = True, False
            segments.append(("backward", [event]))
            continue
        if event[0] == "point":
            layer = layer_of(event[1])
            if layer is not None:
                seen_layer = True
                key: object = (backward, layer)
            else:
                key = (backward, "after" if seen_layer != backward else "before")
            if not segments or segments[-1][0] != key:
                segments.append((key, []))
        elif not segments:
            segments.append(((False, "before"), []))
        segments[-1][1].append(event)

    order = [(False, "before"), *[(False, i) for i in range(traced)], (False, "after"),
             "backward", (True, "after"), *[(True, i) for i in reversed(range(traced))],
             (True, "before")]
    keys = [k for k, _ in segments]
    if keys != [k for k in order if k in keys] or any(
            (False, i) not in keys or (True, i) not in keys for i in range(traced)):
        return None
    seg = dict(segments)
    for (_, layer), events_of in ((k, v) for k, v in segments if isinstance(k, tuple)):
        if isinstance(layer, int) and any(
                e[0] in ("point", "post", "grad") and layer_of(e[1]) not in (None, layer)
                for e in events_of):
            return None  # a layer's segment touches another layer: not a plain stack

    def copy(backward: bool, target: int) -> list[Event]:
        source = sources[target]
        old, new = f"{stack}.{source}.", f"{stack}.{target}."
        return [(e[0], new + e[1][len(old):], *e[2:])
                if e[0] in ("point", "post", "grad") and e[1].startswith(old) else e
                for e in seg[(backward, source)]]

    inner = traced // 2
    sources = [*range(inner), *[inner] * (layers - traced + 1), *range(inner + 1, traced)]
    out: list[Event] = list(seg.get((False, "before"), []))
    for target in range(layers):
        out += copy(False, target)
    for key in ((False, "after"), "backward", (True, "after")):
        out += seg.get(key, [])
    for target in reversed(range(layers)):
        out += copy(True, target)
    return out + seg.get((True, "before"), [])


def _recording(name_or_path: str, config: PretrainedConfig, dtype: torch.dtype, batch_size: int,
               seq_len: int, checkpointing: bool) -> list[Event]:
    layers = getattr(config, "num_hidden_layers", None)
    uniform = len(set(getattr(config, "layer_types", None) or [None])) == 1
    if isinstance(layers, int) and layers > TRACE_LAYERS and uniform:
        small = config.__class__.from_dict(config.to_dict())
        small.num_hidden_layers = TRACE_LAYERS
        if getattr(small, "layer_types", None):
            small.layer_types = small.layer_types[:TRACE_LAYERS]
        mode = FakeTensorMode()
        model = _fake_model(small, dtype, mode, checkpointing)
        stack = _layer_stack(model, TRACE_LAYERS)
        if stack is not None:
            events = _record(model, mode, batch_size, seq_len)
            expanded = _expand(events, stack, TRACE_LAYERS, layers)
            if expanded is not None:
                return expanded
    mode = FakeTensorMode()
    return _record(_fake_model(config, dtype, mode, checkpointing), mode, batch_size, seq_len)
# --- the engine's layout and its step, in bytes -------------------------------------------


@dataclass
class _Layout:
    """engine.chunk.layout over the full model, with who owns which parameter."""

    chunk_size: int
    numel: list[int]  # elements per chunk
    params: list[list[str]]  # parameter names per chunk
    chunk_of: dict[str, int]
    module_params: dict[str, list[str]]  # module name -> parameters it owns directly
    module_chunks: dict[str, tuple[int, ...]]


def _layout(model: torch.nn.Module, events: list[Event], chunk_size: int | None) -> _Layout:
    canonical = {id(p): name for name, p in model.named_parameters()}
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    module_params = {}
    for name, module in model.named_modules():
        own = list(dict.fromkeys(canonical[id(p)] for p in module.parameters(recurse=False)))
        if own:
            module_params[name] = own
    # First-use order, as engine.engine.first_use_order finds it with a forward pass.
    order: dict[str, None] = {}
    for event in events:
        if event[0] == "backward":
            break
        if event[0] == "point":
            order.update(dict.fromkeys(module_params[event[1]]))
    order.update(dict.fromkeys(sizes))
    names = list(order)
    size_list = [sizes[n] for n in names]
    size, groups = layout(size_list, chunk_size)
    params = [[names[i] for i in members] for members in groups]
    chunk_of = {p: c for c, members in enumerate(params) for p in members}
    return _Layout(
        chunk_size=size,
        numel=[chunk_numel(size_list, members) for members in groups],
        params=params,
        chunk_of=chunk_of,
        module_params=module_params,
        module_chunks={m: tuple(dict.fromkeys(chunk_of[p] for p in ps))
                       for m, ps in module_params.items()},
    )


@dataclass
class _Trace:
    """What the engine's warm-up step records (engine.tracer.Trace), in bytes."""

    chunks: list[tuple[int, ...]]
    non_model: list[int]  # peak non-model bytes per point
    working_set: int
    uses: dict[int, list[int]]

    def next_use(self, chunk: int, pos: int) -> float:
        later = [u for u in self.uses.get(chunk, ()) if u > pos]
        return later[0] if later else float("inf")

    def non_model_ahead(self, pos: int) -> int:
        return self.non_model[pos] if 0 <= pos < len(self.non_model) else 0

    @property
    def non_model_peak(self) -> int:
        return max(self.non_model, default=0)


class _OutOfMemory(Exception):
    pass


class _Step:
    """One engine step replayed in bytes: Engine's sampling and ChunkManager's rules.

    Without a trace it is the warm-up step (no forecast, least recently used eviction, an
    overrun is noted rather than raised); with one it is every later step.
    """

    def __init__(self, lay: _Layout, *, itemsize: int, policy: Policy, capacity: float,
                 resident: set[int], trace: _Trace | None = None) -> None:
        self.lay, self.policy, self.capacity, self.trace = lay, policy, capacity, trace
        self.nbytes = [n * itemsize for n in lay.numel]
        self.resident = resident
        self.on_device = set(resident)
        self.device_bytes = sum(self.nbytes[c] + OPTIMIZER_BYTES * lay.numel[c]
                                for c in resident)
        self.peak = self.device_bytes
        self.grads: set[int] = set()
        self.grad_bytes = 0
        self.pending = [len(ps) for ps in lay.params]
        self.state: dict[str, str] = {}  # parameter -> "compute" | "fwd" | "bwd"; absent: idle
        self.computing = [0] * len(lay.numel)  # parameters in COMPUTE per chunk
        self.last_use: dict[int, int] = {}
        self.nm = 0
        self.pos = -1
        self.pinned = 0
        self.evicting = False
        self.overrun = 0
        self.points: list[tuple[int, ...]] = []
        self.point_nm: list[int] = []
        self.point_ws: list[int] = []

    # bookkeeping

    def _set(self, param: str, state: str | None) -> None:
        before = self.state.get(param)
        if (before == "compute") != (state == "compute"):
            self.computing[self.lay.chunk_of[param]] += 1 if state == "compute" else -1
        if state is None:
            self.state.pop(param, None)
        else:
            self.state[param] = state

    def _in_use(self, chunk: int) -> bool:
        return self.computing[chunk] > 0

    def _sample(self) -> None:
        if self.evicting:
            return
        if self.point_nm:
            self.point_nm[-1] = max(self.point_nm[-1], self.nm)
            self.point_ws[-1] = max(self.point_ws[-1], self.pinned + self.grad_bytes + self.nm)
        self.peak = max(self.peak, self.device_bytes + self.nm)

    # ChunkManager

    def _release(self, chunk: int) -> None:
        if chunk in self.resident or chunk not in self.on_device or self._in_use(chunk):
            return
        self.on_device.discard(chunk)
        self.device_bytes -= self.nbytes[chunk]
        for param in self.lay.params[chunk]:
            self._set(param, None)
        self._sample()

    def _make_room(self, nbytes: int, protect: tuple[int, ...]) -> None:
        forecast = 0
        if self.trace is not None and self.policy != Policy.CUDA:
            forecast = max(0, self.trace.non_model_ahead(self.pos) - self.nm)
        while self.capacity - self.device_bytes - self.nm - forecast < nbytes:
            idle = [c for c in self.on_device if c not in self.resident
                    and not self._in_use(c) and c not in protect]
            if not idle:
                short = nbytes - (self.capacity - self.device_bytes - self.nm - forecast)
                if self.trace is not None:
                    raise _OutOfMemory(
                        f"{format_size(self.device_bytes)} of model data and "
                        f"{format_size(self.nm)} of activations leave no room for "
                        f"{format_size(nbytes + forecast)} more")
                self.overrun = max(self.overrun, int(short))
                return
            if self.trace is not None:
                victim = max(idle, key=lambda c: (self.trace.next_use(c, self.pos), c))
            else:
                victim = min(idle, key=lambda c: self.last_use.get(c, -1))
            self._release(victim)

    def _materialise(self, chunk: int, protect: tuple[int, ...]) -> None:
        self.last_use[chunk] = self.pos
        if chunk in self.on_device:
            return
        self._make_room(self.nbytes[chunk], protect + (chunk,))
        self.on_device.add(chunk)
        self.device_bytes += self.nbytes[chunk]
        self._sample()

    def _finish_grads(self, chunk: int) -> None:
        self.grads.discard(chunk)
        self.grad_bytes -= self.nbytes[chunk]
        self.device_bytes -= self.nbytes[chunk]
        self._sample()

    # Engine hooks

    def point(self, module: str, phase: str) -> None:
        self.pos += 1
        chunks = self.lay.module_chunks[module]
        self.points.append(chunks)
        self.point_nm.append(0)
        self.point_ws.append(0)
        self.pinned = sum(self.nbytes[c] for c in range(len(self.nbytes))
                          if self._in_use(c) or c in chunks)
        self._sample()
        if self.policy == Policy.CPU:
            for chunk in list(self.on_device):
                if chunk not in chunks:
                    self._release(chunk)
        for chunk in chunks:
            self._materialise(chunk, chunks)
        for param in self.lay.module_params[module]:
            if phase == "forward" or self.state.get(param) != "bwd":
                self._set(param, "compute")

    def post(self, module: str) -> None:
        for param in self.lay.module_params[module]:
            self._set(param, "fwd")

    def non_model(self, delta: int) -> None:
        self.nm += delta
        if delta > 0 and self.device_bytes + self.nm > self.capacity:
            in_use = tuple(c for c in range(len(self.nbytes))
                           if self._in_use(c) or c in self.grads)
            self.evicting = True
            try:
                self._make_room(0, in_use)
            finally:
                self.evicting = False
        self._sample()

    def grad(self, param: str) -> None:
        chunk = self.lay.chunk_of[param]
        if chunk not in self.grads:
            self._make_room(self.nbytes[chunk], (chunk,))
            self.grads.add(chunk)
            self.grad_bytes += self.nbytes[chunk]
            self.device_bytes += self.nbytes[chunk]
            self._sample()
        self._set(param, "bwd")
        self.pending[chunk] -= 1
        if self.pending[chunk] == 0:
            self._finish_grads(chunk)

    def run(self, events: list[Event]) -> None:
        for event in events:
            kind = event[0]
            if kind == "point":
                self.point(event[1], event[2])
            elif kind == "post":
                self.post(event[1])
            elif kind == "nm":
                self.non_model(event[1])
            elif kind == "grad":
                self.grad(event[1])
        for chunk in list(self.grads):
            self._finish_grads(chunk)

    def trace_of(self) -> _Trace:
        uses: dict[int, list[int]] = {}
        for pos, chunks in enumerate(self.points):
            for c in chunks:
                uses.setdefault(c, []).append(pos)
        return _Trace(self.points, self.point_nm, max(self.point_ws, default=0), uses)


def _resident(lay: _Layout, itemsize: int, policy: Policy, margin_ratio: float,
              capacity: int, trace: _Trace) -> set[int]:
    """Chunks whose payload and optimizer state live on the device (Engine._place)."""
    if policy == Policy.CUDA:
        return set(range(len(lay.numel)))
    chosen: set[int] = set()
    room = margin_ratio * max(0, capacity - trace.working_set)
    for chunk, numel in enumerate(lay.numel):
        cost = 2 * numel * itemsize + OPTIMIZER_BYTES * numel
        if cost <= room:
            chosen.add(chunk)
            room -= cost
    return chosen


def _simulate(lay: _Layout, events: list[Event], *, itemsize: int, policy: Policy,
              capacity: int, margin_ratio: float = 0.0) -> tuple[_Step, _Trace, str]:
    """(steady-state step, warm-up trace, why it fails or "") for one placement."""
    warm = _Step(lay, itemsize=itemsize, policy=policy, capacity=capacity,
                 resident=set(range(len(lay.numel))) if policy == Policy.CUDA else set())
    warm.run(events)
    trace = warm.trace_of()
    resident = _resident(lay, itemsize, policy, margin_ratio, capacity, trace)
    step = _Step(lay, itemsize=itemsize, policy=policy, capacity=capacity, resident=resident,
                 trace=trace)
    try:
        step.run(events)
    except _OutOfMemory as error:
        return step, trace, str(error)
    return step, trace, ""
