"""The app told to end from outside: SIGTERM (`kill`, a batch system's time limit) stops its
run at once, as it stops a headless run, and the app leaves by its own exit, status 143;
SIGHUP (its terminal closed) the same way, status 129. A viewer attached to a headless run
only detaches. The signals are sent to this process, as `kill` sends them, while the app
runs on its pilot; the last tests end the real command on a terminal of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import io
import json
import os
import select
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.tuitrain.fakeworker import FakeWorker, fake_run, fake_stats
from tuitrain.events import Failed
from tuitrain.headless import _Report
from tuitrain.run_summary import interrupted_line
from tuitrain.settings import Settings
from tuitrain.tui.app import TuitrainApp
from tuitrain.tui.termination import hung_up

from .helpers import SIZE, make_app, settle

pytestmark = pytest.mark.anyio

START_SECONDS = 240.0  # a cold start imports torch and tokenises the corpus


@pytest.fixture(autouse=True)
def handlers_as_they_were() -> Iterator[None]:
    """Once a test ends, the signals the app takes or watches have the handlers they had
    before it: the app gives them back."""
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGCONT)}
    yield
    for signum, handler in before.items():
        assert signal.getsignal(signum) == handler, f"{signum.name} was not given back"


def send(app: TuitrainApp, signum: signal.Signals) -> None:
    """`signum` to this process, as `kill` sends it; only once the app's handler is in
    place: without it the signal would end the test run itself."""
    handler = signal.getsignal(signum)
    assert getattr(handler, "__self__", None) is app.termination, (
        f"the app does not take {signum.name}: sending it would end the tests")
    os.kill(os.getpid(), signum)


async def until_exited(app: TuitrainApp, seconds: float = 30.0) -> None:
    deadline = time.monotonic() + seconds
    while app.return_code is None:
        assert time.monotonic() < deadline, "the app did not exit"
        await asyncio.sleep(0.02)


def with_stop_now(fake: FakeWorker) -> list[str]:
    """Give the fake worker ProcessWorker's `stop_now`; returns the stops it was asked for."""
    asked: list[str] = []

    def stop_now() -> None:
        asked.append("now")
        fake.stop()

    fake.stop_now = stop_now  # type: ignore[attr-defined]
    return asked


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGHUP, 129)],
                         ids=["SIGTERM", "SIGHUP"])
async def test_the_signal_stops_the_run_at_once_and_the_app_exits_with_its_status(
        signum: signal.Signals, status: int) -> None:
    app, fake = make_app(fake_run(3, model="tiny"))
    asked = with_stop_now(fake)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.run_state == "running"
        send(app, signum)
        await until_exited(app)
    assert app.return_code == status == app.termination.exit_status
    assert asked == ["now"], "stopped at once, not asked to end its step"
    assert app.termination.stopped_run and app.failure_at_quit is None


@pytest.fixture
def textual_sigcont() -> Iterator[list[int]]:
    """A SIGCONT handler in place before the app runs, as Textual's driver puts its own (it
    takes the terminal up again after a Ctrl-Z); yields the signals it was handed."""
    handed: list[int] = []
    before = signal.signal(signal.SIGCONT, lambda signum, frame: handed.append(signum))
    yield handed
    signal.signal(signal.SIGCONT, before)


@contextlib.contextmanager
def terminal_hung_up() -> Iterator[None]:
    """Standard output and error on a terminal that has hung up, as once its window has
    closed; this process's own are put back after. Inside the test itself: pytest puts
    its capture back on them at each phase of a test."""
    master, slave = os.openpty()
    os.close(master)
    kept = [os.dup(1), os.dup(2)]
    for fd in (1, 2):
        os.dup2(slave, fd)
    os.close(slave)
    yield
    for fd, original in zip((1, 2), kept, strict=True):
        os.dup2(original, fd)
        os.close(original)


async def test_sigcont_reaches_textual_while_the_terminal_is_there(
        textual_sigcont: list[int]) -> None:
    app, _ = make_app(fake_run(3, model="tiny"))
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        os.kill(os.getpid(), signal.SIGCONT)  # `fg` after a Ctrl-Z
        await pilot.pause()
        assert textual_sigcont == [signal.SIGCONT]
        await pilot.press("q")


