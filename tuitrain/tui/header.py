"""RunHeader: what runs where, how far it got, how fast, and under which settings."""

from __future__ import annotations

from dataclasses import dataclass, replace

from rich.text import Text
from textual.widgets import Static

from tuitrain.formatting import format_count, format_rate, format_size
from tuitrain.settings import EngineSettings

STATE_STYLES = {
    "starting": "bold yellow",
    "running": "bold green",
    "paused": "bold cyan",
    "stopping": "bold yellow",
    "failed": "bold red",
    "finished": "bold blue",
}
WAITING_STATES = ("starting", "running", "paused")  # values not known yet may still come


@dataclass(frozen=True)
class HeaderInfo:
    """Everything the header shows; None reads as not known yet."""

    model: str
    parameters: int | None = None
    device: str | None = None  # as the worker names it; "" when it could not tell
    state: str = "starting"
    step: int = 0
    total_steps: int | None = None
    tokens_per_s: float | None = None
    policy: str = "auto"
    margin_ratio: float = 0.0
    device_budget: int | None = None


def settings_fields(engine: EngineSettings) -> dict[str, object]:
    """The settings in force, as RunHeader.show takes them."""
    fields: dict[str, object] = {"policy": engine.policy, "margin_ratio": engine.margin_ratio}
    if engine.device_budget is not None:
        fields["device_budget"] = engine.device_budget.nbytes
    return fields


class RunHeader(Static):
    """Two lines at the top: the run (model, device, state, progress) and its settings."""

    DEFAULT_CSS = """
    RunHeader {
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
        self.update(self._render_info())

    def show(self, **changes: object) -> None:
        """Update some fields (those of HeaderInfo) and redraw if anything changed."""
        info = replace(self.info, **changes)
        if info != self.info:
            self.info = info
            self.update(self._render_info())

    @property
    def plain(self) -> str:
        """The header as plain text (what a reader of the screen sees)."""
        return self._render_info().plain

    def _render_info(self) -> Text:
        info = self.info
        sep = ("  │  ", "dim")
        # "…" promises a value; once the run has ended without one, it will not come.
        unknown = "…" if info.state in WAITING_STATES else "-"
        params = unknown if info.parameters is None else format_count(info.parameters)
        if info.device is None:
            device = unknown
        else:
            device = info.device or "N/A"
        total = "?" if info.total_steps is None else str(info.total_steps)
        rate = unknown if info.tokens_per_s is None else format_rate(info.tokens_per_s)
        device_budget = unknown if info.device_budget is None else format_size(info.device_budget)
        first = Text.assemble(
            ("tuitrain", "bold"),
            sep,
            (info.model, "bold"),
            f" · {params} params",
            sep,
            "device ",
            (device, "bold"),
            sep,
            (f"● {info.state}", STATE_STYLES.get(info.state, "")),
            sep,
            f"step {info.step}/{total}",
            sep,
            f"{rate} tok/s",
        )
        second = Text.assemble(
            "policy ",
            (info.policy, "bold"),
            sep,
            "margin ",
            (f"{info.margin_ratio:.2f}", "bold"),
            sep,
            "budget ",
            (device_budget, "bold"),
        )
        return Text("\n").join([first, second])
