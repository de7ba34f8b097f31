"""Planner: the device and host memory a run will need, per policy, before anything runs.

    p = plan("opt-1.3b", device_mem=6 * 2**30, host_mem=32 * 2**30, precision="bf16")
    p.cpu.device_peak, p.cpu.host_peak, p.cpu.fits, p.recommended.policy

Nothing is allocated. The step is run once on the meta device (shapes and dtypes, no data)
through the engine's own hooks, which records what the engine would see:
the modules in the order they run, the bytes autograd saves for backward (counted the way the
engine counts them on the simulated device), and when each gradient arrives. That recording is
then replayed against the engine's own chunk layout under each policy, with the manager's
rules (fetch before use, evict the chunk used farthest ahead, gradient buffers until a chunk's
last gradient is in, optimizer state resident for cuda and the margin), in bytes only.

Decoder stacks repeat one layer, so a large model is traced with TRACE_LAYERS layers and its
inner layer is repeated in the recording: opt-30b plans in about as long as opt-125m.
"""

from __future__ import annotations

import bisect
import re
from dataclasses import asdict, dataclass

import torch
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM, PretrainedConfig

from engine.chunk import chunk_numel, layout
from engine.config import PRECISIONS, format_size, parse_size
from engine.hooks import install, wrap_outputs
from engine.policy import Policy
from engine.tracer import tensor_bytes
from engine.zoo import BadCheckpoint, meta_model, model_config

__all__ = ["Plan", "PolicyPlan", "Recommendation", "plan"]

# Decoder layers traced for a deeper model: the first, one inner layer that stands for every
# inner layer, and the last.
TRACE_LAYERS = 3

# Resident bytes of a training process before any model: Python, torch, transformers and the
# autograd engine. Measured (VmHWM) on Linux, torch 2.13: 331 MiB right after the imports,
# about 400 MiB after a few steps of `tiny`, whose model and activations are ~25 MB of that.
RUNTIME_BYTES = 370 * 2**20
# What a process that uses CUDA adds to its host memory (driver, context, kernels). Not
# measured here (no GPU on the machine this was calibrated on); a typical figure.
CUDA_CONTEXT = 500 * 2**20

# What the engine does not count but the memory holds during backward, beside the largest
# gradient autograd builds before handing it over (see _Planner._transient): the gradients in
# flight and the freed blocks the allocator keeps, as a share of the saved activations.
# Calibrated on the peak RSS of simulated runs: 0.6 (opt-350m fp32), 0.66 (opt-125m bf16),
# 0.93 (opt-125m fp32).
ACTIVATION_SLACK = 0.75

# Host bytes per element beside the payload: fp32 master weights and the two AdamW moments.
OPTIMIZER_BYTES = 12

# Share of the spare device memory a recommended margin leaves to the allocator on a real
# GPU, which rounds and fragments while other processes come and go. The simulated device
# is exact and may be filled.
CUDA_HEADROOM = 0.10
MARGIN_STEP = 0.1  # margins the recommendation compares


@dataclass
class PolicyPlan:
    """The forecast for one placement policy."""

    policy: str
    device_peak: int  # peak device bytes of a step: model data + activations
    host_peak: int  # peak resident bytes of the training process (RSS)
    host_model: int  # chunk bytes on the host between steps (MemorySnapshot.host_model)
    copied: int  # bytes copied between host and device per step (bytes_h2d + bytes_d2h)
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
            name: {
                "device_peak": p.device_peak,
                "host_peak": p.host_peak,
                "fits": p.fits,
                "reason": p.reason,
                "host_model": p.host_model,
                "copied": p.copied,
            }
            for name, p in self.policies.items()
        }
        out["recommended"] = asdict(self.recommended)
        for key in (
            "model",
            "precision",
            "batch_size",
            "seq_len",
            "checkpointing",
            "device_mem",
            "host_mem",
            "simulated",
            "parameters",
            "chunk_size",
            "chunks",
            "model_bytes",
            "working_set",
            "non_model_peak",
        ):
            out[key] = getattr(self, key)
        return out


