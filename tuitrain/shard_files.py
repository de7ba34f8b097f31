"""Sharded safetensors: tensors written shard by shard as they come, read back one by one.

So that a checkpoint of a model larger than host memory never holds it whole. The layout is
Hugging Face's, the one `from_pretrained` reads:

    NAME.safetensors                      everything, when it fits in one shard; else
    NAME-00001-of-00003.safetensors ...   the shards, in the order the tensors came, and
    NAME.safetensors.index.json           {"metadata": {"total_size": bytes of tensors},
                                           "weight_map": {tensor name: its shard's file}}

Data parallel, each rank writes its own pieces of the optimizer state as NAME-rank-R-of-W
(in that same layout), and RANKS_LAYOUT says which elements of each tensor every rank's
file holds, so that RankFiles reads back any range of any tensor from the pieces:

    NAME-ranks.json   {"world": W, "files": [NAME-rank-00000-of-0000W, ...],
                       "tensors": {tensor name: {"numel": elements of the whole tensor,
                                                 "pieces": [[rank, lo, hi], ...]}}}
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# Most bytes of tensors one shard holds (a tensor larger than this gets a shard of its own):
# what writing a checkpoint holds in host memory beyond one chunk of the engine's.
SHARD_BYTES = 1 << 30
# What transformers checks in a shard's header before it reads the tensors.
METADATA = {"format": "pt"}


def index_name(name: str) -> str:
    return f"{name}.safetensors.index.json"


class ShardWriter:
    """Tensors given one at a time into `folder` as shards of NAME, each of at most
    `max_bytes`: the shard being filled is all it holds. `close()` names the files (their
    count is known only then) and writes the index."""

    def __init__(self, folder: Path, name: str, max_bytes: int = SHARD_BYTES) -> None:
        self.folder, self.name, self.max_bytes = Path(folder), name, max_bytes
        self._shard: dict[str, torch.Tensor] = {}
        self._shard_bytes = 0
        self._written: list[tuple[Path, list[str]]] = []  # (file so far, its tensor names)
        self._names: set[str] = set()
        self.total_size = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if name in self._names:
            raise ValueError(f"{self.name}: {name} given twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._shard and self._shard_bytes + nbytes > self.max_bytes:
            self._flush()
        self._names.add(name)
        self._shard[name] = tensor.contiguous()
        self._shard_bytes += nbytes
        self.total_size += nbytes

    def _flush(self) -> None:
        path = self.folder / f"{self.name}-{len(self._written) + 1:05d}.partial"
        save_file(self._shard, path, metadata=METADATA)
        self._written.append((path, list(self._shard)))
        self._shard, self._shard_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard and the index; returns the files written, by name."""
        if self._shard or not self._written:
            self._flush()
        count = len(self._written)
        if count == 1:
            final = f"{self.name}.safetensors"
            os.rename(self._written[0][0], self.folder / final)
            return [final]
        weight_map: dict[str, str] = {}
        for number, (path, names) in enumerate(self._written, 1):
            final = f"{self.name}-{number:05d}-of-{count:05d}.safetensors"
            os.rename(path, self.folder / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_size}, "weight_map": weight_map}
        (self.folder / index_name(self.name)).write_text(json.dumps(index, indent=2))
        return [*dict.fromkeys(weight_map.values()), index_name(self.name)]


