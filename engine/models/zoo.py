"""The model zoo: OPT and Llama configs built locally, and local Hugging Face folders.

Nothing here touches a network hub. A zoo name is turned into a model from a config that
matches the published one; a folder is loaded with transformers, local files only.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    OPTConfig,
    PretrainedConfig,
)

from engine.models.folder_weights import BadCheckpoint, FolderWeights
from engine.models.initial_weights import ModelInit
from engine.models.names import (
    KNOWN_MODELS,
    LLAMA_POSITIONS,
    LLAMA_SHAPES,
    OPT_POSITIONS,
    OPT_SHAPES,
    TINY_POSITIONS,
    UnknownModel,
)
from engine.models.training import prepare_for_training
from engine.models.weight_source import WeightSource, materialise

__all__ = [
    "KNOWN_MODELS",
    "BadCheckpoint",
    "MetaBuild",
    "ModelInfo",
    "UnknownModel",
    "build_model",
    "count_parameters",
    "is_model_folder",
    "list_models",
    "meta_build",
    "meta_model",
    "model_config",
]

# Weight files a checkpoint folder may hold: safetensors, or pickles we refuse with a reason.
_WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


@dataclass
class ModelInfo:
    """One zoo entry as `tuitrain models` lists it."""

    name: str
    parameters: int  # unique elements; a tied lm_head counts once
    layers: int
    hidden: int


def _llama_config(name: str) -> LlamaConfig:
    hidden, layers, heads, kv_heads, ffn, head_dim, tied, factor = LLAMA_SHAPES[name]
    return LlamaConfig(
        vocab_size=128256,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=LLAMA_POSITIONS,
        initializer_range=0.02,
        rms_norm_eps=1e-5,
        bos_token_id=128000,
        eos_token_id=128001,
        tie_word_embeddings=tied,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": factor,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        architectures=["LlamaForCausalLM"],
    )


def _zoo_config(name: str) -> PretrainedConfig:
    if name in LLAMA_SHAPES:
        return _llama_config(name)
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
            max_position_embeddings=TINY_POSITIONS,
            word_embed_proj_dim=64,
            dropout=0.0,
            attention_dropout=0.0,
            architectures=["OPTForCausalLM"],
        )
    hidden, layers, heads, ffn = OPT_SHAPES[name]
    # opt-350m alone embeds words in 512 dims (projected in and out of the 1024-wide
    # decoder) and normalises after each block instead of before.
    small_embed = name == "opt-350m"
    return OPTConfig(
        vocab_size=50272,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        ffn_dim=ffn,
        max_position_embeddings=OPT_POSITIONS,
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


@dataclass
class MetaBuild:
    """A model on the meta device and where its weights come from: the engine fills its
    chunks from `weights` one at a time (Engine(model, config, weights=...))."""

    model: torch.nn.Module
    weights: WeightSource


def meta_build(
    name_or_path: str,
    *,
    seed: int = 0,
    transform: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
) -> MetaBuild:
    """A model ready to train, its parameters still on the meta device, and their source.

    Args:
        name_or_path: a zoo name (see `KNOWN_MODELS`) or a local folder with config.json and
            safetensors weights (sharded or not).
        seed: fixes a zoo model's weights (engine.models.initial_weights), the same
            whatever the placement and however the chunks are filled; for a folder, the
            weights it lacks. The caller's RNG state is left untouched.
        transform: changes the meta model before its chunks are made (adapters wrapped
            around it), and returns the model to train. The weights stay those of the
            model before the transform; parameters the transform adds are initialised
            by their module, found in the model when first asked for.

    Raises:
        UnknownModel: not a zoo name and no such path.
        BadCheckpoint: a folder whose contents are missing or cannot be read, or whose
            weights are only pickled `.bin` files.
    """
    folder = _local_folder(name_or_path)
    model = meta_model(name_or_path)
    fresh = ModelInit(model, seed)
    weights: WeightSource = fresh if folder is None else FolderWeights(folder, model, fresh)
    if transform is not None:
        model = transform(model)
    prepare_for_training(model)
    model.train()
    return MetaBuild(model, weights)


def build_model(
    name_or_path: str, *, seed: int = 0, dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """A model ready to train, in train mode and with the generation cache off, its weights
    in host memory: `meta_build`'s, made whole.

    Args:
        name_or_path: a zoo name (see `KNOWN_MODELS`) or a local folder with config.json and
            safetensors weights.
        seed: seeds the weight initialisation of a zoo model, so a seed gives the same
            weights on every machine, and the same as an engine filling its chunks from
            `meta_build`; the caller's RNG state is left untouched. A folder's weights are
            read from disk.
        dtype: dtype of the parameters.

    Raises:
        UnknownModel: not a zoo name and no such path.
        BadCheckpoint: a folder whose contents are missing or cannot be read.
    """
    built = meta_build(name_or_path, seed=seed)
    materialise(built.model, built.weights, dtype)
    return built.model
