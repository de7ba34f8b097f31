"""The wire between a headless run and its viewers: JSON frames, events back as they were,
and commands built only from what a viewer may ask."""

from __future__ import annotations

import socket
import struct

import pytest

from tests.tuitrain.fakeworker import fake_started, fake_stats
from tuitrain.events import Applied, Eval, Finished, SetBudget, SetMargin, SetPolicy, Step, Stop
from tuitrain.wire import (
    WireError,
    decode_command,
    decode_event,
    encode_command,
    encode_event,
    frame,
    read_frame,
)


@pytest.mark.parametrize(
    "event",
    [
        fake_started(model="tiny", settings={"model": "tiny"}),
        Step(fake_stats(3, policy="cpu"), time=12.5),
        Applied(4, 7, "policy cpu"),
        Eval(step=5, loss=2.0, perplexity=7.39, tokens=512, seconds=0.5),
        Finished(summary={"steps": 5, "stopped": False}),
    ],
)
def test_an_event_comes_back_equal_to_what_was_sent(event) -> None:
    assert decode_event(encode_event(event)) == event


@pytest.mark.parametrize(
    "command",
    [SetPolicy(id=3, policy="cpu"), SetMargin(id=4, margin_ratio=0.25),
     SetBudget(id=5, device_budget="4GiB"), Stop(id=6)],
)
def test_a_command_comes_back_equal_to_what_was_sent(command) -> None:
    assert decode_command(encode_command(command)) == command


@pytest.mark.parametrize(
    ("message", "why"),
    [
        ({"command": "__import__", "id": 1}, "unknown command"),
        ({"command": "SetPolicy", "id": 1, "policy": ["cpu"]}, "cannot be list"),
        ({"command": "SetMargin", "id": 1, "margin_ratio": True}, "cannot be bool"),
        ({"command": "Pause", "id": 1, "then": "exec"}, "has no field"),
        ({"command": "Pause", "id": "1"}, "id is an integer"),
    ],
)
def test_a_command_a_viewer_may_not_send_is_refused(message: dict, why: str) -> None:
    with pytest.raises(WireError, match=why):
        decode_command(message)


def test_frames_that_are_not_json_objects_or_too_long_are_refused() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(frame({"ok": 1}) + struct.pack(">I", 3) + b"[1]")
        assert read_frame(b, limit=100) == {"ok": 1}
        with pytest.raises(WireError, match="not a JSON object"):
            read_frame(b, limit=100)
        a.sendall(struct.pack(">I", 10_000))
        with pytest.raises(WireError, match="10000 bytes"):
            read_frame(b, limit=100)
        a.sendall(struct.pack(">I", 5) + b"\xff\xfe{}x")
        with pytest.raises(WireError, match="not JSON"):
            read_frame(b, limit=100)
        a.close()
        assert read_frame(b, limit=100) is None  # a clean end between frames
