"""RFC 5424 syslog messages, and the octet-counting framing of RFC 6587 (for TCP and TLS).

`<PRI>1 TIMESTAMP HOSTNAME APP-NAME PROCID MSGID STRUCTURED-DATA MSG`: PRI is facility × 8 +
the alert's syslog severity, TIMESTAMP RFC 3339 in UTC with microseconds, STRUCTURED-DATA `-`
(the alert's fields are in MSG, in the chosen encoding), MSG without a BOM (MSG-ANY).

Invariant: the header fields are what the RFC allows (printable US-ASCII, no spaces, within
their lengths, "-" when empty), whatever the alert holds; MSG is never cut in a frame (TCP's
octet count says its length), and over UDP only where the datagram could not carry it (said).
"""

from __future__ import annotations

import os
import socket
from datetime import UTC, datetime

from kvguard.daemon.sinks import fields
from kvguard.proto.kvguard.v1 import services_pb2 as svc

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
