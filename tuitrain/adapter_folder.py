"""A LoRA run's checkpoint holds its adapters as a PEFT adapter folder, the form users load
them with (`PeftModel.from_pretrained(base, folder)`), not the whole model: the base
weights never changed, and the run rebuilds them from its model and seed.

    adapter/adapter_config.json        peft's LoraConfig
    adapter/adapter_model.safetensors  the adapter weights under peft's names
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.models.lora import is_lora_parameter

ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "default"  # peft's name for the one adapter a model gets


def is_adapted(model: torch.nn.Module) -> bool:
    """Whether `model` is wrapped with LoRA adapters (a peft PeftModel)."""
    return hasattr(model, "peft_config")


def peft_name(name: str) -> str:
    """The name peft saves a parameter under: the adapter's name left out
    (`...q_proj.lora_A.default.weight` -> `...q_proj.lora_A.weight`)."""
    return name.replace(f".{ADAPTER_NAME}.", ".")


def write_adapter(folder: Path, model: torch.nn.Module,
                  pairs: Iterable[tuple[str, torch.Tensor]]) -> None:
    """The adapter folder of `model` in `folder` (made here), its weights the adapter ones
    among `pairs` (the engine's iter_model_state: name, CPU tensor), which it reads to the
    end. The adapters are a small part of the model: they are gathered, the rest passed by."""
    folder.mkdir()
    model.peft_config[ADAPTER_NAME].save_pretrained(folder)
    tensors = {peft_name(name): tensor.contiguous() for name, tensor in pairs
               if is_lora_parameter(name)}
    save_file(tensors, folder / ADAPTER_WEIGHTS, metadata={"format": "pt"})