# --- recording one step on the meta device ---------------------------------------------
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
    """engine.tracer.NonModelCounter for meta tensors, writing events instead of peaks.

    Storages are told apart by their StorageImpl (meta tensors have no data pointer), and
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


class _CpuAttention(TorchFunctionMode):
    """Scaled dot-product attention as the CPU runs it, on the meta device.

    On meta tensors SDPA takes its math path, which saves the whole attention matrix for
    backward; the CPU (and a GPU) runs a flash kernel that saves queries, keys, values, the
    output and one log-sum-exp per row. Recording the math path would overstate activations.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__bool__ and args[0].is_meta:
            # A meta tensor has no values to branch on. Models branch on data only for fast
            # paths that a plain training batch takes (e.g. "no packed sequences"), so take
            # them.
            return True
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **kwargs)
        names = (
            "query",
            "key",
            "value",
            "attn_mask",
            "dropout_p",
            "is_causal",
            "scale",
            "enable_gqa",
        )
        a = {**dict(zip(names, args, strict=False)), **kwargs}
        # The flash kernel reads grouped keys and values as they are (enable_gqa).
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            a["query"],
            a["key"],
            a["value"],
            a.get("dropout_p", 0.0),
            a.get("is_causal", False),
            attn_mask=a.get("attn_mask"),
            scale=a.get("scale"),
        )
        return out


def _meta_model(
    config: PretrainedConfig, dtype: torch.dtype, checkpointing: bool
) -> torch.nn.Module:
    """The model on the meta device in the compute dtype, in training mode."""
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError as error:
            raise BadCheckpoint(f"not a causal language model: {error}") from error
    model.to(dtype)  # parameters only change dtype in place: tied ones stay tied
    model.config.use_cache = False
    if checkpointing:
        # As the engine's users enable it (non-reentrant), with the recomputation in
        # backward running under the same attention as the forward.
        options = {"use_reentrant": False, "context_fn": lambda: (_CpuAttention(), _CpuAttention())}
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=options)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    model.train()
    return model


def _record(model: torch.nn.Module, batch_size: int, seq_len: int) -> list[Event]:
    """Run forward and backward of one batch with the engine's hooks, on the meta device."""
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
            return wrap_outputs(
                output, lambda: events.append(("point", names[modules[key]], "backward"))
            )
        return output

    def on_grad(param: torch.nn.Parameter) -> None:
        events.append(("grad", rec.names[id(param)]))
        param.grad = None

    handles, _ = install(model, pre_forward=pre_forward, post_forward=post_forward, on_grad=on_grad)
    try:
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, rec.unpack):
            ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
            with _CpuAttention():
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
    found = [
        name
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.ModuleList) and len(m) == layers
    ]
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

    order = [
        (False, "before"),
        *[(False, i) for i in range(traced)],
        (False, "after"),
        "backward",
        (True, "after"),
        *[(True, i) for i in reversed(range(traced))],
        (True, "before"),
    ]
    keys = [k for k, _ in segments]
    if keys != [k for k in order if k in keys] or any(
        (False, i) not in keys or (True, i) not in keys for i in range(traced)
    ):
        return None
    seg = dict(segments)
    for (_, layer), events_of in ((k, v) for k, v in segments if isinstance(k, tuple)):
        if isinstance(layer, int) and any(
            e[0] in ("point", "post", "grad") and layer_of(e[1]) not in (None, layer)
            for e in events_of
        ):
            return None  # a layer's segment touches another layer: not a plain stack

    def copy(backward: bool, target: int) -> list[Event]:
        source = sources[target]
        old, new = f"{stack}.{source}.", f"{stack}.{target}."
        return [
            (e[0], new + e[1][len(old) :], *e[2:])
            if e[0] in ("point", "post", "grad") and e[1].startswith(old)
            else e
            for e in seg[(backward, source)]
        ]

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


def _recording(
    config: PretrainedConfig, dtype: torch.dtype, batch_size: int, seq_len: int, checkpointing: bool
) -> list[Event]:
    layers = getattr(config, "num_hidden_layers", None)
    uniform = len(set(getattr(config, "layer_types", None) or [None])) == 1
    if isinstance(layers, int) and layers > TRACE_LAYERS and uniform:
        small = config.__class__.from_dict(config.to_dict())
        small.num_hidden_layers = TRACE_LAYERS
        if getattr(small, "layer_types", None):
            small.layer_types = small.layer_types[:TRACE_LAYERS]
        model = _meta_model(small, dtype, checkpointing)
        stack = _layer_stack(model, TRACE_LAYERS)
        if stack is not None:
            events = _record(model, batch_size, seq_len)
            expanded = _expand(events, stack, TRACE_LAYERS, layers)
            if expanded is not None:
                return expanded
    return _record(_meta_model(config, dtype, checkpointing), batch_size, seq_len)


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
    sizes: dict[str, int]  # parameter -> elements


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
        module_chunks={
            m: tuple(dict.fromkeys(chunk_of[p] for p in ps)) for m, ps in module_params.items()
        },
        sizes=sizes,
    )


