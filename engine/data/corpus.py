"""Training data: a corpus on disk becomes one token stream, served as fixed-length batches.

A corpus is a text file, a folder of text files, a JSONL file with a `text` field per
line, or a folder written by `datasets`' `save_to_disk` (another field or column may hold
the text: `text_field`). With none given, the standard
library's own Python sources serve: they exist wherever Python does, so a first run needs
nothing from the network. The token stream is cached next to the tokenizer, keyed by the
corpus files' sizes and modification times, so a second run starts in moments.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from engine.data.formats import TEXT_FIELD, TEXT_SUFFIXES, is_datasets_folder, is_records
from engine.data.tokenizer import (
    DEFAULT_VOCAB_SIZE,
    MIN_VOCAB_SIZE,
    cached_tokenizer,
    cached_tokens,
    folder_tokenizer,
)
from engine.models.zoo import KNOWN_MODELS, model_config

__all__ = [
    "TEXT_SUFFIXES",
    "Corpus",
    "DataError",
    "TokenBatches",
    "build_data",
    "corpus_tokens",
    "default_corpus",
    "get_tokenizer",
    "open_corpus",
    "tokenize_corpus",
]

# Standard-library folders that are not library source: installed third-party packages
# (different on every machine), the test suites, bytecode.
_STDLIB_SKIP = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
)
_READER = "corpus-v1"  # part of every corpus identity: bump when reading changes


class DataError(ValueError):
    """The training data cannot be found, read or used; the message is one line."""


@dataclass(frozen=True)
class Corpus:
    """Where the documents of a run come from.

    `files` are every file whose contents reach the token stream; their paths, sizes and
    modification times identify the corpus in the caches.
    """

    source: str  # the --data path as given, or "stdlib" for the built-in corpus
    files: tuple[Path, ...]
    datasets_folder: Path | None = None  # set when the corpus was written by `datasets`
    text_field: str = TEXT_FIELD  # the JSONL field or `datasets` column holding the text

    def identity(self) -> str:
        lines = [_READER, self.source, str(self.datasets_folder)]
        if self.text_field != TEXT_FIELD:  # the default adds nothing: older caches still match
            lines.append(f"field\t{self.text_field}")
        for path in self.files:
            stat = path.stat()
            lines.append(f"{path}\t{stat.st_size}\t{stat.st_mtime_ns}")
        return "\n".join(lines)

    def documents(self) -> Iterator[str]:
        """Every document, in a fixed order; empty and missing ones are skipped."""
        if self.datasets_folder is not None:
            texts = _dataset_texts(self.datasets_folder, self.text_field)
        else:
            texts = (text for path in self.files for text in _file_texts(path, self.text_field))
        for text in texts:
            if text is not None and not isinstance(text, str):
                raise DataError(f"{self.source}: a text holds {type(text).__name__}, not text")
            if text:
                yield text


def _read_text(path: Path) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as error:
        raise DataError(f"cannot read {path}: {error.strerror or error}") from error


def _jsonl_texts(path: Path, field: str) -> Iterator[str]:
    # Iterating the file splits at line ends only; str.splitlines would also split inside
    # records at U+2028 and friends, which JSON allows unescaped.
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise DataError(f"{path}:{number}: not valid JSON ({error.msg})") from error
                if not isinstance(record, dict) or not isinstance(record.get(field), str):
                    raise DataError(
                        f'{path}:{number}: expected an object with a string "{field}" field'
                        + _fields_found(record)
                    )
                yield record[field]
    except OSError as error:
        raise DataError(f"cannot read {path}: {error.strerror or error}") from error


def _fields_found(record: object) -> str:
    """What a JSONL record holds instead, for the message that says a field is missing."""
    if not isinstance(record, dict):
        return f" (found {type(record).__name__ if record is not None else 'null'})"
    if not record:
        return " (found no fields)"
    return f" (fields: {', '.join(map(str, record))})"


def _file_texts(path: Path, field: str) -> Iterator[str]:
    if is_records(path):
        yield from _jsonl_texts(path, field)
    else:
        yield _read_text(path)


def _dataset_split(folder: Path) -> Path:
    """The split folder to read: the folder itself, or 'train' (else the first) of a dict."""
    marker = folder / "dataset_dict.json"
    if not marker.is_file():
        return folder
    splits = json.loads(marker.read_text()).get("splits") or []
    if not splits:
        raise DataError(f"{folder}: dataset_dict.json names no splits")
    return folder / ("train" if "train" in splits else splits[0])


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


def _dataset_texts(folder: Path, field: str) -> Iterator[str]:
    try:
        yield from _read_dataset(folder, field)
    except DataError:
        raise
    except Exception as error:  # datasets, pyarrow and json each raise their own types
        line = (str(error).strip() or type(error).__name__).splitlines()[0]
        raise DataError(f"cannot read the datasets folder {folder}: {line}") from error


def _read_dataset(folder: Path, field: str) -> Iterator[str | None]:
    if _installed("datasets"):
        import datasets

        dataset = datasets.load_from_disk(str(folder))
        if isinstance(dataset, datasets.DatasetDict):
            dataset = dataset["train"] if "train" in dataset else dataset[sorted(dataset)[0]]
        if field not in dataset.column_names:
            raise DataError(
                f'{folder}: no "{field}" column (columns: {", ".join(dataset.column_names)})'
            )
        for batch in dataset.select_columns([field]).iter(batch_size=1024):
            yield from batch[field]
        return
    # Without `datasets`, read its Arrow stream files directly, in the order it lists them.
    import pyarrow as pa

    split = _dataset_split(folder)
    state = json.loads((split / "state.json").read_text())
    for entry in state["_data_files"]:
        with pa.memory_map(str(split / entry["filename"])) as source:
            for batch in pa.ipc.open_stream(source):
                if field not in batch.schema.names:
                    raise DataError(
                        f'{folder}: no "{field}" column (columns: {", ".join(batch.schema.names)})'
                    )
                yield from batch.column(field).to_pylist()


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(8192)


def _walk(root: Path, *, keep: frozenset[str], skip_dirs: frozenset[str]) -> list[Path]:
    """Files under `root` with a suffix in `keep`, in sorted order; hidden entries skipped."""
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip_dirs and not d.startswith("."))
        for name in sorted(names):
            if not name.startswith(".") and Path(name).suffix.lower() in keep:
                found.append(Path(folder) / name)
    return found


def default_corpus() -> Corpus:
    """The standard library's Python sources (about 12 MB on CPython 3.11)."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = _walk(root, keep=frozenset({".py"}), skip_dirs=_STDLIB_SKIP)
    if not files:
        raise DataError(f"no Python sources under {root} for the built-in corpus; give --data PATH")
    return Corpus(source="stdlib", files=tuple(files))


