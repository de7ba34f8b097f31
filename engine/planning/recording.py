"""Recording one training step on the meta device, as the engine's hooks would see it.

`record_step` runs forward and backward of one batch on a meta-device model (shapes and
dtypes, no data) through engine.step.hooks and returns what the engine would see, in order: the
modules as they run, every byte an op allocates and frees (counted as the engine counts
non-model bytes on the simulated device, engine.step.non_model), when each gradient arrives.
A deep decoder is traced with a few layers and its inner layer repeated in the recording.
The planner replays the recording in bytes (engine.planning.replay).
"""

from __future__ import annotations

import copy
import re
from collections import OrderedDict

import torch
from torch.overrides import TorchFunctionMode
from transformers import AutoModelForCausalLM, PretrainedConfig

from engine.models.lora import Lora, apply_lora
from engine.models.training import prepare_for_training
from engine.models.zoo import BadCheckpoint
from engine.step.backward_reads import BackwardReads
from engine.step.hooks import hook_gradients, install, wrap_outputs
from engine.step.micro_batches import scaled_loss
from engine.step.non_model import LiveBytes
from engine.step.tied_uses import TiedUses

__all__ = ["Event", "record_step"]

# --- recording one step on the meta device ---------------------------------------------
#
# A recording is a flat list of events, in the order the engine would see them:
#   ("point", module name, phase)  a module's chunks are fetched (engine._point)
#   ("point", module name, "backward", fetch)  a module's backward begins; `fetch`: its
#                                  chunks are fetched (False: it reads none of its
#                                  parameters, engine.step.backward_reads)
#   ("post", module name)          a module's forward is done (its parameters leave COMPUTE)
#   ("done", module name)          a module with frozen parameters has computed its inputs'
#                                  gradients (its frozen parameters leave COMPUTE)
#   ("nm", delta)                  non-model bytes change by delta (an op allocated, a storage
#                                  was freed)
#   ("grad", parameter name, last) a parameter's gradient arrives; for a tied one, one use's,
#                                  and `last` says whether its last (engine.step.tied_uses)
#   ("backward",)                  forward is over; the loss's backward starts

Event = tuple
_NAMED = ("point", "post", "done", "grad")  # the events that name a module or parameter


