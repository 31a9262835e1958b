"""The file output (`file:///PATH`): one alert a line, appended.

Invariant: a line is written whole by one write() to a file opened O_APPEND, so lines of
several writers never interleave; the file is reopened after a failure (rotated away, a full
disk), so logrotate's move-and-create needs no signal.
"""

from __future__ import annotations

import os
from urllib.parse import urlsplit

from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.sinks.output import DEFAULT_CAPACITY, Log, Options, OutputError, QueuedOutput, _stderr
from kvguard.sinks.registry import Format


class FileOutput(QueuedOutput):
    """Appends one alert a line to a file."""

    def __init__(self, path: str, fmt: Format, capacity: int = DEFAULT_CAPACITY, log: Log = _stderr) -> None:
        super().__init__(f"file://{path}", fmt, capacity, log)
        self.path = path
        self._fd: int | None = None

    def deliver(self, alert: svc.Alert) -> None:
        data = (self.format.line(alert) + "\n").encode()
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            os.write(self._fd, data)
        except OSError as exc:
            raise OutputError(f"cannot append to {self.path}: {exc.strerror}") from None

    def disconnect(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def open_output(url: str, fmt: Format, options: Options) -> FileOutput:
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost") or not parts.path:
        raise ValueError(f"{url}: a file output is file:///absolute/path")
    return FileOutput(parts.path, fmt, options.capacity, options.log)