@dataclass
class _Trace:
    """What the engine's warm-up step records (engine.tracer.Trace), in bytes."""

    chunks: list[tuple[int, ...]]
    non_model: list[int]  # peak non-model bytes per point
    working_set: int
    uses: dict[int, list[int]]

    def next_use(self, chunk: int, pos: int) -> float:
        uses = self.uses.get(chunk, [])
        i = bisect.bisect_right(uses, pos)
        return uses[i] if i < len(uses) else float("inf")

    def non_model_ahead(self, pos: int) -> int:
        return self.non_model[pos] if 0 <= pos < len(self.non_model) else 0

    @property
    def non_model_peak(self) -> int:
        return max(self.non_model, default=0)


class _OutOfMemory(Exception):
    pass


@dataclass(frozen=True)
class _ChunkBytes:
    """Bytes per chunk element and where they live (engine.packing.fill, ChunkManager)."""

    itemsize: int  # compute dtype

    @property
    def aliased(self) -> bool:
        """fp32: the payload is the master itself; gradients land in a host buffer."""
        return self.itemsize == 4

    def host(self, numel: int) -> int:
        """A chunk at home on the host: payload, master, landed gradients, two moments."""
        payload = 0 if self.aliased else self.itemsize
        landed = 4 if self.aliased else 0
        return (payload + 4 + landed + 8) * numel

    def resident(self, numel: int) -> int:
        """A resident chunk's device bytes between steps: payload, master, two moments."""
        return (self.itemsize + (0 if self.aliased else 4) + 8) * numel

    def resident_cost(self, numel: int) -> int:
        """ChunkManager.resident_cost: resident bytes plus room for its gradients."""
        return (
            2 * self.itemsize * numel + OPTIMIZER_BYTES * numel - (4 * numel if self.aliased else 0)
        )


