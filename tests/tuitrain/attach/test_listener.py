"""A headless run's socket, fault by fault: who may connect, what a bad or slow or killed
viewer costs the run (nothing), two viewers steering, and the end of a run."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.tuitrain.fakeworker import fake_stats
from tuitrain import listener as listener_module
from tuitrain.attach import open_run
from tuitrain.events import Applied, Failed, Finished, Log, SetPolicy, Started, Step
from tuitrain.metrics import MetricsWriter
from tuitrain.runs import list_runs
from tuitrain.settings import Settings
from tuitrain.socket_client import SocketClient
from tuitrain.wire import encode_command, frame

from .helpers import RawViewer, served_fake, until


def logs(events: list) -> list[str]:
    return [e.message for e in events if isinstance(e, Log)]


def test_the_socket_is_owner_only_and_listed_with_the_run(runtime_dir: Path) -> None:
    served, _ = served_fake()
    try:
        path = Path(served.record.socket)
        assert stat.S_ISSOCK(path.stat().st_mode)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        [record] = list_runs(runtime_dir)
        assert record.live and record.socket == str(path) and record.pid == os.getpid()
    finally:
        served.close()
    [record] = list_runs(runtime_dir)
    assert record.state == "interrupted" and not path.exists()  # no Finished was seen


def test_a_peer_of_another_uid_is_refused_with_one_line(monkeypatch) -> None:
    served, _ = served_fake()
    try:
        # SO_PEERCRED tells the peer's uid; here the run believes itself another user's.
        monkeypatch.setattr(listener_module.os, "getuid", lambda: os.geteuid() + 1)
        viewer = RawViewer(served.record.socket)
        assert viewer.read() is None  # closed before a word was said
        seen: list = []
        until(served, lambda: logs(seen), collect=seen)
        assert logs(seen) == [f"refused a connection from uid {os.geteuid()} (pid "
                              f"{os.getpid()}): only this user may attach"]
        assert served.listener.viewers == 0
    finally:
        served.close()


def test_garbage_on_the_socket_logs_one_line_and_closes_that_connection_only() -> None:
    served, _ = served_fake()
    try:
        good = SocketClient(served.record.socket)
        good.start()
        bad = RawViewer(served.record.socket)
        assert "hello" in bad.read()
        bad.sock.sendall(struct.pack(">I", 7) + b"rm -rf \x00garbage")
        seen: list = []
        until(served, lambda: any("not a command" in m for m in logs(seen)), collect=seen)
        [line] = [m for m in logs(seen) if "not a command" in m]
        assert "its connection was closed" in line
        assert bad.ended()  # a socket timeout (an error) had the run kept it open
        until(served, lambda: any(isinstance(e, Step) for e in good.poll()))  # still served
    finally:
        served.close()


def test_a_viewer_killed_with_kill_9_costs_the_run_nothing() -> None:
    served, _ = served_fake(steps=300)
    try:
        child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import socket, time
            s = socket.socket(socket.AF_UNIX); s.connect({served.record.socket!r})
            print("attached", flush=True); time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "attached"
        until(served, lambda: served.listener.viewers == 1)
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        seen: list = []
        until(served, lambda: served.listener.viewers == 0, collect=seen)
        until(served, lambda: sum(isinstance(e, Step) for e in seen) >= 50, collect=seen)
        assert served.listener.dropped == 0
        assert not [e for e in seen if isinstance(e, Failed)]
    finally:
        served.close()


def test_a_viewer_that_stops_reading_is_dropped_and_counted_never_waited_for(
        monkeypatch) -> None:
    monkeypatch.setattr(listener_module, "QUEUED_FRAMES", 4)
    served, _ = served_fake()
    try:
        stuck = socket.socket(socket.AF_UNIX)
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        stuck.connect(served.record.socket)  # and never reads
        until(served, lambda: served.listener.viewers == 1)
        big = Step(fake_stats(1, n_chunks=2000))  # frames far larger than socket buffers
        for _ in range(50):
            served.listener.publish(big)  # returns at once even so
        assert served.listener.dropped == 1 and served.listener.viewers == 0
        notices = [n.message for n in served.listener.take_notices()]
        assert any("fell 4 events behind and was dropped (1 so far)" in n for n in notices)
        stuck.close()
    finally:
        served.close()


def test_two_viewers_steer_and_each_sees_the_others_change_with_who_made_it() -> None:
    served, fake = served_fake()
    try:
        first, second = SocketClient(served.record.socket), SocketClient(served.record.socket)
        first.start(), second.start()
        asked = first.send(SetPolicy(policy="cpu"))
        mine: list = []
        theirs: list = []
        run: list = []

        def answered() -> bool:
            mine.extend(first.poll())
            theirs.extend(second.poll())
            return any(isinstance(e, Applied) for e in mine) and any(
                isinstance(e, Applied) for e in theirs)

        until(served, answered, collect=run)
        [own] = [e for e in mine if isinstance(e, Applied)]
        [other] = [e for e in theirs if isinstance(e, Applied)]
        assert own.id == asked and own.what == "policy cpu"
        assert other.id == -1 and other.what == f"policy cpu (by {first.name})"
        assert [c.policy for c in fake.commands] == ["cpu"]
        assert f"policy cpu (by {first.name}), from step {own.step}" in logs(run)
        # A third viewer is greeted with the policy now in force.
        assert SocketClient(served.record.socket).hello["settings"]["engine"]["policy"] == "cpu"
    finally:
        served.close()


def test_a_read_only_viewer_sends_nothing() -> None:
    served, fake = served_fake()
    try:
        viewer = SocketClient(served.record.socket, read_only=True)
        viewer.start()
        asked = viewer.send(SetPolicy(policy="cpu"))
        [refused] = viewer.poll()
        assert refused.id == asked and "read-only" in refused.reason
        until(served, lambda: any(isinstance(e, Step) for e in viewer.poll()))
        assert fake.commands == []
    finally:
        served.close()


def test_a_run_that_ends_while_attached_says_how_and_a_vanished_one_is_a_failure() -> None:
    served, fake = served_fake(steps=3)
    viewer = SocketClient(served.record.socket)
    viewer.start()
    fake.emit(Finished(summary={"steps": 3}))
    run: list = []
    until(served, lambda: any(isinstance(e, Finished) for e in run), collect=run)
    served.close()
    until(served, lambda: not viewer.alive)
    seen = viewer.poll()
    assert isinstance(seen[-1], Finished) and seen[-1].summary == {"steps": 3}

    served, _ = served_fake()
    viewer = SocketClient(served.record.socket)
    viewer.start()
    served.listener._server.close()  # the run's process dies: its sockets close, unsaid
    for connection in list(served.listener._viewers):
        connection.close()
    until(served, lambda: not viewer.alive)
    seen = viewer.poll()
    assert isinstance(seen[-1], Failed)
    assert "closed the connection without saying how it ended" in seen[-1].reason
    served.close()


@pytest.mark.parametrize(("stopped", "state"), [(True, "interrupted"), (False, "finished")])
def test_a_run_is_listed_as_it_ended_at_the_step_it_reached(
        runtime_dir: Path, stopped: bool, state: str) -> None:
    served, fake = served_fake(steps=5)
    # Stopped early (Ctrl-C, `attach --stop`), or its last step run.
    fake.emit(Finished(summary={"steps": 5, "last_step": 5, "planned_steps": 3000 if stopped
                                else 5, "stopped": stopped}))
    run: list = []
    until(served, lambda: any(isinstance(e, Finished) for e in run), collect=run)
    served.close()
    [record] = list_runs(runtime_dir)
    assert (record.state, record.step) == (state, 5)


def test_a_command_over_the_limit_is_garbage() -> None:
    served, _ = served_fake()
    try:
        bad = RawViewer(served.record.socket)
        bad.read()
        # The listener may drop the connection once the frame's length is over the limit,
        # before the rest of it is sent: the sender's write then fails, which is not the test.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            bad.sock.sendall(frame({**encode_command(SetPolicy(policy="cpu")),
                                    "pad": "x" * 70_000}))
        seen: list = []
        until(served, lambda: any("not a command" in m for m in logs(seen)), collect=seen)
    finally:
        served.close()


def test_a_viewer_attaching_late_gets_the_steps_before_the_sockets_history_from_metrics(
        tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(listener_module, "HISTORY_EVENTS", 5)
    metrics = tmp_path / "m.jsonl"
    writer = MetricsWriter(metrics)
    writer.write({"settings": Settings(model="tiny").model_dump(mode="json")})
    for step in range(1, 21):
        writer.write(dataclasses.asdict(fake_stats(step)))
    writer.close()
    served, _ = served_fake(settings=Settings(model="tiny", logging={"metrics": str(metrics)}))
    try:
        run: list = []
        until(served, lambda: sum(isinstance(e, Step) for e in run) >= 20, collect=run)
        client, _ = open_run(served.record.id, read_only=True)
        client.start()
        seen: list = []
        deadline = time.monotonic() + 10
        while sum(isinstance(e, Step) for e in seen) < 20 and time.monotonic() < deadline:
            seen.extend(client.poll())
        steps = [e.stats.step for e in seen if isinstance(e, Step)]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 20
        assert isinstance(seen[0], Started)
        client.stop()
    finally:
        served.close()
