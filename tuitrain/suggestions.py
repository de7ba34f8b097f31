"""What the user probably meant: the closest known word to a mistyped flag or command.

Python 3.14's argparse suggests for choices (`suggest_on_error`) but not for an unknown
option; this covers both on every version the project supports.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Iterable

# How alike a typo and a known word must be (difflib's ratio) to be offered: `--polcy`
# against `--policy` is 0.92, `rnu` against `run` 0.67; a near miss costs only a glance.
CUTOFF = 0.6


def closest(word: str, known: Iterable[str]) -> str | None:
    """The known word nearest `word`, or None when none is near enough."""
    matches = difflib.get_close_matches(word, list(known), n=1, cutoff=CUTOFF)
    return matches[0] if matches else None


def options_of(parser: argparse.ArgumentParser) -> list[str]:
    """Every long option string `parser` takes."""
    return [s for action in parser._actions for s in action.option_strings if s.startswith("--")]


def unknown_argument(parser: argparse.ArgumentParser, extras: list[str]) -> str:
    """The one-line complaint about the first of `extras` that `parser` did not take,
    with the option meant when one is near."""
    flags = [e for e in extras if e.startswith("-")]
    first = (flags or extras)[0]
    if not first.startswith("--"):
        return f"unrecognized argument: {first}"
    name = first.split("=", 1)[0]
    guess = closest(name, options_of(parser))
    hint = f" (did you mean {guess}?)" if guess else ""
    return f"unrecognized argument: {name}{hint}"
