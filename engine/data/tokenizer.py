"""Text to token ids: a model folder's tokenizer or a byte-level BPE trained once per
corpus, and the corpus's token stream; both cached under `cache_dir()`.

The trained tokenizer reserves OPT's special tokens at OPT's ids (<s>=0, <pad>=1, </s>=2,
<unk>=3), so the zoo configs' pad/bos/eos ids mean the same thing for it as for the
published vocabulary: the embedding's padding row (id 1) is never a real token, and
documents are separated by </s>, the id the configs name as end of sequence.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "DEFAULT_VOCAB_SIZE",
    "MIN_VOCAB_SIZE",
    "SPECIAL_TOKENS",
    "atomic_write",
    "cache_dir",
    "cached_tokenizer",
    "cached_tokens",
    "encode_documents",
    "folder_tokenizer",
    "save_tokenizer",
    "store_in_cache",
    "tokenizer_fingerprint",
    "train_tokenizer",
]

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>")
# Small enough to learn from a few MB of text in seconds, large enough that a token holds
# ~3-4 bytes of source code; fits the tiny model's 8192-row embedding.
DEFAULT_VOCAB_SIZE = 8000
# Byte-level BPE needs one token per byte value before it can merge anything.
MIN_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
# BPE statistics settle long before this much text; more only makes the first run slower.
TRAIN_CHAR_LIMIT = 64 * 1024 * 1024

_FORMAT = "bpe-v1"  # bump when the trainer's settings change, so old caches are not reused
# Documents are encoded in pieces of about this many characters (cut at line ends) so the
# tokenizer can spread one large file over all cores.
_PIECE_CHARS = 1 << 16
_ENCODE_GROUP_CHARS = 1 << 23  # bounds the memory held by one encode_batch call
_TOKENS_FORMAT = "tokens-v1"  # bump when encoding or packing changes


def cache_dir() -> Path:
    """Where trained tokenizers and tokenised corpora are kept.

    `$TUITRAIN_CACHE` if set, else `$XDG_CACHE_HOME/tuitrain`, else `~/.cache/tuitrain`.
    """
    if override := os.environ.get("TUITRAIN_CACHE"):
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "tuitrain"


def atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """Call `write(tmp)` and move tmp onto `path`: readers see the old file or the whole new one.

    Two processes filling the same cache entry at once both succeed; the last one wins.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def store_in_cache(path: Path, write: Callable[[Path], None]) -> None:
    """`atomic_write`, except that a cache that cannot be written only costs time later."""
    try:
        atomic_write(path, write)
    except OSError as error:
        log.warning("not cached (%s): %s", path, error)


def _wrap(backend: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="</s>",  # OPT starts and ends sequences with the same token
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )


def _limited(texts: Iterable[str], limit: int) -> Iterator[str]:
    seen = 0
    for text in texts:
        yield text[: limit - seen]
        seen += len(text)
        if seen >= limit:
            return


