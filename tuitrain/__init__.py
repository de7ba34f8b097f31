"""tuitrain: train language models bigger than your GPU, tuned live in a terminal app."""

__version__ = "0.1.0"