class _Recorder(LiveBytes):
    """The engine's NonModelCounter for meta tensors, writing events instead of peaks.

    Parameters exist before the step, so no op allocates them: model data is left out
    exactly as the engine leaves its chunk payloads out. Gradients are freed as soon as
    they arrive (the engine copies them into chunks' buffers or keeps them as model data,
    which the replay counts).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(lambda delta: self.events.append(("nm", delta)))
        self.names = {id(p): n for n, p in model.named_parameters()}
        self.events: list[Event] = []


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
    config: PretrainedConfig, dtype: torch.dtype, checkpointing: bool, lora: Lora | None = None
) -> torch.nn.Module:
    """The model on the meta device in the compute dtype, in training mode (with `lora`'s
    adapters, as a LoRA run wraps it)."""
    with torch.device("meta"):
        try:
            model = AutoModelForCausalLM.from_config(config)
        except ValueError as error:
            raise BadCheckpoint(f"not a causal language model: {error}") from error
    if lora is not None:
        model = apply_lora(model, lora)
    model.to(dtype)  # parameters only change dtype in place: tied ones stay tied
    prepare_for_training(model)
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


def _record(model: torch.nn.Module, batch_size: int, seq_len: int, loss_scale: float
            ) -> list[Event]:
    """Run forward and backward of one batch with the engine's hooks, on the meta device,
    backward from the loss scaled as the engine scales it (scaled_loss)."""
    rec = _Recorder(model)
    names = {m: n for n, m in model.named_modules()}
    modules = list(model.modules())
    events = rec.events
    in_backward = False

    def pre_forward(key: int) -> None:
        events.append(("point", names[modules[key]], "forward"))
        if not in_backward:
            tied.enter(modules[key])
            reads.enter(key)

    def post_forward(key: int, output: object) -> object:
        tied.leave(modules[key])
        reads.leave(key, modules[key].parameters(recurse=False))
        events.append(("post", names[modules[key]]))
        if torch.is_grad_enabled():
            return wrap_outputs(output, lambda: events.append(
                ("point", names[modules[key]], "backward", reads.reads(key))))
        return output

    def after_backward(key: int) -> None:
        events.append(("done", names[modules[key]]))

    def on_grad(param: torch.nn.Parameter) -> None:
        events.append(("grad", rec.names[id(param)], True))
        param.grad = None

    def on_use_grad(param: torch.nn.Parameter, alias: torch.nn.Parameter) -> None:
        events.append(("grad", rec.names[id(param)], not tied.pending(param)))
        alias.grad = None

    tied = TiedUses(model, on_use_grad)
    reads = BackwardReads()
    handles, _ = install(model, pre_forward=pre_forward, post_forward=post_forward,
                         after_backward=after_backward)
    grad_hooks: dict[int, object] = {}
    hook_gradients(model.parameters(), on_grad, grad_hooks)
    handles += grad_hooks.values()
    try:
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
        with rec:
            with _CpuAttention(), reads.watching():
                loss = model(input_ids=ids, labels=ids).loss
            events.append(("backward",))
            in_backward = True
            scaled_loss(loss, loss_scale).backward()
            del loss
    finally:
        tied.leave_all()
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
            e[0] in _NAMED and layer_of(e[1]) not in (None, layer)
            for e in events_of
        ):
            return None  # a layer's segment touches another layer: not a plain stack

    def copy(backward: bool, target: int) -> list[Event]:
        source = sources[target]
        old, new = f"{stack}.{source}.", f"{stack}.{target}."
        return [
            (e[0], new + e[1][len(old) :], *e[2:])
            if e[0] in _NAMED and e[1].startswith(old)
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


# Recordings kept for the shapes recorded last: a tune or a fit plans one model at one batch
# shape under many budgets, margins and policies, and the recording is most of a plan's time
# (1.2 s of 1.3 s for `tiny`). Events are tuples of names, numbers and flags: shared as they are.
RECORDINGS_KEPT = 16
_recorded: OrderedDict[tuple, tuple[Event, ...]] = OrderedDict()


def record_step(
    config: PretrainedConfig,
    dtype: torch.dtype,
    batch_size: int,
    seq_len: int,
    checkpointing: bool,
    *,
    trace_layers: int,
    lora: Lora | None = None,
    loss_scale: float = 1.0,
) -> list[Event]:
    """The recording of one step of `config`'s model at this batch shape, backward starting
    from the loss times `loss_scale` (Engine.step's: 1 / micro-batches, times fp16's loss
    scale; only whether it is 1 changes the bytes).

    A model deeper than `trace_layers`, with one stack of like layers, is traced
    `trace_layers` deep and its inner layer repeated; any other is traced whole. The same
    model, shape and adapters recorded again come from the last RECORDINGS_KEPT recordings.
    """
    key = (type(config), config.to_json_string(use_diff=False), dtype, batch_size, seq_len,
           checkpointing, trace_layers, repr(lora),  # repr: adapters named in a list too
           loss_scale != 1.0)
    if (kept := _recorded.get(key)) is None:
        # A copy: building the model turns its config's cache off, and the caller's is theirs.
        kept = tuple(_record_step(copy.deepcopy(config), dtype, batch_size, seq_len, checkpointing,
                                  trace_layers=trace_layers, lora=lora, loss_scale=loss_scale))
        _recorded[key] = kept
        if len(_recorded) > RECORDINGS_KEPT:
            _recorded.popitem(last=False)
    _recorded.move_to_end(key)
    return list(kept)


def _record_step(config: PretrainedConfig, dtype: torch.dtype, batch_size: int, seq_len: int,
                 checkpointing: bool, *, trace_layers: int, lora: Lora | None,
                 loss_scale: float = 1.0) -> list[Event]:
    layers = getattr(config, "num_hidden_layers", None)
    uniform = len(set(getattr(config, "layer_types", None) or [None])) == 1
    if isinstance(layers, int) and layers > trace_layers and uniform:
        small = config.__class__.from_dict(config.to_dict())
        small.num_hidden_layers = trace_layers
        if getattr(small, "layer_types", None):
            small.layer_types = small.layer_types[:trace_layers]
        model = _meta_model(small, dtype, checkpointing, lora)
        stack = _layer_stack(model, trace_layers)
        if stack is not None:
            events = _record(model, batch_size, seq_len, loss_scale)
            expanded = _expand(events, stack, trace_layers, layers)
            if expanded is not None:
                return expanded
    return _record(_meta_model(config, dtype, checkpointing, lora), batch_size, seq_len,
                   loss_scale)
