"""The UI side of the worker channel: what the TUI and the headless runner talk to.

Two implementations: ProcessWorker (tuitrain.worker, a real spawned process) and the tests'
FakeWorker (tests/tuitrain/fakeworker.py, scripted events).
"""

from __future__ import annotations

from typing import Protocol

from tuitrain.events import Command, Event


class WorkerClient(Protocol):
    def start(self) -> None:
        """Start training in the background; returns at once."""

    def send(self, command: Command) -> int:
        """Queue a command for the worker; returns the id its Applied/Rejected will carry."""

    def poll(self) -> list[Event]:
        """Every event that arrived since the last call; never blocks."""

    def stop(self, timeout: float = 5.0) -> None:
        """Ask the worker to stop, wait up to `timeout`, then kill it. Idempotent."""

    @property
    def alive(self) -> bool:
        """Whether the worker process is still running."""