def train_tokenizer(texts: Iterable[str], *, vocab_size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE with at most `vocab_size` tokens learned from `texts`.

    Byte-level means every string can be encoded, whatever its script, with no unknown
    token; the first `TRAIN_CHAR_LIMIT` characters are enough to learn the merges.
    """
    if vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"a byte-level BPE needs at least {MIN_VOCAB_SIZE} tokens, not {vocab_size}"
        )
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_limited(texts, TRAIN_CHAR_LIMIT), trainer=trainer)
    return _wrap(backend)


def cached_tokenizer(
    texts: Callable[[], Iterable[str]], *, identity: str, vocab_size: int
) -> PreTrainedTokenizerFast:
    """The BPE for a corpus, trained on the first call and read from the cache after.

    Args:
        texts: returns the corpus documents; only called when the cache has no entry.
        identity: names the corpus (its files, sizes and modification times), so an edited
            corpus gets a new tokenizer.
        vocab_size: passed to `train_tokenizer`; part of the cache key.
    """
    key = hashlib.sha256(f"{_FORMAT}\n{vocab_size}\n{identity}".encode()).hexdigest()[:32]
    path = cache_dir() / "tokenizers" / f"{key}.json"
    if path.is_file():
        try:
            return _wrap(Tokenizer.from_file(str(path)))
        except Exception as error:  # a cache entry from an incompatible tokenizers release
            log.warning("ignoring unreadable cached tokenizer %s: %s", path, error)
    log.info(
        "training a %d-token byte-level BPE on the corpus (once; cached in %s)",
        vocab_size,
        path.parent,
    )
    tokenizer = train_tokenizer(texts(), vocab_size=vocab_size)
    store_in_cache(path, lambda tmp: tokenizer.backend_tokenizer.save(str(tmp)))
    return tokenizer


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def folder_tokenizer(folder: str | os.PathLike) -> PreTrainedTokenizerBase | None:
    """The tokenizer a model folder brings, or None when it has no tokenizer files.

    Raises ValueError (one line) when the files are there but cannot be loaded.
    """
    folder = Path(folder)
    if not folder.is_dir() or not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as error:  # transformers raises OSError, ValueError, or its own types
        line = (str(error).strip() or type(error).__name__).splitlines()[0]
        raise ValueError(f"cannot load the tokenizer in {folder}: {line}") from error


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest that changes whenever the tokenizer would encode text differently."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if isinstance(backend, Tokenizer):
        text = backend.to_str()
    else:
        text = repr(sorted(tokenizer.get_vocab().items())) + type(tokenizer).__name__
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def save_tokenizer(tokenizer: PreTrainedTokenizerBase, directory: str | os.PathLike) -> None:
    """Write the tokenizer next to a checkpoint so `AutoTokenizer.from_pretrained` reads it."""
    tokenizer.save_pretrained(str(directory))


def _pieces(text: str) -> Iterator[str]:
    """`text` cut after a newline roughly every `_PIECE_CHARS` characters."""
    start = 0
    while start < len(text):
        end = start + _PIECE_CHARS
        if end < len(text):
            newline = text.rfind("\n", start, end)
            end = newline + 1 if newline >= start else end
        yield text[start:end]
        start = end


def _encode_pieces(tokenizer: PreTrainedTokenizerBase, pieces: list[str]) -> list[list[int]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        # The fast variant skips character offsets, which packing never reads.
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [e.ids for e in encode(pieces, add_special_tokens=False)]
    return tokenizer(pieces, add_special_tokens=False)["input_ids"]


def encode_documents(documents: Iterable[str], tokenizer: PreTrainedTokenizerBase) -> np.ndarray:
    """One token stream, each document followed by the end-of-sequence id."""
    separator = tokenizer.eos_token_id
    if separator is None:
        separator = tokenizer.sep_token_id
    dtype = np.uint16 if len(tokenizer) <= np.iinfo(np.uint16).max + 1 else np.uint32
    parts: list[np.ndarray] = []
    pieces: list[str] = []
    ends: list[bool] = []  # whether each piece is the last of its document

    def flush() -> None:
        for ids, last in zip(_encode_pieces(tokenizer, pieces), ends, strict=True):
            if last and separator is not None:
                ids = [*ids, separator]
            parts.append(np.asarray(ids, dtype=dtype))
        pieces.clear()
        ends.clear()

    held = 0
    for document in documents:
        cut = list(_pieces(document))
        pieces.extend(cut)
        ends.extend([False] * (len(cut) - 1) + [True])
        held += len(document)
        if held >= _ENCODE_GROUP_CHARS:
            flush()
            held = 0
    flush()
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def cached_tokens(
    documents: Callable[[], Iterable[str]], *, identity: str, tokenizer: PreTrainedTokenizerBase
) -> np.ndarray:
    """`encode_documents` once per corpus and tokenizer, then a read-only memory map of it.

    Args:
        documents: returns the corpus documents; only called when the cache has no entry.
        identity: names the corpus, as for `cached_tokenizer`.
        tokenizer: part of the key through `tokenizer_fingerprint`.
    """
    text = f"{_TOKENS_FORMAT}\n{tokenizer_fingerprint(tokenizer)}\n{identity}"
    path = cache_dir() / "tokens" / f"{hashlib.sha256(text.encode()).hexdigest()[:32]}.npy"
    if path.is_file():
        try:
            return np.load(path, mmap_mode="r")
        except (OSError, ValueError) as error:
            log.warning("ignoring unreadable token cache %s: %s", path, error)
    log.info("tokenising the corpus (once; cached in %s)", path.parent)
    tokens = encode_documents(documents(), tokenizer)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, tokens)

    store_in_cache(path, write)
    return tokens
