"""Where forwarded alerts go: each output (syslog over UDP, TCP or TLS; HTTP POST; a file) has
its own bounded queue and its own thread, so one slow or dead output never holds back the
others, nor the reading of the daemon's stream.

Invariants: `offer()` never blocks; when an output's queue is full its OLDEST alert is
dropped and counted, and before the next alert it delivers it sends a synthetic alert
(fields.dropped_notice) saying how many were dropped and which cursors they were, so the
SIEM sees the gap (the daemon's audit log still holds them all). A delivery that fails for a
while (the receiver is down) is retried with a doubling wait, the alert kept at the head of
the queue; one the receiver refuses outright (an HTTP 4xx) is counted as rejected, said, and
skipped. Outputs are made from URLs (`open_output`); a bad URL is a ValueError naming it.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from urllib.parse import parse_qs, urlsplit

from kvguard.daemon.sinks import fields, syslog
from kvguard.daemon.sinks.formats import Format, http_body
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.logs import logger

log = logger("alerts")

DEFAULT_CAPACITY = 10_000  # alerts one output holds while it is slow or down
CONNECT_TIMEOUT_S = 5.0
HTTP_TIMEOUT_S = 10.0
RETRY_FIRST_S, RETRY_CAP_S = 0.25, 5.0
UDP_MAX = 65_507  # the most a UDP datagram over IPv4 carries
SCHEMES = ("syslog+udp", "syslog+tcp", "syslog+tls", "http", "https", "file")
DEFAULT_PORTS = {"syslog+udp": 514, "syslog+tcp": 514, "syslog+tls": 6514}  # RFC 5426, common use, RFC 5425

Log = Callable[[str], None]


def _stderr(line: str) -> None:
    log.warning(line)


class OutputError(Exception):
    """The output cannot deliver now (the receiver is down, refused the connection, timed
    out): the alert is kept and retried."""


class Rejected(Exception):
    """The receiver refused this alert and would refuse it again: it is skipped (counted)."""


class QueuedOutput:
    """An output's bounded queue and the thread that empties it; subclasses `deliver` one
    alert (raising OutputError or Rejected) and `disconnect` after a failure."""

    def __init__(self, name: str, fmt: Format, capacity: int = DEFAULT_CAPACITY, log: Log = _stderr) -> None:
        if capacity < 1:
            raise ValueError(f"{name}: a queue of {capacity} alerts cannot hold any")
        self.name = name
        self.format = fmt
        self.capacity = capacity
        self.log = log
        self.sent = 0  # alerts delivered (drop notices not counted)
        self.dropped = 0  # alerts dropped from a full queue
        self.rejected = 0  # alerts the receiver refused
        self.notices = 0  # drop notices delivered
        self.last_error = ""  # why the last delivery that failed did (cleared by none)
        self.retry_first, self.retry_cap = RETRY_FIRST_S, RETRY_CAP_S
        self._queue: deque[svc.Alert] = deque()
        self._cond = threading.Condition()
        self._unsaid = 0  # dropped since the last notice was delivered
        self._unsaid_cursors = (0, 0)
        self._closing = False
        self._deadline = 0.0
        self._failing = False
        self._offered = 0  # the cursor of the last alert offered
        self._in_flight = 0  # the cursor of the alert being delivered (0: none)
        self._thread = threading.Thread(target=self._run, name=f"kvguard-alerts {name}", daemon=True)

    # ---------------------------------------------------------------- the reader's side

    def start(self) -> None:
        self._thread.start()

    def offer(self, alert: svc.Alert) -> None:
        """Queue `alert`; when the queue is full the oldest one makes room."""
        with self._cond:
            if len(self._queue) >= self.capacity:
                self._drop(self._queue.popleft())
            self._queue.append(alert)
            self._offered = max(self._offered, alert.cursor)
            self._cond.notify()

    def pending(self) -> int:
        with self._cond:
            return len(self._queue)

    def done_cursor(self) -> int:
        """The cursor up to which every alert offered is done with (delivered, rejected or
        dropped and said): `--after` it resumes without a gap (`kvguard alerts --cursor-file`)."""
        with self._cond:
            waiting = [c for c in (self._in_flight, self._queue[0].cursor if self._queue else 0) if c]
            return min(waiting) - 1 if waiting else self._offered

    def close(self, timeout: float) -> int:
        """Deliver what is queued for up to `timeout` seconds, then stop; returns how many
        alerts were left undelivered (said on the log)."""
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic() + timeout
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()
        left = len(self._queue)
        if left or self._unsaid:
            self.log(f"{self.name}: {left} alert(s) undelivered at exit, {self._unsaid} dropped unsaid")
        self.disconnect()
        return left

    # ---------------------------------------------------------------- the output's thread

    def _drop(self, alert: svc.Alert) -> None:
        """Count a dropped alert (under the lock) toward the next notice."""
        self.dropped += 1
        if self._unsaid:
            first, last = self._unsaid_cursors
            self._unsaid_cursors = (min(first, alert.cursor), max(last, alert.cursor))
        else:
            self._unsaid_cursors = (alert.cursor, alert.cursor)
        self._unsaid += 1

    def _next(self) -> tuple[svc.Alert, bool] | None:
        """The next thing to deliver (a drop notice first), or None to stop."""
        with self._cond:
            while not self._queue and not self._unsaid and not self._closing:
                self._cond.wait()
            if self._closing and (time.monotonic() >= self._deadline or not (self._queue or self._unsaid)):
                return None
            if self._unsaid:
                count, (first, last) = self._unsaid, self._unsaid_cursors
                self._unsaid = 0
                return fields.dropped_notice(self.name, count, first, last), True
            alert = self._queue.popleft()
            self._in_flight = alert.cursor
            return alert, False

    def _requeue(self, alert: svc.Alert, notice: bool) -> None:
        """Put back what failed, at the head: it is still the oldest."""
        with self._cond:
            if notice:
                count = int(alert.finding.details["dropped"])
                first = int(alert.finding.details["first_cursor"])
                last = int(alert.finding.details["last_cursor"])
                if self._unsaid:
                    first, last = min(first, self._unsaid_cursors[0]), max(last, self._unsaid_cursors[1])
                self._unsaid += count
                self._unsaid_cursors = (first, last)
                return
            self._queue.appendleft(alert)
            self._in_flight = 0
            if len(self._queue) > self.capacity:
                self._drop(self._queue.popleft())

    def _wait(self, seconds: float) -> None:
        """The wait before a retry; when closing, no longer than the close allows."""
        with self._cond:
            end = time.monotonic() + seconds
            while (left := end - time.monotonic()) > 0:
                if self._closing:
                    left = min(left, self._deadline - time.monotonic())
                    if left <= 0:
                        return
                self._cond.wait(left)

    def _run(self) -> None:
        wait = self.retry_first
        while (item := self._next()) is not None:
            alert, notice = item
            try:
                self.deliver(alert)
            except Rejected as exc:
                self._in_flight = 0
                self.rejected += 1
                self.last_error = f"rejected: {exc}"
                self.log(f"{self.name}: alert {fields.uid(alert)} rejected: {exc}")
                continue
            except OutputError as exc:
                self.last_error = str(exc)
                if not self._failing:
                    self.log(f"{self.name}: {exc}; retrying")
                    self._failing = True
                self.disconnect()
                self._requeue(alert, notice)
                self._wait(wait)
                wait = min(self.retry_cap, wait * 2)
                continue
            if self._failing:
                self.log(f"{self.name}: delivering again")
                self._failing = False
            wait = self.retry_first
            if notice:
                self.notices += 1
                count = alert.finding.details["dropped"]
                self.log(f"{self.name}: {count} alert(s) dropped (queue full: the output was slow or down)")
            else:
                self.sent += 1
                self._in_flight = 0

    def deliver(self, alert: svc.Alert) -> None:  # pragma: no cover - every output has its own
        raise NotImplementedError

    def disconnect(self) -> None:
        """Let go of a connection after a failure or at close (the next delivery reconnects)."""


class FileOutput(QueuedOutput):
    """Appends one alert a line to a file (reopened after a failure: rotation, a full disk)."""

    def __init__(self, path: str, fmt: Format, capacity: int = DEFAULT_CAPACITY, log: Log = _stderr) -> None:
        super().__init__(f"file://{path}", fmt, capacity, log)
        self.path = path
        self._file: object = None

    def deliver(self, alert: svc.Alert) -> None:
        data = (self.format.line(alert) + "\n").encode()
        try:
            if self._file is None:
                self._file = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
            os.write(self._file, data)  # type: ignore[arg-type]
        except OSError as exc:
            raise OutputError(f"cannot append to {self.path}: {exc.strerror}") from None

    def disconnect(self) -> None:
        if self._file is not None:
            os.close(self._file)  # type: ignore[arg-type]
            self._file = None


class SyslogOutput(QueuedOutput):
    """RFC 5424 messages to a syslog receiver: one datagram each over UDP; octet-counted
    frames (RFC 6587) over TCP or TLS."""

    def __init__(
        self,
        url: str,
        transport: str,
        host: str,
        port: int,
        fmt: Format,
        *,
        facility: int,
        tls: ssl.SSLContext | None = None,
        capacity: int = DEFAULT_CAPACITY,
        log: Log = _stderr,
    ) -> None:
        super().__init__(url, fmt, capacity, log)
        self.transport, self.host, self.port = transport, host, port
        self.facility = facility
        self.tls = tls
        self.hostname = socket.gethostname()
        self.procid = os.getpid()
        self._sock: socket.socket | None = None

    def _connect(self) -> socket.socket:
        if self.transport == "udp":
            family = socket.getaddrinfo(self.host, self.port, type=socket.SOCK_DGRAM)[0][0]
            return socket.socket(family, socket.SOCK_DGRAM)
        sock = socket.create_connection((self.host, self.port), timeout=CONNECT_TIMEOUT_S)
        if self.tls is not None:
            sock = self.tls.wrap_socket(sock, server_hostname=self.host)
        return sock

    def deliver(self, alert: svc.Alert) -> None:
        msg = syslog.message(
            alert, self.format.line(alert), facility=self.facility, hostname=self.hostname, procid=self.procid
        )
        if self.transport == "udp" and len(msg) > UDP_MAX:
            raise Rejected(f"{len(msg)} bytes is too large for a UDP datagram (use syslog+tcp)")
        try:
            if self._sock is None:
                self._sock = self._connect()
            if self.transport == "udp":
                self._sock.sendto(msg, (self.host, self.port))
            else:
                self._sock.sendall(syslog.octet_counted(msg))
        except (OSError, ssl.SSLError) as exc:
            raise OutputError(f"cannot send to {self.host}:{self.port}: {exc}") from None

    def disconnect(self) -> None:
        if self._sock is not None:
            if isinstance(self._sock, ssl.SSLSocket):
                # close_notify: the receiver sees an orderly end, not a broken session
                with contextlib.suppress(OSError, ssl.SSLError):
                    self._sock.unwrap()
            self._sock.close()
            self._sock = None


class HttpOutput(QueuedOutput):
    """One JSON POST per alert to an event collector or a webhook; 408, 429 and 5xx are
    retried, any other 4xx rejects the alert."""

    def __init__(
        self,
        url: str,
        fmt: Format,
        *,
        headers: dict[str, str] | None = None,
        tls: ssl.SSLContext | None = None,
        capacity: int = DEFAULT_CAPACITY,
        log: Log = _stderr,
    ) -> None:
        super().__init__(url, fmt, capacity, log)
        self.url = url
        self.headers = {"Content-Type": "application/json", "User-Agent": f"kvguard/{fields.VERSION}"}
        self.headers |= headers or {}
        self.tls = tls

    def deliver(self, alert: svc.Alert) -> None:
        request = urllib.request.Request(self.url, http_body(self.format, alert), self.headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S, context=self.tls) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            if exc.code in (408, 429) or exc.code >= 500:
                raise OutputError(f"HTTP {exc.code} {exc.reason}") from None
            raise Rejected(f"HTTP {exc.code} {exc.reason}") from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise OutputError(f"cannot POST to {self.url}: {reason}") from None


def tls_context(ca: str | None) -> ssl.SSLContext:
    """A client TLS context that verifies the receiver against `ca` (the system's CAs when
    None); an unreadable CA file is a ValueError naming it."""
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"TLS CA {ca}: {exc}") from None


def open_output(
    url: str,
    fmt: Format,
    *,
    ca: str | None = None,
    headers: dict[str, str] | None = None,
    capacity: int = DEFAULT_CAPACITY,
    log: Log = _stderr,
) -> QueuedOutput:
    """The output `url` names (not started): syslog+udp|tcp|tls://host[:port][?facility=NAME]
    (port 514, 514, 6514 when none),
    http(s)://..., file:///path. A URL that names none is a ValueError that says why."""
    parts = urlsplit(url)
    if parts.scheme not in SCHEMES:
        raise ValueError(f"{url}: unknown output (one of {', '.join(s + '://' for s in SCHEMES)})")
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost") or not parts.path:
            raise ValueError(f"{url}: a file output is file:///absolute/path")
        return FileOutput(parts.path, fmt, capacity, log)
    if parts.scheme in ("http", "https"):
        if not parts.hostname:
            raise ValueError(f"{url}: no host")
        tls = tls_context(ca) if parts.scheme == "https" else None
        return HttpOutput(url, fmt, headers=headers, tls=tls, capacity=capacity, log=log)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{url}: the port is not a number from 0 to 65535") from None
    port = port or DEFAULT_PORTS[parts.scheme]
    if not parts.hostname:
        raise ValueError(f"{url}: a syslog output is {parts.scheme}://host[:port]")
    query = parse_qs(parts.query)
    facility_name = query.get("facility", [syslog.DEFAULT_FACILITY])[0]
    if facility_name not in syslog.FACILITIES:
        raise ValueError(f"{url}: facility {facility_name!r} is not one of {', '.join(syslog.FACILITIES)}")
    transport = parts.scheme.removeprefix("syslog+")
    return SyslogOutput(
        url,
        transport,
        parts.hostname,
        port,
        fmt,
        facility=syslog.FACILITIES[facility_name],
        tls=tls_context(ca) if transport == "tls" else None,
        capacity=capacity,
        log=log,
    )