class _Step:
    """One engine step replayed in bytes: Engine's sampling and ChunkManager's rules.

    Without a trace it is the warm-up step (no forecast, least recently used eviction, an
    overrun is noted rather than raised); with one it is every later step.
    """

    def __init__(
        self,
        lay: _Layout,
        *,
        cost: _ChunkBytes,
        policy: Policy,
        capacity: float,
        resident: set[int],
        trace: _Trace | None = None,
    ) -> None:
        self.lay, self.policy, self.capacity, self.trace = lay, policy, capacity, trace
        self.itemsize = cost.itemsize
        self.nbytes = [n * cost.itemsize for n in lay.numel]
        self.resident = resident
        self.on_device = set(resident)
        self.device_bytes = sum(cost.resident(lay.numel[c]) for c in resident)
        self.peak = self.device_bytes
        self.grads: set[int] = set()
        self.grad_bytes = 0
        self.pending = [len(ps) for ps in lay.params]
        self.state: dict[str, str] = {}  # parameter -> "compute" | "fwd" | "bwd"; absent: idle
        self.computing = [0] * len(lay.numel)  # parameters in COMPUTE per chunk
        self.busy: set[int] = set()  # chunks with a parameter in COMPUTE (Chunk.in_use)
        self.last_use: dict[int, int] = {}
        self.nm = 0
        self.pos = -1
        self.pinned = 0
        self.evicting = False
        self.overrun = 0
        self.copied = 0  # payload bytes copied between host and device (fetches, gradients)
        self.stale: set[int] = set()  # on the device, but its gradients have gone home
        self.points: list[tuple[int, ...]] = []
        self.point_nm: list[int] = []
        self.point_ws: list[int] = []

    # bookkeeping

    def _set(self, param: str, state: str | None) -> None:
        before = self.state.get(param)
        if (before == "compute") != (state == "compute"):
            chunk = self.lay.chunk_of[param]
            self.computing[chunk] += 1 if state == "compute" else -1
            if self.computing[chunk]:
                self.busy.add(chunk)
            else:
                self.busy.discard(chunk)
        if state is None:
            self.state.pop(param, None)
        else:
            self.state[param] = state

    def _in_use(self, chunk: int) -> bool:
        return chunk in self.busy

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
        self.stale.discard(chunk)
        self.device_bytes -= self.nbytes[chunk]
        for param in self.lay.params[chunk]:
            self._set(param, None)
        self._sample()

    def _make_room(self, nbytes: int, protect: tuple[int, ...]) -> None:
        forecast = 0
        if self.trace is not None and self.policy != Policy.CUDA:
            forecast = max(0, self.trace.non_model_ahead(self.pos) - self.nm)
        while self.capacity - self.device_bytes - self.nm - forecast < nbytes:
            idle = [
                c
                for c in self.on_device
                if c not in self.resident and not self._in_use(c) and c not in protect
            ]
            if not idle:
                short = nbytes - (self.capacity - self.device_bytes - self.nm - forecast)
                if self.trace is not None:
                    raise _OutOfMemory(
                        f"{format_size(self.device_bytes)} of model data and "
                        f"{format_size(self.nm)} of activations leave no room for "
                        f"{format_size(nbytes + forecast)} more"
                    )
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
            if chunk in self.stale:
                self.stale.discard(chunk)
                self.copied += self.nbytes[chunk]
            return
        self._make_room(self.nbytes[chunk], protect + (chunk,))
        self.on_device.add(chunk)
        self.device_bytes += self.nbytes[chunk]
        self.copied += self.nbytes[chunk]
        self._sample()

    def _finish_grads(self, chunk: int) -> None:
        self.copied += self.nbytes[chunk]
        if chunk in self.on_device:
            self.stale.add(chunk)
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
        self.pinned = sum(self.nbytes[c] for c in self.busy.union(chunks))
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
            in_use = tuple(self.busy | self.grads)
            self.evicting = True
            try:
                self._make_room(0, in_use)
            finally:
                self.evicting = False
        self._sample()

    def grad(self, param: str) -> None:
        chunk = self.lay.chunk_of[param]
        if chunk in self.resident:
            # Autograd's own gradient tensor is kept until the update (keep_slot_grad).
            nbytes = self.lay.sizes[param] * self.itemsize
            self._make_room(nbytes, (chunk,))
            self.device_bytes += nbytes
            self._sample()
        elif chunk not in self.grads:
            self._make_room(self.nbytes[chunk], (chunk,))
            self.grads.add(chunk)
            self.grad_bytes += self.nbytes[chunk]
            self.device_bytes += self.nbytes[chunk]
            self._sample()
        self._set(param, "bwd")
        self.pending[chunk] -= 1
        if self.pending[chunk] == 0 and chunk in self.grads:
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


def _resident(
    lay: _Layout,
    cost: _ChunkBytes,
    policy: Policy,
    margin_ratio: float,
    capacity: int,
    trace: _Trace,
) -> set[int]:
    """Chunks whose payload and optimizer state live on the device (Engine._place)."""
    if policy == Policy.CUDA:
        return set(range(len(lay.numel)))
    chosen: set[int] = set()
    room = margin_ratio * max(0, capacity - trace.working_set)
    for chunk, numel in enumerate(lay.numel):
        need = cost.resident_cost(numel)
        if need <= room:
            chosen.add(chunk)
            room -= need
    return chosen


# --- the plan ---------------------------------------------------------------------------


@dataclass
class _Outcome:
    policy: Policy
    step: _Step
    trace: _Trace
    failure: str  # why the device cannot run it; "" when it can
    resident: set[int]


