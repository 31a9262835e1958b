"""The encodings and transports the alert feed has, by name: the one place a new one is
registered (docs/outputs.md is the checklist for adding one).

Invariants: a name maps to the module that implements it (an encoding's module has `line` and
`body`; a transport's has `open_output`), imported only when it is used, so building
`kvguard`'s parser costs no protobuf or socket import. A URL whose scheme is not registered is
a ValueError naming it and the schemes there are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from kvguard.proto.kvguard.v1 import services_pb2 as svc
    from kvguard.sinks.output import Options, QueuedOutput


@dataclass(frozen=True)
class Plugin:
    module: str  # the module that implements it
    summary: str  # what it is, in --help and docs/operator.md


FORMATS: dict[str, Plugin] = {
    "json": Plugin("kvguard.sinks.jsonl", "one JSON object a line, kvguard's own fields"),
    "ocsf": Plugin("kvguard.sinks.ocsf", "OCSF Detection Finding (class 2004), one a line"),
    "cef": Plugin("kvguard.sinks.cef", "ArcSight CEF, one a line"),
}

TRANSPORTS: dict[str, Plugin] = {
    "syslog+udp": Plugin("kvguard.sinks.syslog", "RFC 5424 in one datagram each, port 514 when none"),
    "syslog+tcp": Plugin("kvguard.sinks.syslog", "RFC 5424 octet-counted (RFC 6587), port 514 when none"),
    "syslog+tls": Plugin("kvguard.sinks.syslog", "RFC 5424 over TLS (RFC 5425), port 6514 when none"),
    "http": Plugin("kvguard.sinks.http", "one JSON POST per alert (a webhook, an event collector)"),
    "https": Plugin("kvguard.sinks.http", "the same over TLS, verified against --to-ca"),
    "file": Plugin("kvguard.sinks.file", "one alert a line appended to file:///PATH"),
}


@dataclass(frozen=True)
class Format:
    """An encoding, loaded: an alert as one line of text (no line break in it), and as the JSON
    value an HTTP POST carries."""

    name: str
    line: Callable[[svc.Alert], str]
    body: Callable[[svc.Alert], Any]


def format_named(name: str) -> Format:
    """The encoding registered as `name` (a KeyError for one that is not: argparse's choices
    keep those out)."""
    module = import_module(FORMATS[name].module)
    return Format(name, module.line, module.body)


def open_output(url: str, fmt: Format, options: Options | None = None) -> QueuedOutput:
    """The output `url` names, not yet started; a URL that names none is a ValueError that
    says why."""
    from kvguard.sinks.output import Options

    scheme = urlsplit(url).scheme
    if scheme not in TRANSPORTS:
        raise ValueError(f"{url}: unknown output (one of {', '.join(s + '://' for s in TRANSPORTS)})")
    module = import_module(TRANSPORTS[scheme].module)
    output: QueuedOutput = module.open_output(url, fmt, options or Options())
    return output
