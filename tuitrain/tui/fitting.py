"""Lines that fit their width: items ranked by importance, the least important dropped
first, some cut with an ellipsis instead, the essential ones never."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from rich.cells import cell_len
from rich.text import Text


@dataclass(frozen=True)
class Item:
    """One item of a line; the lowest `rank` goes first when the line is too long
    (KEEP: never). A `shrink` item is cut with an ellipsis rather than dropped while it
    keeps a few cells of its own; one that `stays` is only ever cut."""

    parts: tuple[tuple[str, str], ...]  # (text, style)
    rank: int = 0
    shrink: bool = False
    stays: bool = False

    @property
    def width(self) -> int:
        return sum(cell_len(text) for text, _ in self.parts)

    def text(self) -> Text:
        return Text.assemble(*self.parts)


KEEP = 100  # never dropped
WIDE_SEP, NARROW_SEP = "  │  ", " │ "  # between items: the narrow one when space is short
MIN_SHRUNK = 8  # cells a shrunk value keeps, its ellipsis included


def fit_line(
    items: list[Item], width: int, *, seps: tuple[str, str] = (WIDE_SEP, NARROW_SEP)
) -> Text:
    """The items that fit in `width` cells, joined by separators (`seps`: wide, narrow).

    Wide separators first, then narrow ones; then the lowest-ranked item goes, and so on
    until the line fits. An item that may shrink is cut to what is left rather than dropped
    while it keeps MIN_SHRUNK cells of its own; one that stays is cut, never dropped, and
    so are the items ranked KEEP.
    """
    items = list(items)
    for sep in seps:
        if _width(items, sep) <= width:
            return _join(items, sep)
    sep = seps[-1]
    while (excess := _width(items, sep) - width) > 0:
        candidates = [i for i in items if i.rank < KEEP]
        if not candidates:
            break
        victim = min(candidates, key=lambda i: i.rank)
        if victim.shrink and (victim.stays or victim.width - excess >= _least(victim)):
            items[items.index(victim)] = _shrunk(victim, excess)
            break
        items.remove(victim)
    return _join(items, sep)


def _width(items: list[Item], sep: str) -> int:
    return sum(i.width for i in items) + cell_len(sep) * max(0, len(items) - 1)


def _join(items: list[Item], sep: str) -> Text:
    return Text(sep, style="dim").join(i.text() for i in items)


def _least(item: Item) -> int:
    """The fewest cells a shrunk `item` keeps: its label and MIN_SHRUNK of its value."""
    return sum(cell_len(t) for t, _ in item.parts[:-1]) + MIN_SHRUNK


def _shrunk(item: Item, excess: int) -> Item:
    """`item` shorter by `excess` cells (down to _least), its last part cut with "…"."""
    keep = max(_least(item), item.width - excess)
    if keep >= item.width:
        return item
    *head, (text, style) = item.parts
    room = keep - sum(cell_len(t) for t, _ in head)
    return replace(item, parts=(*head, (text[: max(0, room - 1)] + "…", style)))


# A word, a path's part up to and with its separator, or a run of spaces.
_PIECES = re.compile(r"[^\s/\\]*[/\\]|[^\s/\\]+|\s+")


def wrap_at_separators(text: str, width: int) -> str:
    """`text` broken into lines of at most `width` cells, between words or after a path's
    separator, so a path reads `.../presets/` then `tiny-auto.yaml`, never `tiny-auto.yam`
    then `l`. A piece longer than the width is left for the widget to fold."""
    if width < 1:
        return text
    lines: list[str] = []
    line = ""
    for piece in _PIECES.findall(text):
        if len(line) + len(piece.rstrip()) > width and line.strip():
            lines.append(line.rstrip())
            line = piece.lstrip()
        else:
            line += piece
    lines.append(line.rstrip())
    return "\n".join(lines)
