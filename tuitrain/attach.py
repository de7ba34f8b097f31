"""`tuitrain attach [RUN]` and `tuitrain runs`: the app on a headless run of this user,
live through its socket or, once it has ended, again from its metrics file.

A live run is steered from the app as a run the app started would be; `q` detaches and the
run goes on. Stopping a run is asked for apart (`--stop`) and confirmed first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TextIO

from tuitrain.errors import EXIT_FAILED, EXIT_OK, UsageError
from tuitrain.events import Applied, Command, Event, Failed, Finished, Rejected, Step, Stop
from tuitrain.replay import ReplayClient, ReplayError, earlier_history
from tuitrain.runs import RunRecord, RuntimeFolderError, find_run, list_runs, runtime_folder
from tuitrain.settings import Settings, validate_settings
from tuitrain.socket_client import AttachError, SocketClient

STOP_ANSWER_SECONDS = 30.0  # how long --stop waits for the run to say it took the Stop


def attach(name: str | None, *, read_only: bool = False) -> int:
    """Open the app on run `name` (the newest live run if None); returns the app's status.

    Raises:
        UsageError: no such run, a run that cannot be reached, or nothing to show.
    """
    from tuitrain.tui.app import TuitrainApp

    client, settings = open_run(name, read_only=read_only)
    if not (sys.stdin.isatty() and sys.stdout.isatty()):
        client.stop()
        raise UsageError("the app needs a terminal (this is not one); over ssh, `ssh -t HOST "
                         "tuitrain attach` gives it one")
    # A finished run's replay steers nothing either: it is read-only, and says so.
    watch_only = read_only or isinstance(client, ReplayClient)
    app = TuitrainApp(settings, worker_factory=lambda _: client, attached=True,
                      read_only=watch_only)
    app.run()
    return app.return_code or EXIT_OK


class _WithEarlier:
    """A live run's client whose history goes back to the run's first step: the socket
    sends the latest events (tuitrain.listener.HISTORY_EVENTS); the steps before them come
    from the run's metrics file, read when the first step arrives."""

    def __init__(self, client: SocketClient, metrics: str) -> None:
        self.client = client
        self.metrics = metrics
        self._first_step_seen = False

    def __getattr__(self, name: str) -> object:
        return getattr(self.client, name)

    def start(self) -> None:
        self.client.start()

    def send(self, command: Command) -> int:
        return self.client.send(command)

    def stop(self, timeout: float = 5.0) -> None:
        self.client.stop(timeout)

    @property
    def alive(self) -> bool:
        return self.client.alive

    def poll(self) -> list[Event]:
        events = self.client.poll()
        if self._first_step_seen:
            return events
        for i, event in enumerate(events):
            if isinstance(event, Step):
                self._first_step_seen = True
                if event.stats.step > 1:
                    events[i:i] = earlier_history(self.metrics, event.stats.step)
                break
        return events


def open_run(name: str | None, *, read_only: bool
             ) -> tuple[SocketClient | _WithEarlier | ReplayClient, Settings]:
    """The client for run `name`, and the run's settings. `name` may also be a metrics
    file, shown as a finished run."""
    if name is not None and name.endswith(".jsonl") and Path(name).is_file():
        return _replay(name)
    record = _find(name)
    if record.live:
        try:
            client = SocketClient(record.socket, read_only=read_only)
        except AttachError as error:
            raise UsageError(f"run {record.id}: {error}") from None
        settings = _settings(client.hello.get("settings"), record.id)
        if record.metrics:
            return _WithEarlier(client, record.metrics), settings
        return client, settings
    if not record.metrics:
        raise UsageError(f"run {record.id} has {_ended(record)} and wrote no metrics file "
                         "(--metrics FILE.jsonl): there is nothing to show")
    if not record.metrics_written:
        raise UsageError(f"run {record.id} has {_ended(record)} and its metrics file "
                         f"{record.metrics} is not there: there is nothing to show")
    return _replay(record.metrics)


