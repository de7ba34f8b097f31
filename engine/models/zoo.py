"""The model zoo: OPT configs built locally, and local Hugging Face checkpoint folders.

Nothing here touches a network hub. A zoo name is turned into a model from a config that
matches the published one; a folder is loaded with transformers, local files only.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    PretrainedConfig,
)

from engine.models.training import prepare_for_training

__all__ = [
    "KNOWN_MODELS",
    "BadCheckpoint",
    "ModelInfo",
    "UnknownModel",
    "build_model",
    "count_parameters",
    "is_model_folder",
    "list_models",
    "meta_model",
    "model_config",
]

# Shape of each OPT size as published (hidden, layers, heads, ffn); every size shares the
# 50272-token GPT-2 vocabulary (padded to a multiple of 8) and 2048 learned positions.
_OPT_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "opt-125m": (768, 12, 12, 3072),
    "opt-350m": (1024, 24, 16, 4096),
    "opt-1.3b": (2048, 24, 32, 8192),
    "opt-2.7b": (2560, 32, 32, 10240),
    "opt-6.7b": (4096, 32, 32, 16384),
    "opt-13b": (5120, 40, 40, 20480),
    "opt-30b": (7168, 48, 56, 28672),
}

KNOWN_MODELS: tuple[str, ...] = ("tiny", *_OPT_SHAPES)

# Weight files a checkpoint folder may hold; safetensors first, the format we write.
_WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


class UnknownModel(ValueError):
    """A model name that is neither in the zoo nor a folder on disk."""

    def __init__(self, name: str) -> None:
        known = ", ".join(KNOWN_MODELS)
        if any(mark in name for mark in ("/", os.sep, "~")) or name.startswith("."):
            message = f"no model folder at {name!r}; zoo models: {known}"
        else:
            message = f"unknown model {name!r}; known: {known}, or a local model folder"
        super().__init__(message)


class BadCheckpoint(ValueError):
    """A local model folder that is missing files or cannot be read."""


@dataclass
class ModelInfo:
    """One zoo entry as `tuitrain models` lists it."""

    name: str
    parameters: int  # unique elements; a tied lm_head counts once
    layers: int
    hidden: int


def _zoo_config(name: str) -> OPTConfig:
    if name == "tiny":
        # Milliseconds per step on a CPU. The vocabulary holds the 8000-token BPE trained on
        # the default corpus; dropout is off so that two runs of a test draw no random masks
        # and can be compared exactly.
        return OPTConfig(
            vocab_size=8192,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=256,
            max_position_embeddings=512,
            word_embed_proj_dim=64,
            dropout=0.0,
            attention_dropout=0.0,
            architectures=["OPTForCausalLM"],
        )
    hidden, layers, heads, ffn = _OPT_SHAPES[name]
    # opt-350m alone embeds words in 512 dims (projected in and out of the 1024-wide
    # decoder) and normalises after each block instead of before.
    small_embed = name == "opt-350m"
    return OPTConfig(
        vocab_size=50272,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        ffn_dim=ffn,
        max_position_embeddings=2048,
        word_embed_proj_dim=512 if small_embed else hidden,
        do_layer_norm_before=not small_embed,
        dropout=0.1,
        attention_dropout=0.0,
        activation_function="relu",
        architectures=["OPTForCausalLM"],
    )


def is_model_folder(path: str | os.PathLike) -> bool:
    """Whether `path` is a folder holding a config.json and at least one weight file."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        return False
    return any(any(folder.glob(pattern)) for pattern in _WEIGHT_PATTERNS)


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def _local_folder(name_or_path: str) -> Path | None:
    """The folder behind `name_or_path`, None for a zoo name; raises for anything else."""
    if name_or_path in KNOWN_MODELS:
        return None
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise UnknownModel(name_or_path)
    if not path.is_dir():
        raise BadCheckpoint(f"{name_or_path} is a file, not a model folder (config.json + weights)")
    if not (path / "config.json").is_file():
        raise BadCheckpoint(f"model folder {name_or_path} has no config.json")
    return path


def model_config(name_or_path: str) -> PretrainedConfig:
    """The transformers config of a zoo name or of a local folder's config.json.

    Raises:
        UnknownModel: the name is not in the zoo and no such path exists.
        BadCheckpoint: the folder has no config.json or it cannot be read.
    """
    folder = _local_folder(name_or_path)
    if folder is None:
        return _zoo_config(name_or_path)
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
        raise BadCheckpoint(
            f"cannot read {folder / 'config.json'}: {_first_line(error)}"
        ) from error