async def test_a_terminal_that_hung_up_is_let_go_of_and_never_taken_up_again(
        textual_sigcont: list[int]) -> None:
    """The kernel sends SIGCONT with the hangup's SIGHUP, and they may be handled in either
    order: neither way does SIGCONT reach Textual, which would draw on the terminal."""
    app, _ = make_app(fake_run(3, model="tiny"))
    null = os.stat(os.devnull).st_rdev
    with terminal_hung_up():
        async with app.run_test(size=SIZE) as pilot:
            await settle(app, pilot)
            os.kill(os.getpid(), signal.SIGCONT)
            send(app, signal.SIGHUP)
            os.kill(os.getpid(), signal.SIGCONT)
            await until_exited(app)
        assert os.fstat(1).st_rdev == os.fstat(2).st_rdev == null, "let go of, for nowhere"
    assert app.return_code == 129
    assert textual_sigcont == []


def test_a_terminal_that_hung_up_is_told_from_one_still_there_and_from_a_pipe() -> None:
    master, slave = os.openpty()
    read_end, write_end = os.pipe()
    try:
        assert not hung_up(slave) and not hung_up(write_end)
        os.close(read_end)
        assert not hung_up(write_end), "a pipe's reader gone is no hangup"
        os.close(master)  # the window closed
        assert hung_up(slave)
    finally:
        os.close(slave)
        os.close(write_end)


def test_the_line_that_tells_a_run_stopped_now_is_the_headless_runners(tmp_path: Path) -> None:
    settings = Settings(model="tiny", logging={"metrics": str(tmp_path / "m.jsonl")},
                        checkpoint={"dir": str(tmp_path / "ck")})
    err = io.StringIO()
    report = _Report(settings=settings, out=io.StringIO(), err=err, log_path="w.log")
    report.latest = fake_stats(7)
    report.interrupted(now=True)
    assert err.getvalue() == interrupted_line(settings, 7, now=True) + "\n"


async def test_a_signal_after_the_run_failed_ends_the_app_with_the_failure_to_tell() -> None:
    failed = Failed(reason="worker exited with signal 9 (SIGKILL)", exitcode=-9)
    app, fake = make_app([*fake_run(3, model="tiny"), failed])
    with_stop_now(fake)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        assert app.run_state == "failed"
        send(app, signal.SIGTERM)
        await until_exited(app)
    assert app.return_code == 143
    assert app.failure_at_quit == failed, "told on the terminal once the screen is gone"
    assert not app.termination.stopped_run


async def test_a_sigterm_to_an_attached_viewer_detaches_and_leaves_the_run_going(
        tmp_path: Path) -> None:
    metrics = tmp_path / "m.jsonl"
    settings = Settings(model="tiny", logging={"metrics": str(metrics)})
    app, fake = make_app(fake_run(3, model="tiny"), settings=settings)
    app.attached = True  # tuitrain attach: the run is a headless process's
    asked = with_stop_now(fake)
    async with app.run_test(size=SIZE) as pilot:
        await settle(app, pilot)
        send(app, signal.SIGTERM)
        await until_exited(app)
    assert app.return_code == 143
    assert asked == [] and fake.stop_calls, "detached (its client's stop), not stopped"
    assert not app.termination.stopped_run
    assert not metrics.exists(), "the summary is the run's own process's to write"


# --- the real command on a terminal ------------------------------------------------------


