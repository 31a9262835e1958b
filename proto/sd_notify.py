"""systemd's service notifications (sd_notify(3)) without libsystemd: READY=1, STATUS=,
RELOADING=1 (with MONOTONIC_USEC=, as systemd 253 and later want), STOPPING=1 and WATCHDOG=1,
each a datagram to the AF_UNIX socket named by $NOTIFY_SOCKET (a path, or `@name` for an
abstract one); and the watchdog's interval, from $WATCHDOG_USEC (for this process only when
$WATCHDOG_PID names it). It lives in proto/, the wire and local-socket layer, because both the
daemon and the agent use it and proto/ is the one part both may import.

Invariants: without $NOTIFY_SOCKET every call is a no-op; a notification that cannot be sent
(the socket gone, systemd restarting) is counted and said once, never raised, so that
telling systemd never stops a service. The `Watchdog` pings only while the loop it guards
advances its heartbeat: a loop stuck longer than the watchdog's interval stops the pings, and
systemd then restarts the service.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

from kvguard.proto.logs import logger


class Notifier:
    """Notifications to the service manager named by `environ` (default: this process's)."""

    def __init__(self, environ: Mapping[str, str] | None = None, component: str = "daemon") -> None:
        env = os.environ if environ is None else environ
        self.log = logger(component)  # who says it, in the one line written when a send fails
        path = env.get("NOTIFY_SOCKET", "")
        # An abstract socket's name starts with a NUL byte; systemd writes it as "@".
        self.address: str | bytes | None = path or None
        if path.startswith("@"):
            self.address = ("\0" + path[1:]).encode()
        self.watchdog_s: float | None = _watchdog_seconds(env)
        self.sent = 0
        self.failed = 0
        self._lock = threading.Lock()
        self._socket: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *fields: str) -> bool:
        """Send `fields` (each NAME=VALUE) as one notification; False when not sent."""
        if self.address is None:
            return False
        data = "\n".join(field.replace("\n", " ") for field in fields).encode()
        with self._lock:  # one socket, shared by the watchdog's thread and the main one
            try:
                if self._socket is None:
                    self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
                self._socket.sendto(data, self.address)
            except OSError as exc:
                self.failed += 1
                if self.failed == 1:
                    self.log.warning(
                        f"cannot notify systemd at NOTIFY_SOCKET={_shown(self.address)}: {exc} "
                        "(counted; said once)"
                    )
                return False
            self.sent += 1
            return True

    def ready(self, status: str = "") -> bool:
        return self.notify("READY=1", *_status(status))

    def status(self, status: str) -> bool:
        return self.notify(f"STATUS={status}")

    def reloading(self, status: str = "") -> bool:
        # systemd ≥ 253 matches a reload's end (READY=1) to its start by this clock reading.
        usec = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
        return self.notify("RELOADING=1", f"MONOTONIC_USEC={usec}", *_status(status))

    def stopping(self, status: str = "") -> bool:
        return self.notify("STOPPING=1", *_status(status))

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        with self._lock:
            if self._socket is not None:
                self._socket.close()
                self._socket = None


def _status(text: str) -> tuple[str, ...]:
    return (f"STATUS={text}",) if text else ()


def _watchdog_seconds(env: Mapping[str, str]) -> float | None:
    """The watchdog's interval for this process, in seconds; None when there is none."""
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None  # meant for another process (the one that started this one)
    return int(usec) / 1e6


def _shown(address: str | bytes) -> str:
    return "@" + address[1:].decode(errors="replace") if isinstance(address, bytes) else address


class Watchdog:
    """A thread that sends WATCHDOG=1 every half interval while `heartbeat()` (the monotonic
    time the guarded loop last went round) is younger than the interval; withheld pings are
    counted (`withheld`) and the first of a run is said on stderr."""

    def __init__(self, notifier: Notifier, heartbeat: Callable[[], float], what: str = "the loop") -> None:
        if notifier.watchdog_s is None:
            raise ValueError("no watchdog: WATCHDOG_USEC is not set for this process")
        self.notifier = notifier
        self.interval = notifier.watchdog_s
        self.heartbeat = heartbeat
        self.what = what
        self.pinged = 0
        self.withheld = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvguard-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def _run(self) -> None:
        stuck = False
        while not self._stop.wait(self.interval / 2):
            silent = time.monotonic() - self.heartbeat()
            if silent < self.interval:
                if self.notifier.watchdog():
                    self.pinged += 1
                if stuck:
                    self.notifier.log.info(f"{self.what} goes round again")
                stuck = False
                continue
            self.withheld += 1
            if not stuck:
                self.notifier.log.error(
                    f"{self.what} has not gone round for {silent:.1f} s: watchdog pings withheld "
                    "(systemd restarts the service once its WatchdogSec passes)"
                )
            stuck = True

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
