"""SizedPlot: a plotext chart that is drawn again whenever its size changes.

A chart's curve is averaged down to the dots its width has (tuitrain.tui.downsample), so
a curve given to a chart before its view has laid it out, or at another width, is the
wrong curve: drawn for no columns it is a single point. The chart's owner draws it when a
step arrives; this draws it too when the chart gets its size, so that what is on screen
never depends on which of the two came first.
"""

from __future__ import annotations

from collections.abc import Callable

from textual_plotext import PlotextPlot


class SizedPlot(PlotextPlot):
    def __init__(self, draw: Callable[[], None], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._draw = draw

    @property
    def laid_out(self) -> bool:
        """Whether the chart has a size yet: a curve drawn before would be drawn again."""
        return self.size.width > 0 and self.size.height > 0

    def on_resize(self) -> None:
        self._draw()