class _Planner:
    """Replays one recording under each placement and turns the bytes into a Plan."""

    def __init__(
        self,
        lay: _Layout,
        events: list[Event],
        *,
        cost: _ChunkBytes,
        device_mem: int,
        host_mem: int,
        simulated: bool,
    ) -> None:
        self.lay, self.events, self.cost = lay, events, cost
        self.device_mem, self.host_mem, self.simulated = device_mem, host_mem, simulated
        self.every = set(range(len(lay.numel)))
        self.runtime = RUNTIME_BYTES + (0 if simulated else CUDA_CONTEXT)
        self.capacity = device_mem
        self.transient = self._transient()
        if not simulated:
            # A GPU's allocator counts the transient bytes as activations, so the engine
            # there has that much less room for chunks.
            self.capacity = max(0, device_mem - self.transient)
        # Before its first step the engine asks for the chunks of its largest module, twice
        # (Engine.min_working_set without a trace).
        self.first_need = max(
            (
                2 * sum(lay.numel[c] * cost.itemsize for c in cs)
                for cs in lay.module_chunks.values()
            ),
            default=0,
        )

    def run(
        self,
        policy: Policy,
        capacity: float,
        margin_ratio: float = 0.0,
        trace: _Trace | None = None,
    ) -> _Outcome:
        """The warm-up step (unless its trace is given), then a steady step."""
        if trace is None:
            warm = _Step(
                self.lay,
                cost=self.cost,
                policy=policy,
                capacity=capacity,
                resident=self.every if policy == Policy.CUDA else set(),
            )
            warm.run(self.events)
            trace = warm.trace_of()
            if warm.overrun > 0 or trace.working_set > capacity:
                return _Outcome(policy, warm, trace, self._too_small(trace), warm.resident)
        resident = _resident(
            self.lay, self.cost, policy, margin_ratio, int(min(capacity, 2**62)), trace
        )
        step = _Step(
            self.lay,
            cost=self.cost,
            policy=policy,
            capacity=capacity,
            resident=resident,
            trace=trace,
        )
        try:
            step.run(self.events)
        except _OutOfMemory as error:
            return _Outcome(
                policy, step, trace, f"out of device memory mid-step: {error}", resident
            )
        return _Outcome(policy, step, trace, "", resident)

    def _transient(self) -> int:
        """Bytes a step holds that the engine's count of saved activations leaves out.

        Autograd builds each parameter's gradient before the engine copies it into the
        chunk; a weight used twice (a tied embedding and head) holds its first gradient
        through the whole backward and meets its second at the end. Beside them, the
        gradients flowing between layers and the allocator's slack grow with the
        activations. On the simulated device all of it is host memory; on a GPU it is device
        memory the engine sees as activations.
        """
        uses: dict[str, int] = {}
        for params in self.lay.module_params.values():
            for p in params:
                uses[p] = uses.get(p, 0) + 1
        grads = max(
            (uses.get(p, 1) * n * self.cost.itemsize for p, n in self.lay.sizes.items()),
            default=0,
        )
        activations = self.run(Policy.CPU, float("inf")).trace.non_model_peak
        return grads + int(ACTIVATION_SLACK * activations)

    def _too_small(self, trace: _Trace) -> str:
        return (
            f"device memory {format_size(self.device_mem)} is below the minimum working "
            f"set {format_size(self.working_set(trace))} (chunks in use, gradients and "
            f"activations)"
        )

    def working_set(self, trace: _Trace) -> int:
        """The least device memory a step needs, as the engine will measure it."""
        return trace.working_set + (0 if self.simulated else self.transient)

    def device_peak(self, step: _Step) -> int:
        return step.peak + (0 if self.simulated else self.transient)

    def host_model(self, resident: set[int]) -> int:
        return sum(self.cost.host(n) for c, n in enumerate(self.lay.numel) if c not in resident)

    def host_peak(self, outcome: _Outcome) -> int:
        """Resident bytes of the training process at its peak.

        Building the chunks holds every chunk's host state at once, whatever the policy
        (resident chunks move to the device afterwards). During a step the host holds the
        non-resident chunks and, when the device is simulated, the device's bytes and the
        transient ones too. The update of a chunk in a 16-bit precision reads its gradients
        as fp32, one chunk at a time.
        """
        built = self.host_model(set())
        update = 0 if self.cost.aliased else 4 * max(self.lay.numel, default=0)
        during = self.host_model(outcome.resident) + update
        if self.simulated:
            during = max(
                during, self.host_model(outcome.resident) + outcome.step.peak + self.transient
            )
        return self.runtime + max(built, during)

    def policy_plan(self, policy: Policy, margin_ratio: float) -> tuple[PolicyPlan, _Outcome]:
        outcome = self.run(policy, self.capacity, margin_ratio)
        if policy == Policy.CUDA:
            reason = self._cuda_reason(outcome)
        else:
            reason = outcome.failure
            if not reason and self.capacity < self.first_need:
                reason = (
                    f"device memory {format_size(self.device_mem)} is below the "
                    f"{format_size(self.first_need)} the largest module needs with its "
                    f"gradients"
                )
        if reason:
            # Report what the policy would need with room to spare; auto needs what cpu does.
            needs = self.run(Policy.CPU if policy == Policy.AUTO else policy, float("inf"))
            device_peak = max(self.device_peak(needs.step), self.working_set(needs.trace))
            if policy == Policy.CUDA:
                device_peak = max(device_peak, sum(self._cuda_need(needs.trace)))
            host_peak = self.host_peak(needs)
        else:
            device_peak, host_peak = self.device_peak(outcome.step), self.host_peak(outcome)
        if not reason and host_peak > self.host_mem:
            reason = (
                f"needs {format_size(host_peak)} of host memory "
                f"({self._host_parts(outcome)}), have {format_size(self.host_mem)}"
            )
        row = PolicyPlan(
            policy=policy.value,
            device_peak=int(device_peak),
            host_peak=int(host_peak),
            host_model=self.host_model(outcome.resident),
            copied=outcome.step.copied,
            fits=not reason,
            reason=reason,
        )
        return row, outcome

    def _cuda_reason(self, outcome: _Outcome) -> str:
        """Why every chunk cannot stay on the device, or "".

        The engine refuses cuda up front when the chunks with room for their gradients
        exceed the budget, and fails the first step when activations do not fit beside them.
        """
        model_data, activations = self._cuda_need(outcome.trace)
        if model_data <= self.capacity and not outcome.failure:
            return ""
        return (
            f"needs {format_size(model_data + activations)} on the device (model data "
            f"{format_size(model_data)} with its gradients + activations "
            f"{format_size(activations)}), have {format_size(self.device_mem)}"
        )

    def _cuda_need(self, trace: _Trace) -> tuple[int, int]:
        """(model data, activations) the cuda policy keeps on the device (cuda_policy_bytes)."""
        model_data = sum(self.cost.resident_cost(n) for n in self.lay.numel)
        return model_data, trace.non_model_peak + (0 if self.simulated else self.transient)

    def _host_parts(self, outcome: _Outcome) -> str:
        parts = [f"chunks {format_size(self.host_model(outcome.resident))}"]
        if self.simulated:
            parts.append(f"simulated device {format_size(outcome.step.peak)}")
            parts.append(f"gradients in flight {format_size(self.transient)}")
        parts.append(f"runtime {format_size(self.runtime)}")
        return " + ".join(parts)

    def recommend(self, plans: dict[str, PolicyPlan], auto: _Outcome) -> Recommendation:
        if plans["cuda"].fits:
            return Recommendation(
                "cuda",
                0.0,
                "everything fits on the device: no copies, and the optimizer runs there",
            )
        if not plans["cpu"].fits:
            tight = plans["cpu"].reason
            return Recommendation(
                None,
                0.0,
                f"nothing fits: {tight}; try a smaller batch "
                f"or sequence, --checkpointing, or more memory",
            )
        spare = self.capacity - auto.trace.working_set
        smallest = min(n * self.cost.itemsize for n in self.lay.numel)
        if not plans["auto"].fits or spare < 2 * smallest:
            return Recommendation(
                "cpu",
                0.0,
                f"only {format_size(max(0, spare))} beyond the "
                f"working set: auto could keep next to nothing, and cpu is "
                f"the steadier policy",
            )
        # Resident chunks are never copied and update on the device, but take room from the
        # idle chunks auto would keep: the margin that copies least per step wins, the larger
        # one on a tie.
        top = 1.0 if self.simulated else 1.0 - CUDA_HEADROOM
        best, best_ratio = auto, 0.0
        for k in range(1, int(round(top / MARGIN_STEP)) + 1):
            ratio = round(k * MARGIN_STEP, 2)
            tried = self.run(Policy.AUTO, self.capacity, ratio, trace=auto.trace)
            if tried.failure or self.host_peak(tried) > self.host_mem:
                continue
            if tried.step.copied <= best.step.copied and tried.resident != best.resident:
                best, best_ratio = tried, ratio
        if not best.resident:
            return Recommendation(
                "auto",
                0.0,
                f"auto keeps idle chunks in the {format_size(spare)} beyond the working set; "
                f"optimizer state there would only make it copy more",
            )
        return Recommendation(
            "auto",
            best_ratio,
            f"margin {best_ratio:g} keeps the optimizer state of {len(best.resident)} of "
            f"{len(self.lay.numel)} chunks on the device and copies "
            f"{format_size(best.step.copied)} per step ({format_size(auto.step.copied)} "
            f"without); predicted peak {format_size(self.device_peak(best.step))} of "
            f"{format_size(self.device_mem)}",
        )


