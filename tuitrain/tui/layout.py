"""Which panels the screen shows, by its size: everything on a large terminal, the most
important ones on a small one with the others a key (v) away.

Panels by priority: the header (always), memory on the device and the host, the step panel
and the controls, then the trials, the last step's timeline, the tensor states and chunk
map, the log. A view is a set of panels shown together; each size has its views, the first
being what the app opens on.
"""

from __future__ import annotations

from dataclasses import dataclass

PANELS = ("memory", "timeline", "states", "chunks", "step", "trials", "controls", "log")

# Sizes, from the largest: the least columns and rows each needs.
FULL = ("full", 180, 50)
STANDARD = ("standard", 120, 36)
COMPACT = ("compact", 0, 0)


@dataclass(frozen=True)
class View:
    name: str  # what the palette and the help screen call it
    panels: frozenset[str]  # of PANELS
    about: str  # what it shows, in a few words

    @property
    def title(self) -> str:
        return f"{self.name}: {self.about}"


def _view(name: str, about: str, *panels: str) -> View:
    unknown = set(panels) - set(PANELS)
    assert not unknown, f"no such panel: {unknown}"
    return View(name, frozenset(panels), about)


VIEWS: dict[str, tuple[View, ...]] = {
    "full": (_view("all", "every panel", *PANELS),),
    "standard": (
        _view(
            "run",
            "memory, step, controls, tensor states, chunks, log",
            "memory",
            "states",
            "chunks",
            "step",
            "controls",
            "log",
        ),
        _view(
            "tuning",
            "trials, the last step module by module, controls, log",
            "trials",
            "timeline",
            "controls",
            "log",
        ),
    ),
    "compact": (
        _view("run", "memory, step, controls", "memory", "step", "controls"),
        _view("trials", "one row per setting tried, controls", "trials", "controls"),
        _view("step", "the last step module by module, the loss", "timeline", "step"),
        _view("placement", "tensor states and the chunk map", "states", "chunks"),
        _view("log", "what the worker said", "log"),
    ),
}


def size_class(width: int, height: int) -> str:
    """The size class of a screen: the largest whose least size it has (full, standard,
    compact)."""
    for name, min_width, min_height in (FULL, STANDARD, COMPACT):
        if width >= min_width and height >= min_height:
            return name
    return COMPACT[0]


def views_for(size: str) -> tuple[View, ...]:
    return VIEWS[size]


def closest_view(size: str, shown: View | None) -> View:
    """The view of `size` that shows most of what `shown` showed (the first on a tie), so
    that a resize keeps the panels the user was looking at."""
    views = VIEWS[size]
    if shown is None:
        return views[0]
    return max(views, key=lambda v: (len(v.panels & shown.panels), -views.index(v)))


def next_view(size: str, shown: View) -> View:
    """The view after `shown` at this size, round to the first."""
    views = VIEWS[size]
    index = views.index(shown) if shown in views else -1
    return views[(index + 1) % len(views)]
