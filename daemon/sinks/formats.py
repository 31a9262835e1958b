"""The encodings an alert can be forwarded in, by name (`--format`): each turns an alert into
one line of text, and into the JSON body an HTTP collector takes.

Invariant: a line holds no line break (the file, stdout and syslog outputs write one alert a
line); an HTTP body is always JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvguard.daemon.sinks import cef, jsonl, ocsf
from kvguard.proto.kvguard.v1 import services_pb2 as svc


@dataclass(frozen=True)
class Format:
    name: str
    line: Callable[[svc.Alert], str]
    body: Callable[[svc.Alert], Any]  # the JSON value an HTTP POST carries


FORMATS: dict[str, Format] = {
    "json": Format("json", jsonl.line, jsonl.record),
    "ocsf": Format("ocsf", ocsf.line, ocsf.event),
    "cef": Format("cef", cef.line, lambda alert: {"cef": cef.line(alert)}),
}


def http_body(fmt: Format, alert: svc.Alert) -> bytes:
    return json.dumps(fmt.body(alert), ensure_ascii=False, separators=(",", ":")).encode()