def plan(
    model_name_or_path: str,
    *,
    device_mem: int | str,
    host_mem: int | str,
    precision: str = "bf16",
    batch_size: int = 2,
    seq_len: int = 128,
    checkpointing: bool = False,
    simulated: bool | None = None,
    chunk_size: int | None = None,
    margin_ratio: float = 0.0,
) -> Plan:
    """Forecast a training step's device and host memory under each policy.

    Args:
        model_name_or_path: a zoo name or a local model folder (only its config is read).
        device_mem: device memory in bytes or as text ("6GiB"): the budget the engine gets.
        host_mem: host memory in bytes or as text.
        precision: compute dtype of the chunks, "fp32", "bf16" or "fp16".
        batch_size, seq_len: the batch shape; activations scale with both.
        checkpointing: whether the model recomputes its layers in backward.
        simulated: whether the device lives in host memory (the simulated device); None
            means "when there is no CUDA", as the engine decides.
        chunk_size: elements per chunk; None searches it as the engine does.
        margin_ratio: the margin the cpu and auto rows are planned with (the recommendation
            picks its own).

    Nothing is allocated: the model only ever exists on the meta device.

    Raises:
        engine.zoo.UnknownModel, engine.zoo.BadCheckpoint: the model cannot be found or read.
        ValueError: a size, precision or batch shape that makes no sense.
    """
    from engine.config import check_margin
    from engine.engine import DTYPES

    margin_ratio = check_margin(margin_ratio)
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    device_bytes, host_bytes = parse_size(device_mem), parse_size(host_mem)
    if device_bytes <= 0 or host_bytes <= 0:
        raise ValueError("device and host memory must be positive")
    if batch_size < 1 or seq_len < 2:
        raise ValueError(
            f"batch_size must be at least 1 and seq_len at least 2, not {batch_size} and {seq_len}"
        )
    if chunk_size is not None and chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, not {chunk_size}")
    config = model_config(model_name_or_path)
    positions = getattr(config, "max_position_embeddings", None)
    if positions and seq_len > positions:
        raise ValueError(
            f"seq_len {seq_len} is longer than the {positions} positions of {model_name_or_path}"
        )
    if simulated is None:
        simulated = not torch.cuda.is_available()
    dtype = DTYPES[precision]

    events = _recording(config, dtype, batch_size, seq_len, checkpointing)
    full = meta_model(model_name_or_path)
    lay = _layout(full, events, chunk_size)
    planner = _Planner(
        lay,
        events,
        cost=_ChunkBytes(dtype.itemsize),
        device_mem=device_bytes,
        host_mem=host_bytes,
        simulated=simulated,
    )
    plans, outcomes = {}, {}
    for policy in Policy:
        plans[policy.value], outcomes[policy.value] = planner.policy_plan(policy, margin_ratio)
    trace = outcomes["cpu"].trace
    return Plan(
        model=model_name_or_path,
        precision=precision,
        batch_size=batch_size,
        seq_len=seq_len,
        checkpointing=checkpointing,
        device_mem=device_bytes,
        host_mem=host_bytes,
        simulated=simulated,
        parameters=sum(lay.sizes.values()),
        chunk_size=lay.chunk_size,
        chunks=len(lay.numel),
        model_bytes=planner.host_model(set()),
        working_set=planner.working_set(trace),
        non_model_peak=trace.non_model_peak,
        cuda=plans["cuda"],
        cpu=plans["cpu"],
        auto=plans["auto"],
        recommended=planner.recommend(plans, outcomes["auto"]),
    )
