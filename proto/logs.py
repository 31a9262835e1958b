"""The services' logs: one record per event of note, on stderr, as text or as JSON lines.

Invariant: every line a service logs goes through one handler, written whole, so journald or
a collector sees one record per event; its format and level are set in one place
(`configure`, from --log-format and --log-level) and may change while it runs (a reload).
Text reads "kvguard <component>: <message>"; JSON adds the time, the level and the record's
fields (`log.warning(..., extra=fields(node=...))`) as keys of their own.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any, TextIO

import orjson

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
_COMPONENTS: set[str] = set()


def fields(**values: Any) -> dict[str, Any]:
    """A record's structured fields (`extra=`), keys of their own in the JSON format."""
    return {"kvguard_fields": values}


def _component(record: logging.LogRecord) -> str:
    return record.name.removeprefix("kvguard.")


class TextFormat(logging.Formatter):
    """kvguard <component>: <message>, the way the services have always spoken."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"kvguard {_component(record)}: {record.getMessage()}"
        if record.exc_info:  # kvguard's own failures only: an operator's mistake is said in a line
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormat(logging.Formatter):
    """One JSON object a line: time (RFC 3339, UTC), level, component, message, the fields."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = int(record.created)
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{record.msecs:03.0f}Z",
            "level": record.levelname.lower(),
            "component": _component(record),
            "message": record.getMessage(),
        }
        for key, value in getattr(record, "kvguard_fields", {}).items():
            out.setdefault(key, value)  # a field never hides the record's own keys
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(out, default=str).decode()


class _Stderr(logging.StreamHandler[TextIO]):
    """Writes to whatever sys.stderr is when a record comes (a test may have swapped it)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


_HANDLER = _Stderr()
_HANDLER.setFormatter(TextFormat())
_LEVEL = logging.INFO


def logger(component: str) -> logging.Logger:
    """The logger of a service's component ("daemon", "agent", "alerts"), on the one handler."""
    log = logging.getLogger(f"kvguard.{component}")
    if component not in _COMPONENTS:
        _COMPONENTS.add(component)
        log.addHandler(_HANDLER)
        log.propagate = False  # an engine's own logging config must not print it twice
        log.setLevel(_LEVEL)
    return log


def configure(level: str = "info", fmt: str = "text") -> None:
    """Set every component's level and the one format; ValueError names a bad value."""
    global _LEVEL
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: not one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: not one of {', '.join(FORMATS)}")
    _LEVEL = getattr(logging, level.upper())
    _HANDLER.setFormatter(JsonFormat() if fmt == "json" else TextFormat())
    for component in _COMPONENTS:
        logging.getLogger(f"kvguard.{component}").setLevel(_LEVEL)
