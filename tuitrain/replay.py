"""A finished run, shown again from its metrics file: the app as a viewer of the past.

ReplayClient reads the latest run of a metrics file (tuitrain.metrics) and gives the app
what its worker said: Started, every step, every evaluation, and Finished with the summary
the run appended. It sends nothing: a finished run cannot be steered.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from engine.telemetry import StepStats, stats_from_dict
from tuitrain.events import Command, Eval, Event, Failed, Finished, Rejected, Started, Step


class ReplayError(ValueError):
    """The metrics file cannot be read as a run."""


class ReplayClient:
    """The latest run in the metrics file at `path`, for the app; read-only.

    Raises:
        ReplayError: the file cannot be read, or holds no run (no settings line).
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.settings, self._events = _read_run(self.path)
        self._next_id = 0
        self._pending: list[Event] = []

    def start(self) -> None:
        self._pending, self._events = [*self._events, *self._pending], []

    def send(self, command: Command) -> int:
        self._next_id += 1
        self._pending.append(Rejected(self._next_id, "a finished run is shown read-only"))
        return self._next_id

    def poll(self) -> list[Event]:
        events, self._pending = self._pending, []
        return events

    def stop(self, timeout: float = 5.0) -> None:
        pass

    @property
    def alive(self) -> bool:
        return False


def earlier_history(path: str | os.PathLike, before: int) -> list[Event]:
    """The steps and evaluations of the latest run in a metrics file from before step
    `before`: what a viewer attaching late misses of a long run. Empty when the file
    cannot be read."""
    try:
        _, events = _read_run(Path(path))
    except ReplayError:
        return []
    return [e for e in events
            if (isinstance(e, Step) and e.stats.step < before)
            or (isinstance(e, Eval) and e.step < before)]


def _read_run(path: Path) -> tuple[dict, list[Event]]:
    """The latest run's settings (as used) and its events, in the order they came."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise ReplayError(f"{path}: cannot read: {getattr(error, 'strerror', None) or error}"
                          ) from None
    header: dict | None = None
    events: list[Event] = []
    summary: dict | None = None
    for line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill mid-write
        if not isinstance(record, dict):
            continue
        try:
            if isinstance(record.get("settings"), dict):  # a new run starts here
                header, events, summary = record, [], None
            elif "step" in record:
                events.append(Step(stats=stats_from_dict(record)))
            elif isinstance(record.get("eval"), dict):
                events.append(Eval(**record["eval"]))
            elif isinstance(record.get("summary"), dict):
                summary = record["summary"]
        except (KeyError, TypeError):
            continue  # a record of another version of tuitrain: left out, not fatal
    if header is None:
        raise ReplayError(f"{path}: no run in it (no settings line)")
    steps = [e.stats for e in events if isinstance(e, Step)]
    ended = _as_it_ended(header["settings"], steps)
    started = Started(
        model=str(header["settings"].get("model", "")),
        parameters=int(header.get("parameters") or 0),
        device=str(header.get("device") or ""),
        chunks=list(steps[0].memory.chunks) if steps else [],
        # The settings in force at the end: the screen of a finished run shows those, as
        # the trials table's last row has them (the changes between are not replayed).
        settings=ended,
    )
    if summary is not None:
        summary = {k: v for k, v in summary.items() if k != "trials"}
        end: Event = Finished(summary=summary)
    else:
        end = Failed(reason="the run ended without a summary (killed, or it failed): "
                            f"{len(steps)} steps recorded")
    return ended, [started, *events, end]


def _as_it_ended(settings: dict, steps: list[StepStats]) -> dict:
    """The run's settings with the policy, margin, budget and step shape its last step ran
    with: what a preset saved from the replay should hold."""
    if not steps:
        return settings
    first, last = steps[0], steps[-1]
    engine = {**settings.get("engine", {}), "policy": last.policy,
              "margin_ratio": last.margin_ratio}
    if last.device_budget != first.device_budget:
        engine["device_budget"] = f"{last.device_budget}"
    training = dict(settings.get("training", {}))
    if (last.micro_batches, last.activation_checkpointing) != (
            first.micro_batches, first.activation_checkpointing) and "batch_size" in training:
        rows = training["batch_size"] * training.get("grad_accum", 1)  # the global batch
        training.update(batch_size=rows // last.micro_batches, grad_accum=last.micro_batches,
                        activation_checkpointing=last.activation_checkpointing)
    return {**settings, "engine": engine, "training": training}