def open_corpus(data_path: str | os.PathLike | None, *, text_field: str = TEXT_FIELD) -> Corpus:
    """The corpus at `data_path`, or the built-in one for None; a JSONL file or a `datasets`
    folder has its text in `text_field`.

    Raises:
        DataError: the path does not exist, holds no text files, looks binary, or is a
            `datasets` folder while neither `datasets` nor `pyarrow` is installed.
    """
    if data_path is None:
        return default_corpus()
    path = Path(data_path).expanduser()
    if not path.exists():
        raise DataError(f"no such data path: {data_path}")
    path = path.resolve()
    if path.is_file():
        if _looks_binary(path):
            raise DataError(f"{data_path} does not look like text (it holds NUL bytes)")
        return Corpus(source=str(data_path), files=(path,), text_field=text_field)
    if is_datasets_folder(path):
        if not (_installed("datasets") or _installed("pyarrow")):
            raise DataError(
                f"{data_path} is a datasets folder; reading it needs the datasets "
                f"package: pip install datasets"
            )
        files = tuple(p for p in sorted(path.rglob("*")) if p.is_file())
        return Corpus(
            source=str(data_path), files=files, datasets_folder=path, text_field=text_field
        )
    files = _walk(path, keep=TEXT_SUFFIXES, skip_dirs=frozenset())
    if not files:
        raise DataError(
            f"no text files under {data_path} (looked for {', '.join(sorted(TEXT_SUFFIXES))})"
        )
    return Corpus(source=str(data_path), files=tuple(files), text_field=text_field)