def stop_run(name: str | None, *, yes: bool, out: TextIO = sys.stdout,
             ask: TextIO = sys.stdin) -> int:
    """Stop run `name` as Ctrl-C does (the step under way ends at its next layer, and
    nothing of it is kept), once the user confirmed (or `yes`)."""
    record = _find(name)
    if not record.live:
        raise UsageError(f"run {record.id} has already {_ended(record)}")
    if not yes:
        if not ask.isatty():
            raise UsageError("--stop asks before it stops a run: add --yes to stop it unasked")
        out.write(f"stop run {record.id} ({record.model}, step {record.step} of "
                  f"{record.steps})? [y/N] ")
        out.flush()
        if ask.readline().strip().lower() not in ("y", "yes"):
            out.write("not stopped\n")
            return EXIT_OK
    try:
        client = SocketClient(record.socket)
    except AttachError as error:
        raise UsageError(f"run {record.id}: {error}") from None
    client.start()
    asked = client.send(Stop())
    deadline = time.monotonic() + STOP_ANSWER_SECONDS
    try:
        while time.monotonic() < deadline:
            for event in client.poll():
                if isinstance(event, Rejected) and event.id == asked:
                    out.write(f"not stopped: {event.reason}\n")
                    return EXIT_FAILED
                if isinstance(event, Applied) and event.id == asked:
                    out.write(f"run {record.id} stops after step {event.step}\n")
                    return EXIT_OK
                if isinstance(event, (Finished, Failed)):
                    out.write(f"run {record.id} has ended\n")
                    return EXIT_OK
            time.sleep(0.05)
    finally:
        client.stop()
    out.write(f"run {record.id} did not answer within {STOP_ANSWER_SECONDS:g} s\n")
    return EXIT_FAILED


def runs_listing() -> list[str]:
    """One line per run of this user on this machine, oldest first, under a header."""
    records = list_runs(_folder())
    if not records:
        return ["no runs yet: a `tuitrain run --headless` shows here while it runs and after"]
    header = ("RUN", "MODEL", "STEP", "STATE", "STARTED", "ATTACH TO")
    rows = [
        (
            r.id,
            r.model,
            f"{r.step}/{r.steps}",
            r.state,
            time.strftime("%Y-%m-%d %H:%M", time.localtime(r.started)),
            r.socket if r.live else _ended_source(r),
        )
        for r in records
    ]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header) - 1)]
    return ["  ".join([*(c.ljust(w) for c, w in zip(row, widths, strict=False)), row[-1]])
            for row in [header, *rows]]


def _ended_source(record: RunRecord) -> str:
    """What an ended run can be shown from: its metrics file, if it is there."""
    if record.metrics_written:
        return record.metrics
    return "(metrics file not written)" if record.metrics else "(no metrics file)"


def _folder() -> Path:
    try:
        return runtime_folder()
    except RuntimeFolderError as error:
        raise UsageError(f"runtime folder: {error}") from None


def _find(name: str | None) -> RunRecord:
    try:
        return find_run(_folder(), name)
    except LookupError as error:
        raise UsageError(str(error.args[0])) from None


def _replay(path: str) -> tuple[ReplayClient, Settings]:
    try:
        client = ReplayClient(path)
    except ReplayError as error:
        raise UsageError(str(error)) from None
    return client, _settings(client.settings, path)


def _settings(data: object, where: str) -> Settings:
    try:
        return validate_settings(data if isinstance(data, dict) else {})
    except ValueError as error:
        raise UsageError(f"{where}: its settings cannot be read: {error}") from None


def _ended(record: RunRecord) -> str:
    return {
        "gone": "gone (its process ended without a word)",
        "interrupted": "been interrupted",
    }.get(record.state, record.state)


# --- the command line -------------------------------------------------------------------


def add_commands(commands: argparse._SubParsersAction) -> None:
    """`attach` and `runs`, on the command line's subcommands."""
    attach = commands.add_parser(
        "attach",
        help="the app on a headless run: live, or a finished one from its metrics",
        description="Open the app on a headless run of yours on this machine (over ssh: "
        "`ssh -t HOST tuitrain attach`). q detaches; the run goes on.",
    )
    attach.add_argument("run", nargs="?", metavar="RUN",
                        help="a run id or pid from `tuitrain runs`, or a metrics file "
                        "(default: the newest live run)")
    attach.add_argument("--read-only", action="store_true", help="watch; send nothing")
    attach.add_argument("--stop", action="store_true",
                        help="stop the run as Ctrl-C does (the step under way ends at its "
                        "next layer, nothing of it kept), once you confirm")
    attach.add_argument("--yes", action="store_true", help="with --stop: do not ask")
    attach.set_defaults(handler=cmd_attach)
    runs = commands.add_parser("runs", help="list your live and finished headless runs")
    runs.set_defaults(handler=cmd_runs)


def cmd_attach(args: argparse.Namespace) -> int:
    if args.stop and args.read_only:
        raise UsageError("--stop sends the run a stop, which --read-only never does: give one")
    if args.yes and not args.stop:
        raise UsageError("--yes answers --stop's question; without --stop it has nothing to do")
    if args.stop:
        return stop_run(args.run, yes=args.yes)
    return attach(args.run, read_only=args.read_only)


def cmd_runs(args: argparse.Namespace) -> int:
    print("\n".join(runs_listing()))
    return EXIT_OK
