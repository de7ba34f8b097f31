"""The app's panels, which of them show at the terminal's size, and how they
redraw from the latest step.

Which panels show depends on the terminal's size (tuitrain.tui.layout): all of them on a
large one, the others a key away on a small one. Panels are redrawn from the latest sample
at a bounded rate (tuitrain.tui.app's timers), so a worker doing hundreds of steps a second
never floods the screen.

The app holds a RunPanels and tells it when a step arrived (mark_stale) and when the
terminal changed size; RunPanels reads the run's data through PanelsHost.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widget import Widget
from textual.widgets import Footer

from engine.telemetry import StepStats
from tuitrain.events import Started
from tuitrain.settings import Settings
from tuitrain.trials import TrialBook
from tuitrain.tui.chunk_map import ChunkMap
from tuitrain.tui.controls import Controls
from tuitrain.tui.failure_panel import FailurePanel
from tuitrain.tui.header import HeaderInfo, RunHeader, settings_fields
from tuitrain.tui.layout import PANELS, View, closest_view, size_class, views_for
from tuitrain.tui.log_panel import LogPanel
from tuitrain.tui.memory_chart import MemoryChart
from tuitrain.tui.ranks_table import RanksTable
from tuitrain.tui.states_table import StatesTable
from tuitrain.tui.step_panel import StepPanel
from tuitrain.tui.step_timeline import StepTimeline
from tuitrain.tui.trials_table import TrialsTable

# The body carries its size (-full, -standard, -compact) and view (-view-<name>) as
# classes; tuitrain.tui.layout says which panels each view shows. The app's CSS.
PANELS_CSS = """
#body { height: 1fr; }
#top { height: 3fr; }
#side { width: 52; }
#middle { height: 2fr; min-height: 9; }
#controls { width: 52; }
#trials { width: 86; }

#body.-standard.-view-tuning #trials { width: 1fr; }
#body.-standard.-view-tuning #controls { width: 40; }

#body.-compact #top { height: 1fr; }
#body.-compact #middle { height: 9; min-height: 0; }
#body.-compact #controls { width: 40; }
#body.-compact Controls > Horizontal { margin-bottom: 0; }
#body.-compact.-view-run #loss-plot { display: none; }
#body.-compact.-view-run #step-times { width: 1fr; }
#body.-compact.-view-trials #middle { layout: vertical; height: 1fr; }
#body.-compact.-view-trials #trials { width: 1fr; height: 1fr; }
#body.-compact.-view-trials #controls { width: 1fr; height: 8; }
#body.-compact.-view-step #middle { height: 10; }
#body.-compact.-view-run.-tall-step #middle { height: 12; }
#body.-compact.-view-step.-tall-step #middle { height: 12; }
#body.-compact.-view-placement #side { width: 1fr; }
#body.-compact.-view-log #log { height: 1fr; }
Footer.-compact FooterLabel { margin: 0 1 0 0; }
"""


class PanelsHost(Protocol):
    """What the panels read of the app: the run so far, and the app's own DOM calls."""

    settings: Settings  # as the run uses them now
    started: Started | None
    latest: StepStats | None  # the latest step
    trial_book: TrialBook

    @property
    def is_running(self) -> bool: ...

    @property
    def focused(self) -> Widget | None: ...

    def query_one(self, selector: Any, expect_type: Any = None) -> Any: ...

    def set_focus(self, widget: Widget | None) -> None: ...

    def call_after_refresh(self, callback: Callable[[], object]) -> bool: ...