def tokenize_corpus(corpus: Corpus, tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """The corpus's token stream, each document ended by the end-of-sequence id; from the
    cache (a read-only memory map) when this corpus met this tokenizer before."""
    return cached_tokens(corpus.documents, identity=corpus.identity(), tokenizer=tokenizer)


class TokenBatches:
    """Blocks of `seq_len` consecutive tokens, `batch_size` at a time, forever.

    The stream is cut into non-overlapping blocks (the tail shorter than a block is
    dropped). Each epoch visits every block once in an order drawn from (seed, epoch), and
    ends when fewer than `batch_size` unvisited blocks remain. Iterating yields
    `{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}` with labels equal to the
    inputs: Hugging Face causal LMs shift them inside the loss.

    `state_dict()` records the epoch and the position in it; a fresh instance over the same
    tokens that loads it yields exactly the batches the first one would have yielded next.
    """

    tokenizer: PreTrainedTokenizerBase | None = None  # set by build_data, for checkpoints

    def __init__(
        self, tokens: np.ndarray | torch.Tensor, *, batch_size: int, seq_len: int, seed: int
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size}")
        if seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, not {seq_len}")
        if isinstance(tokens, torch.Tensor):
            tokens = tokens.cpu().numpy()
        tokens = np.asarray(tokens)
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
            raise ValueError(
                f"tokens must be a 1-D integer array, not {tokens.dtype} with shape {tokens.shape}"
            )
        blocks = len(tokens) // seq_len
        if blocks < batch_size:
            raise DataError(
                f"the corpus holds {len(tokens)} tokens, fewer than one batch "
                f"of {batch_size} x {seq_len}; give more data or smaller "
                f"--batch-size/--seq-len"
            )
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.num_tokens = len(tokens)
        self._blocks = tokens[: blocks * seq_len].reshape(blocks, seq_len)
        self.epoch = 0
        self.position = 0  # batches already served in this epoch
        self._order: tuple[int, np.ndarray] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def batches_per_epoch(self) -> int:
        return self.num_blocks // self.batch_size

    def _epoch_order(self) -> np.ndarray:
        if self._order is None or self._order[0] != self.epoch:
            # SeedSequence takes non-negative entropy only; the sign keeps -1 apart from 1.
            entropy = [abs(self.seed), int(self.seed < 0), self.epoch]
            self._order = (self.epoch, np.random.default_rng(entropy).permutation(self.num_blocks))
        return self._order[1]

    def __iter__(self) -> TokenBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self.position >= self.batches_per_epoch:
            self.epoch += 1
            self.position = 0
        start = self.position * self.batch_size
        chosen = self._epoch_order()[start : start + self.batch_size]
        self.position += 1
        input_ids = torch.from_numpy(self._blocks[chosen].astype(np.int64))
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from a `state_dict()`; a position past the epoch's end starts the next."""
        epoch, position = state.get("epoch"), state.get("position")
        for key, value in (("epoch", epoch), ("position", position)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"data state {key} must be a non-negative int, not {value!r}")
        self.epoch, self.position = epoch, position


def _model_folder(model_name_or_path: str) -> Path | None:
    if model_name_or_path in KNOWN_MODELS:
        return None
    path = Path(model_name_or_path).expanduser()
    return path if path.is_dir() else None


def _tokenizer_for(
    corpus: Corpus, *, model_name_or_path: str, vocab_limit: int
) -> PreTrainedTokenizerBase:
    folder = _model_folder(model_name_or_path)
    if folder is not None:
        try:
            own = folder_tokenizer(folder)
        except ValueError as error:
            raise DataError(str(error)) from error
        if own is not None:
            if len(own) > vocab_limit:
                raise DataError(
                    f"the tokenizer in {folder} has {len(own)} tokens but the model "
                    f"embeds only {vocab_limit}"
                )
            return own
    vocab_size = min(DEFAULT_VOCAB_SIZE, vocab_limit)
    if vocab_size < MIN_VOCAB_SIZE:
        raise DataError(
            f"the model embeds {vocab_limit} tokens; a byte-level tokenizer needs "
            f"at least {MIN_VOCAB_SIZE}"
        )
    return cached_tokenizer(corpus.documents, identity=corpus.identity(), vocab_size=vocab_size)


def get_tokenizer(
    data_path: str | os.PathLike | None, *, model_name_or_path: str, vocab_limit: int
) -> PreTrainedTokenizerBase:
    """The tokenizer a run uses: the model folder's own, else the BPE of the corpus.

    The result has `save_pretrained(dir)` (see `engine.data.tokenizer.save_tokenizer`), so a
    checkpoint can carry it and `AutoTokenizer.from_pretrained(dir)` reads it offline.

    Args:
        data_path: the corpus (see `open_corpus`); None for the built-in one.
        model_name_or_path: a zoo name or a local model folder.
        vocab_limit: the model's vocabulary size; every token id must be below it.
    """
    corpus = open_corpus(data_path)
    return _tokenizer_for(corpus, model_name_or_path=model_name_or_path, vocab_limit=vocab_limit)


def corpus_tokens(
    data_path: str | os.PathLike | None,
    *,
    model_name_or_path: str,
    vocab_limit: int,
    seq_len: int,
    text_field: str = TEXT_FIELD,
) -> tuple[np.ndarray, PreTrainedTokenizerBase]:
    """The token stream of the corpus at `data_path` and the tokenizer that made it; the
    arguments and errors are `build_data`'s."""
    positions = getattr(model_config(model_name_or_path), "max_position_embeddings", None)
    if positions is not None and seq_len > positions:
        raise DataError(
            f"seq_len {seq_len} is longer than the {positions} positions "
            f"{model_name_or_path} embeds"
        )
    corpus = open_corpus(data_path, text_field=text_field)
    tokenizer = _tokenizer_for(
        corpus, model_name_or_path=model_name_or_path, vocab_limit=vocab_limit
    )
    return tokenize_corpus(corpus, tokenizer), tokenizer


def build_data(
    data_path: str | os.PathLike | None,
    *,
    model_name_or_path: str,
    vocab_limit: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    text_field: str = TEXT_FIELD,
) -> TokenBatches:
    """The batches of a run: corpus, tokenizer and token stream, each cached after the first.

    Args:
        data_path: a text file, a folder of text files, a JSONL file (`text` per line), a
            `datasets` folder, or None for the standard library's sources.
        model_name_or_path: a zoo name or a local model folder; its tokenizer is used when
            it has one, and its positions bound `seq_len`.
        vocab_limit: the model's vocabulary size.
        batch_size, seq_len: the shape of each batch.
        seed: orders the blocks; the same seed gives the same batches.
        text_field: the JSONL field or `datasets` column that holds the text.

    Raises:
        DataError: a missing or unreadable path, a corpus smaller than one batch, a
            tokenizer larger than the model's vocabulary, `seq_len` beyond the model's
            positions, or records without `text_field`.
    """
    tokens, tokenizer = corpus_tokens(
        data_path,
        model_name_or_path=model_name_or_path,
        vocab_limit=vocab_limit,
        seq_len=seq_len,
        text_field=text_field,
    )
    batches = TokenBatches(tokens, batch_size=batch_size, seq_len=seq_len, seed=seed)
    batches.tokenizer = tokenizer
    return batches
