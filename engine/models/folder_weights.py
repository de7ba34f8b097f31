"""A local Hugging Face folder's weights, read tensor by tensor from its safetensors files.

Each tensor is read from its file when its chunk is filled (safetensors `safe_open`, the
file opened for that one read, so no mapping of a whole file stays resident), so the whole
model never exists in host memory. A folder with only `.bin` weights is refused: those are
pickles, which can run code when loaded and cannot be read a tensor at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.initial_weights import ModelInit

__all__ = ["FolderWeights", "BadCheckpoint", "weight_files"]

INDEX = "model.safetensors.index.json"


class BadCheckpoint(ValueError):
    """A local model folder that is missing files or cannot be read."""


def weight_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it: from the index of a sharded folder
    (model.safetensors.index.json), else from the headers of its *.safetensors files."""
    index = folder / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise BadCheckpoint(f"cannot read {index}: {error}") from error
        files = {name: folder / file for name, file in weight_map.items()}
        missing = sorted({f.name for f in files.values() if not f.is_file()})
        if missing:
            raise BadCheckpoint(f"{index} names files that are not there: {', '.join(missing)}")
        return files
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        if any(folder.glob("*.bin")):
            raise BadCheckpoint(
                f"model folder {folder} holds only .bin (pickle) weights, which tuitrain does "
                f"not load; save it with safetensors (save_pretrained does by default)")
        raise BadCheckpoint(f"model folder {folder} has no weights (*.safetensors)")
    files = {}
    for shard in shards:
        try:
            with safe_open(shard, framework="pt") as f:
                files.update(dict.fromkeys(f.keys(), shard))
        except Exception as error:  # safetensors raises its own error types
            raise BadCheckpoint(f"cannot load model folder {folder}: {shard.name}: "
                                f"{_first_line(error)}") from error
    return files


def _first_line(error: BaseException) -> str:
    return (str(error).strip() or type(error).__name__).splitlines()[0]


class FolderWeights:
    """WeightSource: the tensors of a local folder, for `model` (its meta twin).

    A parameter is found under any of its names (tied ones have two), as saved by the
    model or by its base model (without the `base_model_prefix`, as some published
    checkpoints are). One that the folder does not hold is initialised as a fresh model's
    would be (`missing`), as transformers does with missing weights.
    """

    def __init__(self, folder: Path, model: torch.nn.Module, missing: ModelInit) -> None:
        self.folder, self.missing = folder, missing
        self.files = weight_files(folder)
        prefix = getattr(model, "base_model_prefix", "")
        self._keys: dict[int, str] = {}
        for name, param in model.named_parameters(remove_duplicate=False):
            for key in (name, *_prefixed(name, prefix)):
                if key in self.files and id(param) not in self._keys:
                    self._keys[id(param)] = key
        self.missing_names = [name for name, p in model.named_parameters()
                              if id(p) not in self._keys]

    def tensors(self, params: Sequence[torch.nn.Parameter]) -> Iterator[torch.Tensor]:
        for param in params:
            key = self._keys.get(id(param))
            if key is None:
                yield next(self.missing.tensors([param]))
            else:
                yield self._read(key, param.shape)

    def _read(self, key: str, shape: torch.Size) -> torch.Tensor:
        file = self.files[key]
        try:
            with safe_open(file, framework="pt") as f:
                tensor = f.get_tensor(key)
        except Exception as error:  # safetensors raises its own error types
            raise BadCheckpoint(f"cannot read {key} from {file}: {_first_line(error)}") from error
        if tensor.shape != shape:
            raise BadCheckpoint(f"{key} in {file.name} has shape {tuple(tensor.shape)}, the "
                               f"model's config says {tuple(shape)}")
        return tensor


def _prefixed(name: str, prefix: str) -> tuple[str, ...]:
    if not prefix:
        return ()
    if name.startswith(prefix + "."):
        return (name[len(prefix) + 1:],)
    return (f"{prefix}.{name}",)