class ShardedTensors(Mapping[str, torch.Tensor]):
    """The tensors of NAME in `folder` (one file, or shards and their index), each read from
    its file when asked for, with one file open at a time: holding none of them itself.
    Opening reads the headers only; `numels` gives each tensor's element count from them.
    Raises OSError or ValueError (safetensors' own errors too) naming what is wrong."""

    def __init__(self, folder: Path, name: str) -> None:
        folder = Path(folder)
        index = folder / index_name(name)
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                files = {key: folder / file for key, file in weight_map.items()}
            except (KeyError, TypeError, AttributeError, ValueError) as err:
                raise ValueError(f"{index} is not a shard index: {err}") from None
        else:
            single = folder / f"{name}.safetensors"
            with safe_open(single, "pt") as f:
                files = dict.fromkeys(f.keys(), single)
        self._file_of = files
        self.numels: dict[str, int] = {}
        for path in dict.fromkeys(files.values()):
            with safe_open(path, "pt") as f:
                for key in f.keys():
                    if files.get(key) == path:
                        self.numels[key] = _numel(f.get_slice(key).get_shape())
        missing = [key for key in files if key not in self.numels]
        if missing:
            raise ValueError(f"{files[missing[0]]} lacks {missing[0]}, which "
                             f"{index.name} puts there")
        self._open: tuple[Path, object] | None = None
        self._stack = contextlib.ExitStack()

    def _file(self, key: str):
        path = self._file_of[key]
        if self._open is None or self._open[0] != path:
            self.close()
            self._open = (path, self._stack.enter_context(safe_open(path, "pt")))
        return self._open[1]

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._file(key).get_tensor(key)

    def read(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of tensor `key` flattened, reading those alone (a 1-D tensor,
        as the optimizer state is, is sliced in the file; any other is read whole)."""
        part = self._file(key).get_slice(key)
        if len(part.get_shape()) == 1:
            return part[lo:hi]
        return part[:].reshape(-1)[lo:hi]

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def __contains__(self, key: object) -> bool:
        return key in self._file_of

    def close(self) -> None:
        self._stack.close()
        self._open = None

    def __enter__(self) -> ShardedTensors:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def rank_name(name: str, rank: int, world: int) -> str:
    return f"{name}-rank-{rank:05d}-of-{world:05d}"


def layout_name(name: str) -> str:
    return f"{name}-ranks.json"


def write_layout(folder: Path, name: str, world: int,
                 pieces: dict[str, list[tuple[int, int, int]]]) -> str:
    """Write NAME-ranks.json: which elements of each tensor (`pieces`, name -> [(rank, lo,
    hi)], which together cover it) the file of each of `world` ranks holds; returns its
    file name."""
    record = {"world": world, "files": [rank_name(name, r, world) for r in range(world)],
              "tensors": {key: {"numel": max(hi for _, _, hi in parts),
                                "pieces": [list(p) for p in parts]}
                          for key, parts in pieces.items()}}
    (Path(folder) / layout_name(name)).write_text(json.dumps(record))
    return layout_name(name)


class RankFiles:
    """The tensors of NAME written by every rank for its own pieces (NAME-ranks.json and one
    ShardedTensors per rank), read by ranges: `read(key, lo, hi)` reads from each rank's
    file only the elements of [lo, hi) it holds. Opening reads the layout and the files'
    headers and checks that they agree (every piece there, of its size; each tensor's
    pieces cover it exactly, once); ValueError (OSError for a missing file) naming what is
    wrong."""

    def __init__(self, folder: Path, name: str) -> None:
        folder = Path(folder)
        path = folder / layout_name(name)
        try:
            record = json.loads(path.read_text())
            world, files = int(record["world"]), list(record["files"])
            tensors = {key: (int(t["numel"]), [tuple(map(int, p)) for p in t["pieces"]])
                       for key, t in record["tensors"].items()}
        except (KeyError, TypeError, AttributeError, ValueError) as err:
            raise ValueError(f"{path} is not a rank layout: {err}") from None
        if files != [rank_name(name, r, world) for r in range(world)]:
            raise ValueError(f"{path} names {len(files)} rank files for a world of {world}")
        self.world = world
        self.ranks: list[ShardedTensors] = []
        self._stack = contextlib.ExitStack()
        try:
            for file in files:
                self.ranks.append(self._stack.enter_context(ShardedTensors(folder, file)))
            self._check(path, tensors, files)
        except BaseException:
            self.close()
            raise
        self._pieces = {key: sorted(parts, key=lambda p: p[1])
                        for key, (_, parts) in tensors.items()}
        self.numels = {key: numel for key, (numel, _) in tensors.items()}

    def _check(self, path: Path, tensors: dict, files: list[str]) -> None:
        for key, (numel, pieces) in tensors.items():
            for rank, lo, hi in pieces:
                if not 0 <= rank < self.world:
                    raise ValueError(f"{path}: {key} has a piece on rank {rank}, outside "
                                     f"the world of {self.world}")
                have = self.ranks[rank].numels.get(key)
                if have != hi - lo:
                    raise ValueError(f"{files[rank]} holds {have} elements of {key}; "
                                     f"{path.name} says {hi - lo}")
            if key.startswith("step/"):
                if not pieces or any((lo, hi) != (0, numel) for _, lo, hi in pieces):
                    raise ValueError(f"{path}: the pieces of {key} are not whole counts")
                continue
            edge = 0
            for _, lo, hi in sorted(pieces, key=lambda p: p[1]):
                if lo != edge:
                    break
                edge = hi
            if edge != numel or sum(hi - lo for _, lo, hi in pieces) != numel:
                raise ValueError(f"{path}: the pieces of {key} do not cover its {numel} "
                                 f"elements once each")

    def read(self, key: str, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of tensor `key` flattened, from the pieces that hold them."""
        parts = []
        for rank, a, b in self._pieces[key]:
            start, stop = max(a, lo), min(b, hi)
            if start < stop:
                parts.append(self.ranks[rank].read(key, start - a, stop - a))
                if key.startswith("step/"):
                    break  # every rank that holds a count holds the same one
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> RankFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _numel(shape: list[int]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count
