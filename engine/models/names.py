"""The zoo's names and shapes, with no torch or transformers behind them.

`tuitrain run` checks a zoo name here before it starts a worker, so that a mistake is
answered at once and a good run does not import the training stack twice (the worker
imports it anyway). engine.models.zoo builds the configs from these tables.
"""

from __future__ import annotations

import os

__all__ = ["KNOWN_MODELS", "LLAMA_SHAPES", "OPT_SHAPES", "UnknownModel", "positions"]

# Shape of each OPT size as published (hidden, layers, heads, ffn); every size shares the
# 50272-token GPT-2 vocabulary (padded to a multiple of 8) and 2048 learned positions.
OPT_SHAPES: dict[str, tuple[int, int, int, int]] = {
    "opt-125m": (768, 12, 12, 3072),
    "opt-350m": (1024, 24, 16, 4096),
    "opt-1.3b": (2048, 24, 32, 8192),
    "opt-2.7b": (2560, 32, 32, 10240),
    "opt-6.7b": (4096, 32, 32, 16384),
    "opt-13b": (5120, 40, 40, 20480),
    "opt-30b": (7168, 48, 56, 28672),
}

# Llama 3.x as published: (hidden, layers, heads, key/value heads, ffn, head dim, tied
# embeddings, RoPE scaling factor). Grouped-query attention (8 key/value heads), the 128256-
# token vocabulary, RoPE at theta 500000 stretched from 8192 to 131072 positions by the
# "llama3" scaling: 3.2 1B and 3B tie their head to the embedding, 3.1 8B does not.
LLAMA_SHAPES: dict[str, tuple[int, int, int, int, int, int, bool, float]] = {
    "llama-1b": (2048, 16, 32, 8, 8192, 64, True, 32.0),  # Llama 3.2 1B
    "llama-3b": (3072, 28, 24, 8, 8192, 128, True, 32.0),  # Llama 3.2 3B
    "llama-8b": (4096, 32, 32, 8, 14336, 128, False, 8.0),  # Llama 3.1 8B
}

KNOWN_MODELS: tuple[str, ...] = ("tiny", *OPT_SHAPES, *LLAMA_SHAPES)

# The positions each family learned or was stretched to; the tiny test model's 512.
TINY_POSITIONS = 512
OPT_POSITIONS = 2048
LLAMA_POSITIONS = 131072


def positions(name: str) -> int:
    """The longest sequence a zoo model takes, in tokens."""
    if name == "tiny":
        return TINY_POSITIONS
    if name in LLAMA_SHAPES:
        return LLAMA_POSITIONS
    if name in OPT_SHAPES:
        return OPT_POSITIONS
    raise UnknownModel(name)


class UnknownModel(ValueError):
    """A model name that is neither in the zoo nor a folder on disk."""

    def __init__(self, name: str) -> None:
        known = ", ".join(KNOWN_MODELS)
        if any(mark in name for mark in ("/", os.sep, "~")) or name.startswith("."):
            message = f"no model folder at {name!r}; zoo models: {known}"
        else:
            message = f"unknown model {name!r}; known: {known}, or a local model folder"
        super().__init__(message)
