"""RunHeader: what runs where, how far it got, how fast, and under which settings."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from rich.text import Text
from textual.widget import Widget

from tuitrain.formatting import format_count, format_rate, format_size
from tuitrain.settings import EngineSettings
from tuitrain.tui.fitting import KEEP, Item, fit_line

STATE_STYLES = {
    "starting": "bold yellow",
    "running": "bold green",
    "paused": "bold cyan",
    "stopping": "bold yellow",
    "failed": "bold red",
    "stopped": "bold magenta",
    "finished": "bold blue",
}
WAITING_STATES = ("starting", "running", "paused")  # values not known yet may still come


@dataclass(frozen=True)
class HeaderInfo:
    """Everything the header shows; None reads as not known yet."""

    model: str
    parameters: int | None = None
    trainable: int | None = None  # of the parameters, those that train (LoRA); None: all
    device: str | None = None  # as the worker names it; "" when it could not tell
    state: str = "starting"
    step: int = 0
    total_steps: int | None = None
    tokens_per_s: float | None = None
    policy: str | None = "auto"  # None: the plan's choice, not known until the run says
    margin_ratio: float = 0.0
    device_budget: int | None = None
    # A simulated device is as big as its budget: the size its name gave at the start,
    # which the name then follows (None: a GPU, whose size is its own).
    device_size: int | None = None
    read_only: bool = False  # a viewer that watches and sends nothing (tuitrain attach)


def settings_fields(engine: EngineSettings, *, policy_known: bool = True) -> dict[str, object]:
    """The settings in force, as RunHeader.show takes them; the policy None until known (a
    policy left unset is the plan's choice, which the run makes as it starts)."""
    fields: dict[str, object] = {"policy": engine.policy if policy_known else None,
                                 "margin_ratio": engine.margin_ratio}
    if engine.device_budget is not None:
        fields["device_budget"] = engine.device_budget.nbytes
    return fields


def model_label(model: str) -> str:
    """A model as the header names it: a zoo name as is, a folder by its last name."""
    return Path(model.rstrip("/\\")).name or model


def header_items(info: HeaderInfo) -> tuple[list[Item], list[Item]]:
    """The two lines' items, in the order drawn, each with its rank."""
    # "…" promises a value; once the run has ended without one, it will not come.
    unknown = "…" if info.state in WAITING_STATES else "-"
    params = unknown if info.parameters is None else format_count(info.parameters)
    params += " params"
    if info.parameters is not None and info.trainable is not None \
            and info.trainable < info.parameters:
        params += f" ({format_count(info.trainable)} trainable)"
    device = unknown if info.device is None else (info.device or "N/A")
    if info.device and info.device_size is not None and info.device_budget is not None:
        device = info.device.replace(format_size(info.device_size),
                                     format_size(info.device_budget), 1)
    total = "?" if info.total_steps is None else str(info.total_steps)
    rate = unknown if info.tokens_per_s is None else format_rate(info.tokens_per_s)
    budget = unknown if info.device_budget is None else format_size(info.device_budget)
    state = ((f"● {info.state}", STATE_STYLES.get(info.state, "")),)
    if info.read_only:
        state += ((" read-only", "bold"),)
    first = [
        Item((("tuitrain", "bold"),), rank=1),
        Item(((model_label(info.model), "bold"),), rank=50, shrink=True, stays=True),
        Item(((params, ""),), rank=3),
        Item(state, rank=KEEP),
        Item(((f"step {info.step}/{total}", ""),), rank=KEEP),
        Item(((f"{rate} tok/s", ""),), rank=KEEP),
    ]
    second = [
        Item((("policy ", ""), (info.policy or unknown, "bold")), rank=KEEP),
        Item((("margin ", ""), (f"{info.margin_ratio:.2f}", "bold")), rank=KEEP),
        Item((("budget ", ""), (budget, "bold")), rank=KEEP),
        Item((("device ", ""), (device, "bold")), rank=2, shrink=True),
    ]
    return first, second


class RunHeader(Widget):
    """Two lines at the top: the run (model, state, progress, pace) and its settings and
    device, fitted to the width: the least important items go first, never the state, the
    step or the pace."""

    DEFAULT_CSS = """
    RunHeader {
        width: 1fr;
        height: 2;
        padding: 0 1;
        text-wrap: nowrap;
        text-overflow: ellipsis;
        background: $panel;
        color: $foreground;
    }
    """

    def __init__(self, info: HeaderInfo, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.info = info

    def show(self, **changes: object) -> None:
        """Update some fields (those of HeaderInfo) and redraw if anything changed."""
        info = replace(self.info, **changes)
        if info != self.info:
            self.info = info
            self.refresh()

    @property
    def plain(self) -> str:
        """The header as plain text, as drawn at the widget's width."""
        return self.render().plain

    def render(self) -> Text:
        width = self.content_region.width or 10_000  # not laid out yet: everything
        first, second = header_items(self.info)
        return Text("\n").join([fit_line(first, width), fit_line(second, width)])
