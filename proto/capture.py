"""JSON Lines captures of kvguard.v1 events (docs/integrator.md, "The event contract": captures).

One event a line, in the protobuf JSON mapping of `kvguard.v1.Event` with proto field names;
integers may be numbers or strings; blank lines and lines starting with `#` are ignored.
Invariant: every other line yields exactly one Event or one CaptureError that names its
line number and the reason, so a reader can report a bad line and go on with the rest.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import orjson
from google.protobuf import json_format
from google.protobuf.message import Message

from kvguard.proto import pb

PAYLOADS: frozenset[str] = frozenset(f.name for f in pb.Event.DESCRIPTOR.oneofs_by_name["payload"].fields)
_ENVELOPE = frozenset({"node", "seq", "ts_ns", "tsNs"})


@dataclass(frozen=True, slots=True)
class CaptureError:
    """A line that is not a usable event."""

    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


def parse_event(text: str | bytes) -> pb.Event:
    """One capture line to an Event; ValueError with a readable reason if it is not one."""
    try:
        obj = orjson.loads(text)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    payloads = [key for key in obj if key in PAYLOADS]
    if len(payloads) != 1:
        unknown = sorted(k for k in obj if k not in PAYLOADS and k not in _ENVELOPE)
        if unknown:
            raise ValueError(f"unknown payload or field {', '.join(map(repr, unknown))}")
        if not payloads:
            raise ValueError(f"no payload (one of: {', '.join(sorted(PAYLOADS))})")
        raise ValueError(f"more than one payload: {', '.join(payloads)}")
    try:
        # Fast path: the C message constructor takes the nested dicts as they are.
        return pb.Event(**obj)
    except (TypeError, ValueError):
        pass
    try:
        # Exact JSON mapping (integers as strings, camelCase names) and its error messages.
        return json_format.ParseDict(obj, pb.Event())
    except json_format.ParseError as exc:
        raise ValueError(str(exc).replace('Message type "kvguard.v1.', 'message "')) from None


def read_capture(lines: Iterable[str | bytes]) -> Iterator[tuple[int, pb.Event | CaptureError]]:
    """(line number, Event or CaptureError) for every line that is not blank or a comment."""
    for number, line in enumerate(lines, 1):
        stripped = line.strip()
        if not stripped or stripped[:1] in ("#", b"#"):
            continue
        try:
            yield number, parse_event(stripped)
        except ValueError as exc:
            yield number, CaptureError(number, str(exc))


def message_to_dict(message: Message) -> dict[str, Any]:
    """A message as the JSON mapping with proto field names, fields left at their default
    omitted, and 64-bit integers as JSON numbers (which the contract allows) rather than the
    strings of json_format, so that captures stay readable."""
    out: dict[str, Any] = {}
    for fd, value in message.ListFields():
        if fd.message_type is not None and fd.message_type.GetOptions().map_entry:
            out[fd.name] = dict(value)
        elif fd.message_type is not None:
            out[fd.name] = [message_to_dict(v) for v in value] if fd.is_repeated else message_to_dict(value)
        elif fd.type == fd.TYPE_BYTES:  # as the protobuf JSON mapping has them: base64
            out[fd.name] = [_b64(v) for v in value] if fd.is_repeated else _b64(value)
        else:
            out[fd.name] = list(value) if fd.is_repeated else value
    return out


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def event_to_json(event: pb.Event) -> str:
    """The capture form of one event (one line)."""
    return orjson.dumps(message_to_dict(event)).decode()
