"""The terminal app: watch a training run's memory, steer its placement, save a preset."""

from tuitrain.tui.app import TuitrainApp
from tuitrain.tui.run_app import run_app

__all__ = ["TuitrainApp", "run_app"]
