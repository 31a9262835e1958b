"""The services' logs: one record per event of note, on stderr, as text or as JSON lines.

Invariant: every record a service logs goes through one handler and is one line, written
whole (a line break inside a message or a traceback is written `\\n`), so journald or a
collector sees one record per event; its format and level are set in one place (`configure`,
from --log-format and --log-level) and may change while it runs (a reload).
Text reads "<time> <level> kvguard <component>: <message>"; under journald (stderr is the
stream $JOURNAL_STREAM names) it reads "<N>kvguard <component>: <message>", N the syslog
priority (sd-daemon(3)), so that `journalctl -p warning` selects by level and journald adds
the time. JSON adds the time, the level and the record's fields (`log.warning(...,
extra=fields(node=..., peer=...))`) as keys of their own.
"""

from __future__ import annotations

import logging
import os
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


# syslog priorities (sd-daemon(3): <3> SD_ERR, <4> SD_WARNING, <6> SD_INFO, <7> SD_DEBUG)
PRIORITIES = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}


def _component(record: logging.LogRecord) -> str:
    return record.name.removeprefix("kvguard.")


def _stamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(int(record.created))) + f".{record.msecs:03.0f}Z"


def under_journald(stream: TextIO | None = None) -> bool:
    """Whether `stream` (stderr) is the journal's: $JOURNAL_STREAM names its device and inode."""
    expected = os.environ.get("JOURNAL_STREAM", "")
    if not expected:
        return False
    try:
        st = os.fstat((stream or sys.stderr).fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return expected == f"{st.st_dev}:{st.st_ino}"


class TextFormat(logging.Formatter):
    """<time> <level> kvguard <component>: <message>; under journald <N> for the time and level."""

    def __init__(self, journald: bool = False) -> None:
        super().__init__()
        self.journald = journald

    def format(self, record: logging.LogRecord) -> str:
        text = f"kvguard {_component(record)}: {record.getMessage()}"
        if record.exc_info:  # kvguard's own failures only: an operator's mistake is said in a line
            text += "\n" + self.formatException(record.exc_info)
        text = text.replace("\r", "").replace("\n", "\\n")  # one record, one line
        if self.journald:
            return f"<{PRIORITIES.get(record.levelno, 6)}>{text}"
        return f"{_stamp(record)} {record.levelname.lower():7} {text}"


class JsonFormat(logging.Formatter):
    """One JSON object a line: time (RFC 3339, UTC), level, component, message, the fields."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": _stamp(record),
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
_HANDLER.setFormatter(TextFormat(under_journald()))
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
    _HANDLER.setFormatter(JsonFormat() if fmt == "json" else TextFormat(under_journald()))
    for component in _COMPONENTS:
        logging.getLogger(f"kvguard.{component}").setLevel(_LEVEL)
