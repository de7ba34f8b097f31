"""Held-out text: a share of a corpus's documents kept out of training, or another corpus,
served as a fixed set of evaluation batches.

The split is by document, decided from the token stream alone (documents end at the
end-of-sequence id), so a corpus is tokenised once whether or not part of it is held out.
Which documents are held out depends only on their tokens: the same on every run and every
seed, so runs can be compared on it, and two copies of one text always fall on the same
side, so no text is both trained on and judged by.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
import torch

from engine.data.corpus import (
    TEXT_FIELD,
    DataError,
    TokenBatches,
    corpus_tokens,
    open_corpus,
    tokenize_corpus,
)

__all__ = ["EvalBatches", "RunData", "build_run_data", "eval_batches", "split_documents"]


@dataclass(frozen=True)
class EvalBatches:
    """The batches an evaluation scores, the same every time it runs.

    Each is `{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}`; the last may hold
    fewer sequences when the held-out text has fewer blocks than were asked for.
    """

    batches: tuple[dict[str, torch.Tensor], ...]
    source: str  # where the text comes from, for the user: a path, or the share held out

    @property
    def sequences(self) -> int:
        return sum(int(b["input_ids"].shape[0]) for b in self.batches)

    @property
    def tokens(self) -> int:
        """Tokens scored per evaluation."""
        return sum(int(b["input_ids"].numel()) for b in self.batches)


@dataclass
class RunData:
    """What a run reads: its training batches, and the held-out ones when it evaluates."""

    train: TokenBatches
    eval: EvalBatches | None = None


def _documents(tokens: np.ndarray, separator: int | None) -> np.ndarray:
    """End offsets of the documents in `tokens`: each ends just after a separator; text after
    the last separator is a document too."""
    if separator is None or len(tokens) == 0:
        return np.array([len(tokens)], dtype=np.int64)
    ends = np.flatnonzero(np.asarray(tokens) == separator).astype(np.int64) + 1
    if len(ends) == 0 or ends[-1] != len(tokens):
        ends = np.append(ends, len(tokens))
    return ends


def split_documents(
    tokens: np.ndarray, *, separator: int | None, fraction: float
) -> tuple[np.ndarray, np.ndarray]:
    """`tokens` as (train, held_out) token streams, split between documents.

    Documents are visited in the order of a hash of their tokens, and each is held out while
    the held-out tokens stay within `fraction` of all; identical documents move together.
    So the held-out share is at most `fraction`, and close to it when documents are many.

    Raises:
        DataError: no document is small enough to hold out (a corpus of one text file is
            one document).
    """
    if not 0 < fraction < 1:
        raise ValueError(f"fraction must be within (0, 1), not {fraction}")
    ends = _documents(tokens, separator)
    starts = np.concatenate(([0], ends[:-1]))
    lengths = ends - starts
    digests = np.array(
        [
            int.from_bytes(
                hashlib.blake2b(np.asarray(tokens[a:b]).tobytes(), digest_size=8).digest(),
                "little",
            )
            for a, b in zip(starts.tolist(), ends.tolist(), strict=True)
        ],
        dtype=np.uint64,
    )
    groups, member_of = np.unique(digests, return_inverse=True)
    group_tokens = np.bincount(member_of, weights=lengths, minlength=len(groups))
    room = fraction * len(tokens)
    chosen = np.zeros(len(groups), dtype=bool)
    held = 0.0
    for group, size in enumerate(group_tokens.tolist()):  # in hash order: a fixed shuffle
        if held + size <= room:
            chosen[group] = True
            held += size
    if not chosen.any():
        if len(ends) == 1:
            raise DataError(
                "nothing to hold out: the data is one document (a text file is one) and a "
                "document is never split; give held-out text of its own (--eval-data), or "
                "a folder or JSONL of many documents"
            )
        raise DataError(
            f"nothing to hold out: each of the {len(ends)} documents is more than "
            f"{fraction:g} of the data's {len(tokens)} tokens; hold out a larger share or "
            f"give held-out text of its own (--eval-data)"
        )
    in_held_out = np.repeat(chosen[member_of], lengths)
    tokens = np.asarray(tokens)
    return tokens[~in_held_out], tokens[in_held_out]


def eval_batches(
    tokens: np.ndarray, *, sequences: int, batch_size: int, seq_len: int, source: str
) -> EvalBatches:
    """Up to `sequences` blocks of `seq_len` tokens, spread evenly over the held-out stream
    (the whole of it, not just its start), in batches of `batch_size`. The blocks chosen do
    not depend on `batch_size`: the same sequences in other batches give the same loss.

    Raises:
        DataError: the held-out text is shorter than one block.
    """
    blocks = len(tokens) // seq_len
    if blocks == 0:
        raise DataError(
            f"the held-out text ({source}) holds {len(tokens)} tokens, fewer than one "
            f"sequence of {seq_len}; hold out more or shorten --seq-len"
        )
    count = min(sequences, blocks)
    chosen = np.arange(count) * blocks // count  # evenly spaced, strictly increasing
    rows = np.asarray(tokens[: blocks * seq_len]).reshape(blocks, seq_len)[chosen]
    batches = []
    for start in range(0, count, batch_size):
        input_ids = torch.from_numpy(rows[start : start + batch_size].astype(np.int64))
        batches.append({"input_ids": input_ids, "labels": input_ids.clone()})
    return EvalBatches(batches=tuple(batches), source=source)


def build_run_data(
    data_path: str | os.PathLike | None,
    *,
    model_name_or_path: str,
    vocab_limit: int,
    batch_size: int,
    seq_len: int,
    seed: int,
    text_field: str = TEXT_FIELD,
    eval_path: str | os.PathLike | None = None,
    eval_fraction: float | None = None,
    eval_sequences: int = 8,
    eval_batch_size: int = 1,
) -> RunData:
    """The training batches of `engine.data.corpus.build_data`, and the evaluation batches
    when held-out text is asked for.

    Args:
        data_path, model_name_or_path, vocab_limit, batch_size, seq_len, seed, text_field:
            as for `build_data`; the training stream leaves out what is held out.
        eval_path: another corpus to evaluate on (any form `data_path` takes), tokenised by
            the run's tokenizer.
        eval_fraction: or the share of the corpus's documents to hold out (see
            `split_documents`); at most one of the two.
        eval_sequences: how many held-out sequences an evaluation scores, at most.
        eval_batch_size: sequences per evaluation batch; with gradient accumulation, the
            micro-batch's, so evaluation fits where training does.

    Raises:
        DataError: as `build_data`, and for held-out text that is missing, too short for one
            sequence, or that cannot be split off.
    """
    if eval_path is not None and eval_fraction is not None:
        raise ValueError("give eval_path or eval_fraction, not both")
    tokens, tokenizer = corpus_tokens(
        data_path,
        model_name_or_path=model_name_or_path,
        vocab_limit=vocab_limit,
        seq_len=seq_len,
        text_field=text_field,
    )
    held_out: np.ndarray | None = None
    source = ""
    if eval_fraction is not None:
        separator = tokenizer.eos_token_id
        if separator is None:
            separator = tokenizer.sep_token_id
        tokens, held_out = split_documents(tokens, separator=separator, fraction=eval_fraction)
        source = f"{eval_fraction:g} of {data_path or 'the built-in corpus'} held out"
    elif eval_path is not None:
        held_out = tokenize_corpus(open_corpus(eval_path, text_field=text_field), tokenizer)
        source = str(eval_path)
    train = TokenBatches(tokens, batch_size=batch_size, seq_len=seq_len, seed=seed)
    train.tokenizer = tokenizer
    if held_out is None:
        return RunData(train)
    evaluation = eval_batches(
        held_out,
        sequences=eval_sequences,
        batch_size=eval_batch_size,
        seq_len=seq_len,
        source=source,
    )
    return RunData(train, evaluation)