def meta_model(name_or_path: str) -> torch.nn.Module:
    """The model with every tensor on the meta device: shapes only, no memory.

    For planning and counting; a zoo name or a local folder (its config alone is read).
    """
    config = model_config(name_or_path)
    with torch.device("meta"):
        if name_or_path in KNOWN_MODELS:
            return OPTForCausalLM(config)
        try:
            return AutoModelForCausalLM.from_config(config)
        except ValueError as error:  # a config.json of a model type that is not a causal LM
            raise BadCheckpoint(f"{name_or_path}: {_first_line(error)}") from error


@cache
def _zoo_count(name: str) -> int:
    return sum(p.numel() for p in meta_model(name).parameters())


def count_parameters(name_or_path: str) -> int:
    """Unique parameter elements (tied weights once), counted on the meta device."""
    if name_or_path in KNOWN_MODELS:
        return _zoo_count(name_or_path)
    return sum(p.numel() for p in meta_model(name_or_path).parameters())


def list_models() -> list[ModelInfo]:
    """Every zoo entry, in zoo order, with its size; nothing is allocated."""
    infos = []
    for name in KNOWN_MODELS:
        config = _zoo_config(name)
        infos.append(
            ModelInfo(
                name=name,
                parameters=_zoo_count(name),
                layers=config.num_hidden_layers,
                hidden=config.hidden_size,
            )
        )
    return infos


@contextlib.contextmanager
def _seeded(seed: int) -> Iterator[None]:
    """Draw from a generator seeded with `seed`, leaving the caller's RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def _materialise(model: torch.nn.Module, device: torch.device | str) -> None:
    """Give every meta tensor uninitialised storage on `device`, once.

    `Module.to_empty` would allocate a tied tensor once per module holding it. Here a tied
    target (OPT's lm_head.weight) stays on the meta device, so that HF's init draws the
    embedding once (its padding row zeroed) and skips the target; `tie_weights` then points
    the target at the embedding.
    """
    tied_targets = set(getattr(model, "all_tied_weights_keys", None) or ())
    made: dict[int, torch.Tensor] = {}
    originals = list(model.parameters()) + list(model.buffers())  # keeps ids unique
    for prefix, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is None or f"{prefix}.{name}".lstrip(".") in tied_targets:
                continue
            if id(param) not in made:
                made[id(param)] = torch.nn.Parameter(
                    torch.empty_like(param, device=device), requires_grad=param.requires_grad
                )
            module._parameters[name] = made[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            if id(buffer) not in made:
                made[id(buffer)] = torch.empty_like(buffer, device=device)
            module._buffers[name] = made[id(buffer)]
    del originals


def _load_folder(folder: Path, dtype: torch.dtype) -> torch.nn.Module:
    if not is_model_folder(folder):
        raise BadCheckpoint(f"model folder {folder} has no weights (*.safetensors)")
    model_config(str(folder))  # a clear error for a broken config.json before loading
    try:
        return AutoModelForCausalLM.from_pretrained(folder, local_files_only=True, dtype=dtype)
    except Exception as error:  # safetensors, torch and transformers each raise their own
        raise BadCheckpoint(f"cannot load model folder {folder}: {_first_line(error)}") from error


def build_model(
    name_or_path: str, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """A model ready to train, in train mode and with the generation cache off.

    Args:
        name_or_path: a zoo name (see `KNOWN_MODELS`) or a local folder with config.json and
            safetensors weights.
        seed: seeds the weight initialisation of a zoo model, so a seed gives the same
            weights on every machine; the caller's RNG state is left untouched. Ignored for
            a folder, whose weights are read from disk.
        dtype: dtype of the parameters. A zoo model is created in it directly.

    A zoo model is built on the meta device and then given storage once, so the peak
    memory is one copy of the weights even for the largest sizes.

    Raises:
        UnknownModel: not a zoo name and no such path.
        BadCheckpoint: a folder whose contents are missing or cannot be read.
    """
    folder = _local_folder(name_or_path)
    if folder is not None:
        model = _load_folder(folder, dtype)
    else:
        model = meta_model(name_or_path).to(dtype)  # free on the meta device
        _materialise(model, "cpu")
        with _seeded(seed):
            model.initialize_weights()
        model.tie_weights()
        left = [name for name, p in model.named_parameters() if p.is_meta]
        if left:
            raise RuntimeError(f"{name_or_path}: parameters left without storage: {left}")
    prepare_for_training(model)
    model.train()
    return model
