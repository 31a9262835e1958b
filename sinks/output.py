"""What every output of the alert feed is: a bounded queue and the thread that empties it
into one receiver (the transports, registered in sinks/registry.py, each add `deliver`), so one
slow or dead output never holds back the others, nor the reading of the daemon's stream.

Invariants: `offer()` never blocks; when an output's queue is full its OLDEST alert is
dropped and counted, and before the next alert it delivers it sends a synthetic alert
(fields.dropped_notice) saying how many were dropped and which cursors they were, so the
SIEM sees the gap (the daemon's audit log still holds them all). A delivery that fails for a
while (the receiver is down) is retried with a doubling wait, the alert kept at the head of
the queue; one the receiver refuses outright (an HTTP 4xx) is counted as rejected, said, and
skipped.
"""

from __future__ import annotations

import ssl
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.logs import logger
from kvguard.sinks import fields
from kvguard.sinks.registry import Format

log = logger("alerts")

DEFAULT_CAPACITY = 10_000  # alerts one output holds while it is slow or down
RETRY_FIRST_S, RETRY_CAP_S = 0.25, 5.0

Log = Callable[[str], None]


def _stderr(line: str) -> None:
    log.warning(line)


@dataclass(frozen=True)
class Options:
    """What `kvguard alerts` gives every output it opens; a transport takes what it uses."""

    capacity: int = DEFAULT_CAPACITY  # alerts the queue holds while the receiver is slow or down
    ca: str | None = None  # the CA that signs a TLS receiver (None: the system's)
    headers: dict[str, str] = field(default_factory=dict)  # HTTP headers
    log: Log = _stderr  # where the output says what goes wrong


def tls_context(ca: str | None) -> ssl.SSLContext:
    """A client TLS context that verifies the receiver against `ca` (the system's CAs when
    None); an unreadable CA file is a ValueError naming it."""
    try:
        return ssl.create_default_context(cafile=ca)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"TLS CA {ca}: {exc}") from None


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
