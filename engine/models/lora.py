"""LoRA adapters from peft on a model the engine trains, seeded so that placement never
changes them.

peft (`LoraConfig`, `get_peft_model`) wraps the targeted linear layers; every base weight
is then frozen (`requires_grad` False), and the engine keeps those in payload-only chunks
(engine.chunks.packing). What peft would draw for the adapters comes from the global random
state in module order, which depends on when and where the model is materialised; here each
adapter weight is drawn from a generator of its own, seeded by the run's seed and the
weight's name, so a model wrapped on the meta device and materialised a chunk at a time gets
the weights a model wrapped whole in host memory gets.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.models.weight_source import WeightSource

__all__ = ["ALL_LINEAR", "Lora", "LoraWeights", "apply_lora", "initialise_lora",
           "is_lora_parameter", "lora_parameter_init", "parameter_counts"]

ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head


@dataclass(frozen=True)
class Lora:
    """What to adapt and how (peft's LoraConfig, in the run's words).

    rank: the adapters' inner dimension r.
    alpha: the update is scaled by alpha / rank; None: 2 x rank (a scale of 2, the usual
        choice, so that changing the rank does not change the learning rate's meaning much).
    dropout: probability that an input element of an adapter is zeroed in training; drawn
        from the global random state, so the run's seed fixes it as it fixes the model's.
    targets: "all-linear", or the names (last parts, as peft matches them) of the modules
        to adapt, such as ("q_proj", "v_proj").
    """

    rank: int
    alpha: float | None = None
    dropout: float = 0.0
    targets: str | tuple[str, ...] = ALL_LINEAR

    @property
    def scale_alpha(self) -> float:
        return float(self.alpha) if self.alpha is not None else 2.0 * self.rank


class NoTargets(ValueError):
    """LoRA targets that match no module of the model."""


def is_lora_parameter(name: str) -> bool:
    """Whether the parameter called `name` (in the wrapped model) is an adapter weight."""
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name


def lora_parameter_init(name: str, tensor: torch.Tensor, seed: int) -> None:
    """Fill the adapter weight `tensor` called `name` in place: A as peft draws it (Kaiming
    uniform, a = sqrt(5)), B with zeros (the wrapped model starts as the base model). The
    draw comes from a generator seeded by `seed` and `name` alone, on the CPU, so that
    neither the order nor the device of the materialisation changes it."""
    with torch.no_grad():
        if ".lora_B." in name:
            tensor.zero_()
            return
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        cpu = torch.empty(tensor.shape, dtype=torch.float32)
        torch.nn.init.kaiming_uniform_(cpu, a=math.sqrt(5), generator=generator)
        tensor.copy_(cpu)


def initialise_lora(model: torch.nn.Module, seed: int) -> None:
    """Draw every adapter weight of `model` that has storage (lora_parameter_init); those
    still on the meta device are left for whoever materialises them."""
    for name, param in model.named_parameters():
        if is_lora_parameter(name) and not param.is_meta:
            lora_parameter_init(name, param, seed)


class LoraWeights:
    """WeightSource of a model wrapped on the meta device: its adapter weights drawn by name
    (lora_parameter_init), every other weight from `base`, the wrapped model's source.

    Args:
        model: the wrapped model (apply_lora), still on the meta device.
        base: where the base model's weights come from (engine.models.zoo.meta_build).
        seed: the run's seed, as given to apply_lora.
    """

    def __init__(self, model: torch.nn.Module, base: WeightSource, seed: int) -> None:
        self.base, self.seed = base, seed
        self.names = {id(p): name for name, p in model.named_parameters()
                      if is_lora_parameter(name)}

    def tensors(self, params: Sequence[torch.nn.Parameter]) -> Iterator[torch.Tensor]:
        start = 0
        while start < len(params):
            name = self.names.get(id(params[start]))
            if name is not None:
                value = torch.empty(params[start].shape, dtype=torch.float32)
                lora_parameter_init(name, value, self.seed)
                yield value
                start += 1
                continue
            end = start  # a run of base weights, asked of the base source at once
            while end < len(params) and id(params[end]) not in self.names:
                end += 1
            yield from self.base.tensors(params[start:end])
            start = end


def peft_wrapped(model: torch.nn.Module, config: object) -> torch.nn.Module:
    """peft's `get_peft_model(model, config)`, the caller's random state left as it was
    (what peft draws for the adapters is replaced by its caller)."""
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        # peft reads the model's `is_gradient_checkpointing`, which transformers 5 answers
        # with a FutureWarning on every LoRA command: peft's to change, not the user's, who
        # would read it above every line the command says.
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* deprecated",
                                category=FutureWarning)
        # An adapter read back names the base as its run typed it; the caller built the base.
        warnings.filterwarnings("ignore", message=".*base_model_name_or_path.* was renamed",
                                category=UserWarning)
        return get_peft_model(model, config)


def _tied_embeddings(model: torch.nn.Module) -> set[str]:
    """The last names of the input embedding and output head modules, when the two share
    one weight (tie_word_embeddings); empty otherwise."""
    config = getattr(model, "config", None)
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    ends = (model.get_input_embeddings(), model.get_output_embeddings())
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules()
            if any(m is end for end in ends if end is not None)}


def apply_lora(model: torch.nn.Module, lora: Lora, *, seed: int = 0) -> torch.nn.Module:
    """`model` wrapped with LoRA adapters (a peft PeftModel), its base weights frozen.

    Args:
        model: a causal LM, materialised or still on the meta device.
        lora: what to adapt (Lora).
        seed: seeds the adapter weights (lora_parameter_init). On a meta model the adapter
            weights stay on the meta device: whoever materialises them draws them with
            `lora_parameter_init` (or `initialise_lora` on the whole model) and this seed.

    The caller's random state is left as it was: peft's own draw is overwritten.

    Raises:
        NoTargets: `lora.targets` names no module of the model, one LoRA cannot adapt, or
            an embedding the model ties to its output head.
    """
    from peft import LoraConfig

    targets = lora.targets if isinstance(lora.targets, str) else list(lora.targets)
    if not isinstance(targets, str):
        names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        missing = [t for t in targets if t not in names]
        if missing:
            raise NoTargets(f"LoRA targets {','.join(missing)!r} match no module of the "
                            f"model")
        tied = _tied_embeddings(model) & set(targets)
        if tied:
            # The adapted input embedding would be the head's weight too once merged: the
            # merged model would not be the one trained (peft only warns).
            raise NoTargets(f"LoRA target {','.join(sorted(tied))!r}: the model's input and "
                            f"output embeddings are one weight, which an adapter merged into "
                            f"it would change for both; adapt its other layers")
    config = LoraConfig(r=lora.rank, lora_alpha=lora.scale_alpha, lora_dropout=lora.dropout,
                        target_modules=targets, task_type="CAUSAL_LM", bias="none")
    try:
        wrapped = peft_wrapped(model, config)
    except ValueError as error:
        shown = targets if isinstance(targets, str) else ",".join(targets)
        if "not found in the base model" in str(error) or "No modules were targeted" in str(error):
            raise NoTargets(f"LoRA targets {shown!r} match no module of the model") from None
        if "is not supported" in str(error):  # a block (attention, a layer), not a layer
            raise NoTargets(f"LoRA targets {shown!r} name a module LoRA cannot adapt: name its "
                            f"linear or embedding layers (q_proj,v_proj, or all-linear)") from None
        raise
    initialise_lora(wrapped, seed)
    return wrapped


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter elements of `model`, tied weights once."""
    trainable = frozen = 0
    for p in model.parameters():
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen
