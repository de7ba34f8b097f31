"""The work of one training step, counted on the meta device: matmul FLOPs and the bytes
the other ops read and write, forward, backward and recomputed, the new memory the step's
large tensors take, and the module intervals.

    work = step_work(model_config("opt-125m"), torch.float32, batch_size=2, seq_len=128,
                     checkpointing=False)
    work.forward_flops, work.backward_flops, work.recompute_flops, work.intervals

Matmuls (and attention) are compute-bound: their FLOPs come from torch.utils.flop_counter's
formulas. Every other op (norms, activations, softmax, the loss, copies) is bound by memory:
what it costs is the bytes it reads and writes, which the time model prices at the
device's elementwise bandwidth (engine.planning.calibration). A tensor at or above the
process's mapping line (engine.devices.host_memory.mapped_from; a run's steady heap draws
it at 1 MiB) is new memory on a CPU at every allocation, each page faulted in and zeroed:
its bytes are counted apart (`*_fresh`), and priced at the system's own rate. Measured on
opt-125m at 2 x 128 in plain PyTorch, its forward and backward took 0.77 s with a heap that
keeps everything, 0.91 s with glibc's own line and 1.04 s with the steady heap's.

The recomputation of activation checkpointing is the backward of a checkpointed step less
the backward of a plain one: the same layers run their forward again.

The step runs with the recording's own attention (engine.planning.recording) on a shallow
model: a stack of like layers is counted one and two layers deep and extrapolated, since
every layer does the same work.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry
from transformers import PretrainedConfig

from engine.devices.host_memory import MMAP_THRESHOLD
from engine.models.lora import Lora
from engine.planning.recording import _CpuAttention, _meta_model

__all__ = ["StepWork", "step_work"]

_aten = torch.ops.aten
# Attention as the recording runs it (the CPU's flash kernel), absent from flop_registry:
# two matmuls of queries by keys and of scores by values forward; backward recomputes the
# scores and does three more (flash attention's backward).
_ATTENTION = _aten._scaled_dot_product_flash_attention_for_cpu.default
_ATTENTION_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_ATTENTION_BACKWARD_FACTOR = 2.5
# Ops that move no data (views, metadata): writing nothing, they cost nothing here.
_FREE = {"view", "_unsafe_view", "expand", "t", "transpose", "permute", "unsqueeze", "squeeze",
         "slice", "select", "as_strided", "alias", "detach", "split", "split_with_sizes",
         "unbind", "_reshape_alias", "lift_fresh", "empty", "empty_like", "zeros",
         "new_empty", "new_zeros", "zeros_like", "empty_strided"}
# Ops that draw random numbers (dropout's mask: `bernoulli_` on the meta device and on a
# CPU). Their bytes are counted as every other op's; the numbers they draw are counted apart
# (`*_random`), since drawing them costs far more than writing them: on this machine's CPU a
# dropout over 196k fp32 elements took 1.0 ms where multiplying them took 10 us, and
# opt-125m's dropouts (p=0.1) 2.3% of its step, which its bytes priced at nothing.
_RANDOM = {"bernoulli", "rand", "rand_like", "randn", "randn_like", "randint", "randint_like",
           "normal", "uniform", "exponential", "geometric", "cauchy", "log_normal", "random",
           "native_dropout", "randperm", "multinomial"}


@dataclass(frozen=True)
class StepWork:
    """The work of one micro-batch's forward and backward, summed over the model.

    FLOPs are multiply-adds counted twice; bytes are what ops other than matmuls read and
    write (a reduction such as a bias's gradient writes little and reads a whole
    activation: the bytes it writes alone priced it at a thousandth of its time)."""

    forward_flops: float
    backward_flops: float  # the gradients' own, recomputation excluded
    recompute_flops: float  # the forward run again in backward (activation checkpointing)
    forward_bytes: float
    backward_bytes: float
    recompute_bytes: float
    intervals: int  # module intervals the engine's hooks see in a step (fetch points)
    ops: int  # aten ops dispatched: the engine's live-byte counter sees each one
    hidden: int  # width of the model: the matmul shape its throughput is looked up at
    # Parameters with gradients, which AdamW updates: every one, or a LoRA run's adapters.
    trainable: int = 0
    # Bytes of the tensors allocated at or above the mapping line step_work was given.
    forward_fresh: float = 0.0
    backward_fresh: float = 0.0
    recompute_fresh: float = 0.0
    # Random numbers drawn (dropout's masks; a checkpointed layer draws them again).
    forward_random: float = 0.0
    backward_random: float = 0.0
    recompute_random: float = 0.0

    def scaled(self, factor: float) -> StepWork:
        """This work `factor` times (micro-batches of one step)."""
        return dataclasses.replace(
            self, **{f.name: getattr(self, f.name) * factor for f in dataclasses.fields(self)
                     if f.name.endswith(("_flops", "_bytes", "_fresh", "_random"))},
            intervals=int(self.intervals * factor), ops=int(self.ops * factor))


class _Counter(TorchDispatchMode):
    """Matmul FLOPs, the bytes every other op reads and writes, the bytes of the new
    tensors at or above `mapped_from` (None: none) and the random numbers drawn, forward
    apart from backward."""

    def __init__(self, mapped_from: int | None) -> None:
        super().__init__()
        self.backward = False
        self.flops = [0.0, 0.0]
        self.bytes = [0.0, 0.0]
        self.fresh = [0.0, 0.0]
        self.random = [0.0, 0.0]
        self.mapped_from = mapped_from
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops += 1
        phase = int(self.backward)
        packet = func._overloadpacket
        if packet in flop_registry:
            self.flops[phase] += flop_registry[packet](*args, **kwargs, out_val=out)
        elif func in (_ATTENTION, _ATTENTION_BACKWARD):
            self.flops[phase] += _attention_flops(func, args)
        elif packet.__name__.rstrip("_") not in _FREE:
            moved = [*_tensors(out), *_tensors(args), *_tensors(list(kwargs.values()))]
            self.bytes[phase] += sum(t.numel() * t.element_size() for t in moved)
        if packet.__name__.rstrip("_") in _RANDOM:
            self.random[phase] += sum(t.numel() for t in _tensors(out)[:1])
        # An op whose results alias nothing allocates them (views and in-place ops do not,
        # nor `_unsafe_view`, a view whose schema says otherwise: counted, it made 49 of
        # opt-125m's 1,161 MiB of new memory a step, and 79 of a Llama-shaped model's 948).
        if (self.mapped_from is not None and packet is not _aten._unsafe_view
                and not any(r.alias_info for r in func._schema.returns)):
            sizes = (t.numel() * t.element_size() for t in _tensors(out))
            self.fresh[phase] += sum(n for n in sizes if n >= self.mapped_from)
        return out


def _tensors(values: object, depth: int = 2) -> list[torch.Tensor]:
    """The tensors of an op's output or arguments, lists included (torch.cat's inputs)."""
    if isinstance(values, torch.Tensor):
        return [values]
    if isinstance(values, (tuple, list)) and depth > 0:
        return [t for v in values for t in _tensors(v, depth - 1)]
    return []


def _attention_flops(func: object, args: tuple) -> float:
    # Forward: (query, key, value, ...); backward: (grad_out, query, key, value, ...).
    query, key = (args[0], args[1]) if func is _ATTENTION else (args[1], args[2])
    *batch, q_len, head_dim = query.shape
    k_len = key.shape[-2]
    forward = 4.0 * float(torch.Size(batch).numel()) * q_len * k_len * head_dim
    return forward if func is _ATTENTION else _ATTENTION_BACKWARD_FACTOR * forward


def _count(config: PretrainedConfig, dtype: torch.dtype, batch_size: int, seq_len: int,
           checkpointing: bool, lora: Lora | None, mapped_from: int | None
           ) -> tuple[list[float], list[float], list[float], list[float], int, int, int]:
    """(flops, bytes, fresh bytes, random numbers, intervals, ops, trainable parameters) of
    one step: the first four [forward, backward]."""
    model = _meta_model(config, dtype, checkpointing, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fired = [0]
    handles = [m.register_forward_pre_hook(lambda *_: fired.__setitem__(0, fired[0] + 1))
               for m in model.modules() if next(m.parameters(recurse=False), None) is not None]
    counter = _Counter(mapped_from)
    try:
        ids = torch.zeros(batch_size, seq_len, dtype=torch.long, device="meta")
        with counter, _CpuAttention():
            loss = model(input_ids=ids, labels=ids).loss
            forward_points = fired[0]
            counter.backward = True
            loss.backward()
    finally:
        for h in handles:
            h.remove()
    # Every module's backward is an interval of its own too (fetched again, or only
    # receiving gradients: engine.step.backward_reads); a recomputed one's forward a third
    # (its pre-hook fires again in backward).
    return (counter.flops, counter.bytes, counter.fresh, counter.random,
            forward_points + fired[0], counter.ops, trainable)


def _depth(config: PretrainedConfig, layers: int) -> PretrainedConfig:
    small = config.__class__.from_dict(config.to_dict())
    small.num_hidden_layers = layers
    if getattr(small, "layer_types", None):
        small.layer_types = small.layer_types[:layers]
    return small


@lru_cache(maxsize=32)
def _cached(config_json: str, config_class: type, dtype: torch.dtype, batch_size: int,
            seq_len: int, lora: Lora | None, mapped_from: int | None, checkpointing: bool
            ) -> tuple[list[float], list[float], list[float], list[float], int, int, int]:
    config = config_class.from_dict(json.loads(config_json))
    layers = getattr(config, "num_hidden_layers", None)
    uniform = len(set(getattr(config, "layer_types", None) or [None])) == 1
    shape = (dtype, batch_size, seq_len, checkpointing, lora, mapped_from)
    if not (isinstance(layers, int) and layers > 2 and uniform):
        return _count(config, *shape)
    one = _count(_depth(config, 1), *shape)
    two = _count(_depth(config, 2), *shape)
    # Work grows by the same amount with every layer: base + layers x one layer's.
    flops, nbytes, fresh, random = (
        [a + (layers - 1) * (b - a) for a, b in zip(x, y, strict=True)]
        for x, y in ((one[i], two[i]) for i in (0, 1, 2, 3)))
    intervals, ops, trainable = (one[i] + (layers - 1) * (two[i] - one[i]) for i in (4, 5, 6))
    return flops, nbytes, fresh, random, intervals, ops, trainable


def step_work(config: PretrainedConfig, dtype: torch.dtype, *, batch_size: int, seq_len: int,
              checkpointing: bool, lora: Lora | None = None,
              mapped_from: int | None = MMAP_THRESHOLD) -> StepWork:
    """The work of one forward and backward of `config`'s model on a batch of this shape
    (with `lora`'s adapters: the frozen base weights get no gradient, so backward computes
    the inputs' gradients alone through them). `mapped_from`: the size from which a tensor
    is new memory (the steady heap's line, as a run keeps it; None: no tensor is).

    Nothing is allocated (the model lives on the meta device); a few tenths of a second."""
    key = (config.to_json_string(use_diff=False), type(config), dtype, batch_size, seq_len,
           lora, mapped_from)
    *measures, intervals, ops, trainable = _cached(*key, checkpointing)
    # What a checkpointed step's backward does beyond a plain one's is the recomputation.
    recompute = [0.0] * len(measures)
    if checkpointing:
        plain = _cached(*key, False)[:len(measures)]
        recompute = [max(0.0, m[1] - p[1]) for m, p in zip(measures, plain, strict=True)]
    parts = {}
    for name, (forward, backward), again in zip(("flops", "bytes", "fresh", "random"),
                                                measures, recompute, strict=True):
        parts |= {f"forward_{name}": forward, f"backward_{name}": backward - again,
                  f"recompute_{name}": again}
    return StepWork(
        intervals=intervals,
        ops=ops,
        hidden=int(getattr(config, "hidden_size", 0) or getattr(config, "n_embd", 0) or 0),
        trainable=trainable,
        **parts,
    )
