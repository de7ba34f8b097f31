"""Weights and optimizer state in and out of chunks, by parameter name.

By name rather than by chunk, so a checkpoint survives a different chunk layout (another
chunk size or precision) and loads with safetensors, never unpickling anything.
"""

from __future__ import annotations

import torch

from engine.chunks.chunk import Chunk, Slot

KINDS = ("master", "exp_avg", "exp_avg_sq")


def model_state_dict(model: torch.nn.Module, slot_of: dict[int, tuple[Chunk, Slot]]
                     ) -> dict[str, torch.Tensor]:
    """Full-precision weights on the CPU under the model's own names (tied names too)."""
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict(keep_vars=True).items():
        hit = slot_of.get(id(value))
        if hit is None:  # a buffer
            out[name] = value.detach().cpu().clone()
        else:
            chunk, slot = hit
            flat = chunk.master[slot.offset:slot.offset + slot.numel]
            out[name] = flat.detach().cpu().clone().view(slot.shape)
    return out


def optimizer_tensors(chunks: list[Chunk]) -> dict[str, torch.Tensor]:
    """`{kind}/{parameter name}` -> fp32 CPU tensor, for master, moments and step."""
    tensors: dict[str, torch.Tensor] = {}
    for c in chunks:
        for s in c.slots:
            sl = slice(s.offset, s.offset + s.numel)
            for kind in KINDS:
                tensors[f"{kind}/{s.name}"] = getattr(c, kind)[sl].cpu().clone()
            tensors[f"step/{s.name}"] = torch.tensor([float(s.steps)])
    return tensors


def load_optimizer_tensors(chunks: list[Chunk], tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of optimizer_tensors(); checks every name and size before changing anything."""
    for c in chunks:
        for s in c.slots:
            for kind in (*KINDS, "step"):
                key = f"{kind}/{s.name}"
                if key not in tensors:
                    raise ValueError(f"state has no {key}")
                want = 1 if kind == "step" else s.numel
                if tensors[key].numel() != want:
                    raise ValueError(f"{key}: {tensors[key].numel()} elements, expected {want}")
    for c in chunks:
        for s in c.slots:
            sl = slice(s.offset, s.offset + s.numel)
            for kind in KINDS:
                getattr(c, kind)[sl].copy_(tensors[f"{kind}/{s.name}"].reshape(-1))
            s.steps = int(tensors[f"step/{s.name}"].reshape(-1)[0])
