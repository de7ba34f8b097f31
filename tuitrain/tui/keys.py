"""The app's keys: one table drives the bindings, the command palette and the help screen."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from functools import partial

from textual.app import SystemCommand
from textual.binding import Binding

from tuitrain.settings import MARGIN_RATIO_MAX, MARGIN_RATIO_MIN

TEXTUAL_COMMANDS_REPLACED = ("Quit", "Keys", "Screenshot")  # by our Quit, Help, Screenshot
MARGIN_STEP = 0.05  # how far + and - move the margin ratio
# + and - share one place in the footer ("+- Margin"), which fits the keys in 80 columns.
MARGIN_GROUP = Binding.Group("Margin")


@dataclass(frozen=True, kw_only=True)
class KeyAction:
    key: str  # Textual's key name; "" for palette-only commands
    shown: str  # as the user types it
    action: str  # the app's action_<name>
    title: str  # in the command palette
    short: str  # in the footer, where 120 columns hold them all
    help: str  # one line in the help screen
    # A second key for the same action, bound with priority so that a focused field cannot
    # take it (ctrl+c would copy), named in the help screen but not in the footer.
    also: str = ""


# A table: one key per block reads better than the formatter's one field per line.
# fmt: off
KEYS: tuple[KeyAction, ...] = (
    KeyAction(
        key="c", shown="c", action="cycle_policy", title="Cycle policy", short="Policy",
        help="next placement policy: cuda → cpu → auto",
    ),
    KeyAction(
        key="plus", shown="+", action="margin_up", title=f"Margin +{MARGIN_STEP:g}",
        short="Margin+",
        help=f"raise the margin ratio by {MARGIN_STEP:g} (up to {MARGIN_RATIO_MAX:g})",
    ),
    KeyAction(
        key="minus", shown="-", action="margin_down", title=f"Margin -{MARGIN_STEP:g}",
        short="Margin-",
        help=f"lower the margin ratio by {MARGIN_STEP:g} (down to {MARGIN_RATIO_MIN:g})",
    ),
    # One key, two actions: the footer and the palette offer the one the run's state allows.
    KeyAction(
        key="space", shown="space", action="pause", title="Pause", short="Pause",
        help="pause training after the current step",
    ),
    KeyAction(
        key="space", shown="space", action="resume", title="Resume", short="Resume",
        help="resume a paused run",
    ),
    # The same: a search under way is stopped by the key that started it.
    KeyAction(
        key="a", shown="a", action="tune", title="Tune", short="Tune",
        help="search the fastest setting that fits on the run's own steps, apply it",
    ),
    KeyAction(
        key="a", shown="a", action="stop_tune", title="Stop tune", short="Stop tune",
        help="stop the search after this step, keeping and applying the best so far",
    ),
    KeyAction(
        key="s", shown="s", action="save_preset", title="Save preset", short="Save",
        help="save the selected trial (the setting in force unless you picked another row) "
        "and what it measured as a preset",
    ),
    KeyAction(
        key="r", shown="r", action="restart", title="Restart run", short="Restart",
        help="run again with the current settings, once the run has ended",
    ),
    KeyAction(
        key="v", shown="v", action="next_view", title="Next view", short="View",
        help="show the next view: panels that do not fit this size together (below)",
    ),
    KeyAction(
        key="question_mark", shown="?", action="help", title="Help", short="Help",
        help="list every key and command",
    ),
    KeyAction(
        key="q", shown="q", action="quit", title="Quit", short="Quit",
        help="stop the worker cleanly and quit (ctrl+c too)", also="ctrl+c",
    ),
)

# What changes the run: never offered to a viewer that sends nothing (attach --read-only).
STEERING_ACTIONS = frozenset(
    {"cycle_policy", "margin_up", "margin_down", "pause", "resume", "tune", "stop_tune",
     "checkpoint"}
)

# Reached from the command palette only: rare enough not to take a key.
PALETTE_ONLY: tuple[KeyAction, ...] = (
    KeyAction(
        key="", shown="", action="checkpoint", title="Save checkpoint", short="Checkpoint",
        help="ask the worker to write a checkpoint now (a run with --checkpoint-dir)",
    ),
    KeyAction(
        key="", shown="", action="screenshot", title="Screenshot", short="Screenshot",
        help="save the screen as SVG in your Downloads folder (else the working folder)",
    ),
)
# fmt: on


def bindings() -> list[Binding]:
    """The app's bindings: one per key and action, the second keys, and escape to leave a
    field."""
    return [
        # space is a priority so that a focused select or button cannot swallow it; fields
        # that type spaces still get it (Textual skips keys a focused input consumes).
        Binding(
            k.key,
            k.action,
            k.short,
            key_display=k.shown,
            priority=k.key == "space",
            group=MARGIN_GROUP if k.action.startswith("margin_") else None,
        )
        for k in KEYS
    ] + [
        Binding(k.also, k.action, k.short, show=False, priority=True) for k in KEYS if k.also
    ] + [Binding("escape", "leave_field", "Leave field", show=False)]


def palette_commands(
    can_run: Callable[[str], bool],
    run_action: Callable[[str], object],
    textual: Iterable[SystemCommand],
    *,
    extra: Iterable[SystemCommand] = (),
) -> Iterator[SystemCommand]:
    """Our actions that `can_run` now, the `extra` commands (the views of this size), then
    Textual's `textual` commands but the replaced ones.

    Textual's own Quit, Keys and Screenshot are left out: ours quits by stopping the worker
    first, Help lists every key and command already, and ours saves where it can and says
    where.
    """
    for key in KEYS + PALETTE_ONLY:
        if can_run(key.action):
            yield SystemCommand(key.title, key.help, partial(run_action, key.action))
    yield from extra
    for command in textual:
        if command.title not in TEXTUAL_COMMANDS_REPLACED:
            yield command
