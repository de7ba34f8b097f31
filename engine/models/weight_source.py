"""Where a model made on the meta device gets its weights: a source asked for a few
parameters at a time (a chunk's), so that the whole model never exists in host memory.

Two sources: engine.models.initial_weights (a fresh model, initialised as transformers
initialises it, the seed fixing every value) and engine.models.folder_weights (a local
safetensors folder, read tensor by tensor). The engine fills each chunk from one
(engine.chunks.packing.fill); `materialise` gives a whole model its weights at once, for a
caller that wants a plain model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch

__all__ = ["WeightSource", "materialise"]


class WeightSource(Protocol):
    """The values of a model's parameters, asked for a few at a time."""

    def tensors(self, params: Sequence[torch.nn.Parameter]) -> Iterator[torch.Tensor]:
        """One CPU tensor per parameter of `params`, in order, each of its parameter's
        shape (any floating dtype: the caller converts). Each is made when the iterator
        reaches it and is the caller's: a caller that drops each before taking the next
        holds one at a time (a module's, for a fresh model)."""
        ...


def materialise(model: torch.nn.Module, weights: WeightSource,
                dtype: torch.dtype = torch.float32) -> None:
    """Give every meta parameter of `model` storage of its own on the CPU, in `dtype`,
    filled from `weights`; tied parameters stay one tensor."""
    params = [p for p in model.parameters() if p.is_meta]  # a tied one once
    for param, value in zip(params, weights.tensors(params), strict=True):
        body = torch.nn.Parameter(value.to(dtype), requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, body)  # the same Parameter object, ties kept
