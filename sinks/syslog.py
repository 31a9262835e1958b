"""The syslog outputs (`syslog+udp://`, `syslog+tcp://`, `syslog+tls://`): RFC 5424 messages,
one datagram each over UDP, octet-counted frames (RFC 6587) over TCP and TLS (RFC 5425).

`<PRI>1 TIMESTAMP HOSTNAME APP-NAME PROCID MSGID STRUCTURED-DATA MSG`: PRI is facility × 8 +
the alert's syslog severity, TIMESTAMP RFC 3339 in UTC with microseconds, STRUCTURED-DATA `-`
(the alert's fields are in MSG, in the chosen encoding), MSG without a BOM (MSG-ANY).

Invariant: the header fields are what the RFC allows (printable US-ASCII, no spaces, within
their lengths, "-" when empty), whatever the alert holds; MSG is never cut in a frame (TCP's
octet count says its length), and over UDP only where the datagram could not carry it (said).
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
from datetime import UTC, datetime
from urllib.parse import parse_qs, urlsplit

from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.sinks import fields
from kvguard.sinks.output import (
    DEFAULT_CAPACITY,
    Log,
    Options,
    OutputError,
    QueuedOutput,
    Rejected,
    _stderr,
    tls_context,
)
from kvguard.sinks.registry import Format

FACILITIES = {
    "kern": 0, "user": 1, "mail": 2, "daemon": 3, "auth": 4, "syslog": 5, "lpr": 6, "news": 7,
    "uucp": 8, "cron": 9, "authpriv": 10, "ftp": 11, "ntp": 12, "audit": 13, "alert": 14,
    "clock": 15, "local0": 16, "local1": 17, "local2": 18, "local3": 19, "local4": 20,
    "local5": 21, "local6": 22, "local7": 23,
}  # fmt: skip
DEFAULT_FACILITY = "local0"
# syslog severities: 2 Critical, 3 Error, 4 Warning, 5 Notice, 6 Informational
SEVERITIES = {"critical": 2, "high": 3, "medium": 4, "low": 5, "info": 6}
UNKNOWN_SEVERITY = 5
APP_NAME = "kvguard"
MAX_HOSTNAME, MAX_APP_NAME, MAX_PROCID, MAX_MSGID = 255, 48, 128, 32
DEFAULT_PORTS = {"udp": 514, "tcp": 514, "tls": 6514}  # RFC 5426, common use, RFC 5425
UDP_MAX = 65_507  # the most a UDP datagram over IPv4 carries
CONNECT_TIMEOUT_S = 5.0


def header_token(text: str, limit: int) -> str:
    """A header field as RFC 5424 allows it: PRINTUSASCII (33-126) only, at most `limit`
    characters, "-" (NILVALUE) when empty."""
    token = "".join(c if 33 <= ord(c) <= 126 else "_" for c in text)[:limit]
    return token or "-"


def timestamp(ts_ns: int) -> str:
    """RFC 3339 in UTC with a fraction of at most six digits (TIME-SECFRAC)."""
    seconds, ns = divmod(ts_ns, 1_000_000_000)
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S") + f".{ns // 1000:06d}Z"


def priority(facility: int, alert: svc.Alert) -> int:
    return facility * 8 + SEVERITIES.get(alert.finding.severity, UNKNOWN_SEVERITY)


def message(
    alert: svc.Alert,
    msg: str,
    *,
    facility: int = FACILITIES[DEFAULT_FACILITY],
    hostname: str | None = None,
    procid: int | None = None,
) -> bytes:
    """The RFC 5424 message that carries `msg` (an encoded alert); MSGID is the finding kind."""
    header = " ".join(
        (
            f"<{priority(facility, alert)}>1",
            timestamp(fields.time_ns(alert)),
            header_token(hostname if hostname is not None else socket.gethostname(), MAX_HOSTNAME),
            header_token(APP_NAME, MAX_APP_NAME),
            header_token(str(procid if procid is not None else os.getpid()), MAX_PROCID),
            header_token(alert.finding.finding, MAX_MSGID),
            "-",
        )
    )
    return f"{header} {msg}".encode()


def octet_counted(frame: bytes) -> bytes:
    """RFC 6587 octet counting: `MSG-LEN SP SYSLOG-MSG`, for a stream (TCP, TLS)."""
    return str(len(frame)).encode() + b" " + frame


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
        msg = message(
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
                self._sock.sendall(octet_counted(msg))
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


def open_output(url: str, fmt: Format, options: Options) -> SyslogOutput:
    """syslog+udp|tcp|tls://host[:port][?facility=NAME] (local0 when none)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{url}: the port is not a number from 0 to 65535") from None
    transport = parts.scheme.removeprefix("syslog+")
    if not parts.hostname:
        raise ValueError(f"{url}: a syslog output is {parts.scheme}://host[:port]")
    facility_name = parse_qs(parts.query).get("facility", [DEFAULT_FACILITY])[0]
    if facility_name not in FACILITIES:
        raise ValueError(f"{url}: facility {facility_name!r} is not one of {', '.join(FACILITIES)}")
    return SyslogOutput(
        url,
        transport,
        parts.hostname,
        port or DEFAULT_PORTS[transport],
        fmt,
        facility=FACILITIES[facility_name],
        tls=tls_context(options.ca) if transport == "tls" else None,
        capacity=options.capacity,
        log=options.log,
    )