class RunPanels:
    """The panels of one training run and how they are laid out and drawn; the app wires
    them to the worker and the user's keys.

    Args:
        app: the app they are drawn in, whose run they show.
    """

    def __init__(self, app: PanelsHost) -> None:
        self.app = app
        self.size_class = ""
        self.view: View | None = None
        self.panels_stale = False  # a step arrived since the panels were drawn
        self.charts_stale = False

    @property
    def policy_known(self) -> bool:
        """Whether the run's policy is known: the user gave it, or the run said which it
        uses. One left unset is the plan's choice, made as the worker starts (tuitrain.fit)."""
        return self.app.settings.policy_chosen or self.app.started is not None

    def mark_stale(self, *, panels: bool = True, charts: bool = True) -> None:
        """Something they show changed: redrawn at the timers' next tick."""
        self.panels_stale |= panels
        self.charts_stale |= charts

    # --- layout ---------------------------------------------------------------------------

    def compose(self) -> ComposeResult:
        engine = self.app.settings.engine
        yield RunHeader(
            HeaderInfo(
                model=self.app.settings.model,
                total_steps=self.app.settings.training.steps,
                policy=engine.policy if self.policy_known else None,
                margin_ratio=engine.margin_ratio,
                device_budget=engine.device_budget.nbytes if engine.device_budget else None,
            ),
            id="header",
        )
        with Vertical(id="body"):
            with Horizontal(id="top"):
                yield MemoryChart(id="memory")
                yield StepTimeline(id="timeline")
                with Vertical(id="side"):
                    yield StatesTable(id="states")
                    yield ChunkMap(id="chunks")
            with Horizontal(id="middle"):
                yield StepPanel(id="step")
                yield TrialsTable(id="trials")
                yield Controls(
                    policy=engine.policy if self.policy_known else None,
                    margin_ratio=engine.margin_ratio,
                    device_budget=engine.device_budget,
                    id="controls",
                )
            yield RanksTable(id="ranks")
            yield FailurePanel(id="failure")
            yield LogPanel(id="log")
        yield Footer()

    # --- views ----------------------------------------------------------------------------

    def lay_out(self, width: int, height: int) -> None:
        """Pick the size class for `width` x `height`, and the view of it closest to the one
        shown, and show that view's panels."""
        size = size_class(width, height)
        if size != self.size_class or self.view is None:
            self.size_class = size
            self.show_view(closest_view(size, self.view))

    def show_view(self, view: View) -> None:
        """Show `view`'s panels (of this size class) and hide the others."""
        self.view = view
        body = self.app.query_one("#body")
        for size in ("full", "standard", "compact"):
            body.set_class(size == self.size_class, f"-{size}")
        for other in {*views_for(self.size_class), view}:
            body.set_class(other == view, f"-view-{other.name}")
        for panel in PANELS:
            self.app.query_one(f"#{panel}").display = panel in view.panels
        side = self.app.query_one("#side")
        side.display = bool({"states", "chunks"} & view.panels)
        for row in ("#top", "#middle"):
            node = self.app.query_one(row)
            node.display = any(child.display for child in node.children)
        self.show_ranks()
        self.app.query_one(Footer).compact = self.size_class == "compact"
        trials = self.app.query_one(TrialsTable)
        if trials.display and self.size_class == "compact":
            trials.focus()  # the view is for picking a row: the arrows move it at once
        elif self.app.focused is trials and not trials.display:
            self.app.set_focus(None)
        self.charts_stale = self.app.latest is not None  # hidden charts were not drawn
        self.app.call_after_refresh(self.redraw_charts)

    def show_ranks(self) -> None:
        """The rank rows go with the memory charts, in a run of several ranks."""
        several = self.app.started is not None and self.app.started.ranks > 1
        shown = several and self.view is not None and "memory" in self.view.panels
        self.app.query_one(RanksTable).display = shown

    def reset(self) -> None:
        """Empty every panel for a new run (the log keeps the old run's lines)."""
        self.app.query_one(FailurePanel).hide()
        self.app.query_one(LogPanel).shorten(False)
        self.app.query_one(LogPanel).new_run()
        for panel in (MemoryChart, StepPanel, StepTimeline, TrialsTable):
            self.app.query_one(panel).reset()
        self.show_ranks()
        # A policy the plan chose is chosen again, maybe another.
        in_force = settings_fields(self.app.settings.engine, policy_known=self.policy_known)
        self.app.query_one(RunHeader).show(step=0, tokens_per_s=None, **in_force)
        if not self.policy_known:
            self.app.query_one(Controls).forget_policy()

    # --- drawing --------------------------------------------------------------------------

    def redraw(self) -> None:
        """Draw everything that is stale now, without waiting for the timers."""
        self.redraw_panels()
        self.redraw_charts()

    def redraw_panels(self) -> None:
        """Push the latest sample into the header, tables and maps, if a step arrived."""
        if not self.panels_stale or self.app.latest is None or not self.app.is_running:
            return
        self.panels_stale = False
        stats = self.app.latest
        # Settings come from the Applied answers, which can arrive before the step that
        # first ran with them: the header shows what is in force, not what the last step had.
        shown = {
            "step": stats.step,
            "tokens_per_s": self._pace(),
            "device_budget": stats.device_budget,
        }
        in_force = settings_fields(self.app.settings.engine, policy_known=self.policy_known)
        self.app.query_one(RunHeader).show(**{**shown, **in_force})
        self.app.query_one(StatesTable).show(stats.memory)
        self.app.query_one(ChunkMap).show(stats.memory.chunks)
        step = self.app.query_one(StepPanel)
        step.redraw_breakdown()
        # A step with disk traffic or a held-out loss has more lines than a small screen's
        # step panel: it takes two rows from the charts rather than cut its last lines.
        self.app.query_one("#body").set_class(step.lines > 7, "-tall-step")
        self.app.query_one(StepTimeline).show(stats)
        book = self.app.trial_book
        self.app.query_one(TrialsTable).show(book.rows(), book.current)
        self.app.query_one(RanksTable).redraw()

    def _pace(self) -> float | None:
        """The header's tok/s: the setting in force's, as its trials row has it (median of
        its settled steps), so the two never show one fact as two values."""
        current = self.app.trial_book.current
        row = next((t for t in self.app.trial_book.rows() if t.setting == current), None)
        return row.tokens_per_second if row is not None else None

    def redraw_charts(self) -> None:
        """Redraw the memory and loss charts from their recorded windows, if a step arrived;
        a chart hidden in this view is drawn when it is shown."""
        if not self.charts_stale or not self.app.is_running:
            return
        self.charts_stale = False
        memory = self.app.query_one(MemoryChart)
        if memory.display:
            memory.redraw()
        step = self.app.query_one(StepPanel)
        if step.display:
            step.redraw_loss()