class AppOnATerminal:
    """`tuitrain run tiny` (the app, not --headless) in a session of its own whose
    controlling terminal is a pseudo-terminal, as a shell's window is; what it draws is
    read as it comes (a terminal nobody reads would stop the app when full). Its
    temporary folder is the test's own, where the worker's log goes."""

    def __init__(self, tmp_path: Path) -> None:
        self.metrics = tmp_path / "m.jsonl"
        self.temporary = tmp_path / "tmp"
        self.temporary.mkdir()
        self.shown = bytearray()
        self._reading = threading.Event()
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", *reversed(SIZE), 0, 0))
        self.modes = termios.tcgetattr(slave)  # echo, line editing: as a shell leaves them
        command = [
            sys.executable, "-m", "tuitrain.cli", "run", "tiny", "--steps", "1000000",
            "--batch-size", "2", "--seq-len", "16", "--precision", "fp32",
            "--metrics", str(self.metrics),
        ]  # fmt: skip
        # The terminal becomes the new session's controlling one, then the command takes
        # over the process: the app leads the session, so the kernel's SIGHUP at a hangup
        # goes to it (under a shell it goes to the shell, which passes it on to its jobs).
        take_terminal = ("import fcntl, os, sys, termios; fcntl.ioctl(0, termios.TIOCSCTTY, 0);"
                         " os.execv(sys.executable, sys.argv[1:])")
        self.process = subprocess.Popen(
            [sys.executable, "-c", take_terminal, *command], cwd=tmp_path,
            stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
            env={**os.environ, "TERM": "xterm-256color", "TMPDIR": str(self.temporary)})
        os.close(slave)
        self._reading.set()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while self._reading.is_set():
            if select.select([self.master], [], [], 0.05)[0]:
                try:
                    data = os.read(self.master, 1 << 16)
                except OSError:  # the app ended and the terminal with it
                    return
                if not data:
                    return
                self.shown += data

    def steps(self) -> int:
        """How many steps the run has written to its metrics."""
        if not self.metrics.exists():
            return 0
        return self.metrics.read_text().count('\n{"step": ')

    def until_steps(self, steps: int, seconds: float = START_SECONDS) -> None:
        """Wait until the run has written `steps` steps to its metrics."""
        deadline = time.monotonic() + seconds
        while self.steps() < steps:
            assert self.process.poll() is None, f"exited early: {bytes(self.shown)[-2000:]!r}"
            assert time.monotonic() < deadline, f"not {steps} steps within {seconds:g} s"
            time.sleep(0.1)

    def wait(self, timeout: float) -> int:
        """The command's exit status, once it has ended and all it drew is read."""
        status = self.process.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return status

    def terminal_modes(self) -> list:
        """The terminal's modes now (asked through its other end, which stays open)."""
        return termios.tcgetattr(self.master)

    def hang_up(self) -> None:
        """Close the terminal, as a closed window or `tmux kill-session` does: the kernel
        hangs it up and sends SIGHUP to its session's leader, the app."""
        self._reading.clear()
        self._reader.join(timeout=10)
        os.close(self.master)
        self.master = -1

    def close(self) -> None:
        """End whatever is left: the app's whole session, the reader, the terminal."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        self._reading.clear()
        self._reader.join(timeout=10)
        if self.master >= 0:
            os.close(self.master)

    def summary(self) -> dict:
        """The summary that must be the metrics' last line."""
        records = [json.loads(line) for line in self.metrics.read_text().splitlines()]
        assert "summary" in records[-1], f"the metrics end on {list(records[-1])[:3]}"
        return records[-1]["summary"]

    def logs_left(self) -> list[Path]:
        return sorted(self.temporary.glob("tuitrain/*worker-*.log"))


@pytest.mark.slow
def test_sigterm_to_the_command_gives_the_terminal_back_and_exits_143(tmp_path: Path) -> None:
    app = AppOnATerminal(tmp_path)
    try:
        app.until_steps(2)
        os.kill(app.process.pid, signal.SIGTERM)
        assert app.wait(timeout=60) == 143
        assert app.terminal_modes() == app.modes, "echo and line editing not given back"
    finally:
        app.close()
    shown = bytes(app.shown)
    entered = shown.rfind(b"\x1b[?1049h")
    assert 0 <= entered < shown.rfind(b"\x1b[?1049l"), "the alternate screen was not left"
    summary = app.summary()
    assert summary["stopped"] and summary["stopped_now"]
    line = (f"stopped now after step {summary['last_step']}: the step under way was not "
            f"kept; metrics in {app.metrics}")
    assert shown.endswith(line.encode() + b"\r\n"), shown[-300:]
    assert app.logs_left() == []


@pytest.mark.slow
def test_a_terminal_closed_under_the_app_ends_its_run_as_sigterm_does_exit_129(
        tmp_path: Path) -> None:
    app = AppOnATerminal(tmp_path)
    try:
        app.until_steps(2)
        # A shell whose terminal went passes the hangup on to every process of its job, the
        # app's worker too: the run is the app's to stop, not the hangup's to end.
        for process in psutil.Process(app.process.pid).children(recursive=True):
            process.send_signal(signal.SIGHUP)
        app.until_steps(app.steps() + 2, seconds=60)
        app.hang_up()
        assert app.process.wait(timeout=60) == 129
    finally:
        app.close()
    summary = app.summary()
    assert summary["stopped"] and summary["stopped_now"]
    assert app.logs_left() == []
