"""A LoRA adapter merged into its base model a tensor at a time: what peft's
`merge_and_unload` gives, without the base model ever existing whole in host memory.

The base is a model on the meta device with its WeightSource (engine.models.zoo.meta_build:
a fresh init from the run's seed, or a local folder read tensor by tensor), wrapped by peft
with adapters whose weights (small) are real. `merged_tensors` makes each base weight, adds
its adapters' update (peft's own `get_delta_weight`: scaling x B @ A, transposed where the
layer stores its weight so) and hands it on before the next is made: at most one module's
weights and one update are held.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from engine.models.weight_source import WeightSource

__all__ = ["merged_tensors"]


def merged_tensors(entries: Sequence[tuple[str, torch.Tensor]], weights: WeightSource,
                   adapted: torch.nn.Module, adapter: str = "default",
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, fp32 CPU tensor) for each of `entries`, the base model's state by the names it
    saves under (taken before peft wrapped it): a parameter made by `weights` with the
    updates of `adapter` in `adapted` (the wrapped base) added, a buffer as it is. Each
    tensor is the caller's, made when the iterator reaches it."""
    from peft.tuners.lora import LoraLayer

    updates: dict[int, list[LoraLayer]] = {}  # id(base weight) -> the layers adapting it
    for module in adapted.modules():
        if isinstance(module, LoraLayer):
            weight = module.get_base_layer().weight
            updates.setdefault(id(weight), []).append(module)
    params = [t for _, t in entries if isinstance(t, torch.nn.Parameter)]
    values = weights.tensors(params)
    for name, tensor in entries:
        if not isinstance(tensor, torch.nn.Parameter):
            yield name, tensor.detach()  # a buffer: already on the CPU
            continue
        value = next(values).to(torch.float32)
        with torch.no_grad():
            for layer in updates.get(id(tensor), ()):
                value += layer.get_delta_weight(adapter)
        yield name, value
