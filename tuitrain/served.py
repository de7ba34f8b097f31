"""A headless run that viewers can attach to: its worker, seen through the run's socket.

`serve` wraps the worker the headless runner follows. Each `poll` first passes the commands
viewers sent to the worker, then hands every event to the viewers before the runner sees
it; the answer to a viewer's command goes back to it under its own id, and the other
viewers (and the run's own log) are told who changed what. The run's record in the runtime
folder (tuitrain.runs) says how far it got, now and then, and how it ended.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TextIO

from tuitrain.errors import EXIT_BAD_INPUT
from tuitrain.events import Applied, Command, Event, Failed, Finished, Log, Rejected, Step
from tuitrain.listener import SETTING_OF, Listener, Viewer, answer_for_others, ended_state
from tuitrain.runs import (
    RunRecord,
    RuntimeFolderError,
    forget_record,
    new_record,
    runtime_folder,
    write_record,
)
from tuitrain.settings import Settings
from tuitrain.worker import ProcessWorker

RECORD_SECONDS = 2.0  # the record's step is rewritten at most this often


class ServedWorker:
    """`worker` with viewers attached through `listener`; otherwise the same worker."""

    def __init__(self, worker: ProcessWorker, listener: Listener, record: RunRecord) -> None:
        self.worker = worker
        self.listener = listener
        self.record = record
        self._asked: dict[int, tuple[Viewer, Command]] = {}  # worker's id -> who asked
        self._recorded_at = time.monotonic()
        self._end: Event | None = None
        self._step = 0  # the latest step, written to the record now and then

    def __getattr__(self, name: str) -> object:  # wait, pid, log_path, ...: the worker's
        return getattr(self.worker, name)

    def start(self) -> None:
        self.worker.start()

    def send(self, command: Command) -> int:
        return self.worker.send(command)

    def stop(self, timeout: float = 5.0) -> None:
        self.worker.stop(timeout)

    def poll(self) -> list[Event]:
        for viewer, command in self.listener.take_commands():
            self._asked[self.worker.send(command)] = (viewer, command)
        events = []
        for event in self.worker.poll():
            events.append(self._pass_on(event))
        for notice in self.listener.take_notices():
            self.listener.publish(notice)
            events.append(notice)
        return events

    def close(self) -> None:
        """The run has ended: viewers get the last events, the record says how it ended,
        or goes with a run refused for a mistake in its input."""
        self.listener.close()
        if isinstance(self._end, Failed) and self._end.exitcode == EXIT_BAD_INPUT:
            forget_record(self.listener.path.parent, self.record.id)
            return
        self.record = replace(self.record, state=ended_state(self._end), socket="",
                              ended=time.time())
        self._write()

    def _pass_on(self, event: Event) -> Event:
        """Publish `event`; returns what the runner should see of it."""
        if isinstance(event, (Applied, Rejected)) and event.id in self._asked:
            viewer, command = self._asked.pop(event.id)
            own = _with_id(event, command.id)
            others = answer_for_others(event, viewer, command)
            self.listener.publish(own, to=viewer, others=others)
            asked = SETTING_OF.get(type(command))
            if isinstance(event, Applied) and asked:  # a viewer attaching later starts there
                self.listener.set_engine_setting(asked, getattr(command, asked))
            if isinstance(others, Applied):
                return Log(f"{others.what}, from step {event.step}")
            return others
        self.listener.publish(event)
        if isinstance(event, Step):
            self._step = event.stats.step
            if time.monotonic() - self._recorded_at >= RECORD_SECONDS:
                self._write()
        elif isinstance(event, (Finished, Failed)):
            self._end = event
        return event

    def _write(self) -> None:
        self._recorded_at = time.monotonic()
        self.record = replace(self.record, step=self._step)
        try:
            write_record(self.listener.path.parent, self.record)
        except OSError:
            pass  # the folder went away: the run matters more than its listing


def serve(worker: ProcessWorker, settings: Settings, *, err: TextIO) -> ServedWorker | None:
    """`worker` served on a socket in the runtime folder; None (and one line on `err`)
    when the folder is not private or the socket cannot be made: the run goes on unseen."""
    try:
        folder = runtime_folder()
        record = new_record(model=settings.model, metrics=settings.logging.metrics or "",
                            steps=settings.training.steps, folder=folder)
        hello = {
            "run": record.id,
            "model": settings.model,
            "metrics": record.metrics,
            "settings": settings.model_dump(mode="json"),
        }
        listener = Listener(record.socket, hello=hello)
    except (RuntimeFolderError, OSError) as error:
        err.write(f"warning: no socket to attach to this run: {error}\n")
        return None
    try:
        write_record(folder, record)
    except OSError as error:
        listener.close()
        err.write(f"warning: no socket to attach to this run: {error}\n")
        return None
    return ServedWorker(worker, listener, record)


def _with_id(event: Applied | Rejected, command_id: int) -> Applied | Rejected:
    return replace(event, id=command_id)
