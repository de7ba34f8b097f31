"""What an attached viewer and a headless run say to each other on the run's Unix socket.

Every message is one frame: four bytes of length (big-endian), then that many bytes of
UTF-8 JSON. Only JSON crosses the socket, never pickle: a peer's bytes are data, so the
worst a bad frame can do is be refused. Events travel as `{"event": NAME, "data":
dataclasses.asdict(event)}` (a step as the metrics file writes it, see tuitrain.metrics);
commands as `{"command": NAME, "id": N, ...its fields}`.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import struct

from engine.telemetry import ChunkInfo, stats_from_dict
from tuitrain import events as ev

HEADER = struct.Struct(">I")
MAX_COMMAND_BYTES = 64 * 1024  # a command is a few dozen bytes; more is not a viewer talking
MAX_EVENT_BYTES = 256 * 1024 * 1024  # a step of a big model, chunk list and timeline included

# What a viewer may ask: the app's own commands, each field with the JSON types it takes.
COMMANDS: dict[str, tuple[type[ev.Command], dict[str, tuple[type, ...]]]] = {
    "SetPolicy": (ev.SetPolicy, {"policy": (str,)}),
    "SetMargin": (ev.SetMargin, {"margin_ratio": (int, float)}),
    "SetBudget": (ev.SetBudget, {"device_budget": (int, str)}),
    "SetShape": (ev.SetShape, {"batch_size": (int,), "grad_accum": (int,),
                               "activation_checkpointing": (bool,)}),
    "Pause": (ev.Pause, {}),
    "Resume": (ev.Resume, {}),
    "Checkpoint": (ev.Checkpoint, {}),
    "Stop": (ev.Stop, {}),
}
EVENTS: dict[str, type[ev.Event]] = {
    cls.__name__: cls
    for cls in (ev.Started, ev.Step, ev.RankStep, ev.Log, ev.Applied, ev.Rejected, ev.Failed,
                ev.Finished, ev.Eval)
}


class WireError(ValueError):
    """A frame that is not what the protocol says (garbage, or too long)."""


def frame(message: dict) -> bytes:
    body = json.dumps(message, separators=(",", ":")).encode("utf-8")
    return HEADER.pack(len(body)) + body


def read_frame(sock: socket.socket, *, limit: int) -> dict | None:
    """The next message on `sock`; None at a clean end of stream (between frames).

    Raises:
        WireError: a length over `limit`, a stream cut inside a frame, or a body that is not
            a JSON object.
        OSError: the socket failed (a reset, a timeout).
    """
    head = _read_exactly(sock, HEADER.size, at_start=True)
    if head is None:
        return None
    (length,) = HEADER.unpack(head)
    if length > limit:
        raise WireError(f"a frame of {length} bytes (at most {limit})")
    body = _read_exactly(sock, length, at_start=False) or b""
    try:
        message = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise WireError(f"not JSON: {error}") from None
    if not isinstance(message, dict):
        raise WireError("not a JSON object")
    return message


def _read_exactly(sock: socket.socket, n: int, *, at_start: bool) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        piece = sock.recv(n - len(data))
        if not piece:
            if at_start and not data:
                return None
            raise WireError("the stream ended inside a frame")
        data += piece
    return bytes(data)


# --- commands ----------------------------------------------------------------------------


def encode_command(command: ev.Command) -> dict:
    return {"command": type(command).__name__, **dataclasses.asdict(command)}


def decode_command(message: dict) -> ev.Command:
    """The command a viewer sent, built only from the names and types COMMANDS allows.

    Raises:
        WireError: an unknown command, an unknown field, or a value of the wrong type.
    """
    name = message.get("command")
    if name not in COMMANDS:
        raise WireError(f"unknown command {str(name)[:40]!r}")
    cls, allowed = COMMANDS[name]
    fields = {k: v for k, v in message.items() if k != "command"}
    command_id = fields.pop("id", -1)
    if type(command_id) is not int:
        raise WireError("a command id is an integer")
    for key, value in fields.items():
        kinds = allowed.get(key)
        if kinds is None:
            raise WireError(f"{name} has no field {key[:40]!r}")
        if type(value) not in kinds:  # bool is not an int here
            raise WireError(f"{name}.{key} cannot be {type(value).__name__}")
    return cls(id=command_id, **fields)


# --- events ------------------------------------------------------------------------------


def encode_event(event: ev.Event) -> dict:
    return {"event": type(event).__name__, "data": dataclasses.asdict(event)}


def decode_event(message: dict) -> ev.Event:
    """Inverse of encode_event. Raises WireError for what is not an event of EVENTS."""
    cls = EVENTS.get(str(message.get("event")))
    data = message.get("data")
    if cls is None or not isinstance(data, dict):
        raise WireError(f"unknown event {str(message.get('event'))[:40]!r}")
    data = dict(data)
    try:
        if cls in (ev.Step, ev.RankStep):
            data["stats"] = stats_from_dict(data["stats"])
        elif cls is ev.Started:
            data["chunks"] = [ChunkInfo(**c) for c in data["chunks"]]
        return cls(**data)
    except (KeyError, TypeError) as error:
        raise WireError(f"a malformed {cls.__name__}: {error}") from None
