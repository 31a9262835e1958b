"""The forwarder `kvguard alerts` runs: the daemon's alerts read (what the audit log holds, or
followed live) and handed to each output, or to stdout; its cursor kept; its metrics.

Invariants: with `follow` the stream is opened again after the last cursor received whenever
it breaks (the daemon restarts, the network), so no alert is missed or repeated; a finding
stored as a repeat of another is never sent (daemon/repeats.py), live or from the log. The
cursor file holds the cursor up to which every output is done (delivered, rejected, or dropped
and said), replaced whole. At the end each output drains for a bounded time and what any lost
is said per output, with the exit status 1.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvguard.proto.client import Backoff, DaemonClient, DaemonError, Unreachable
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.sinks.output import QueuedOutput
from kvguard.sinks.registry import Format

PAGE = 1000  # audit records one query reads (without follow)

Emit = Callable[[svc.Alert], None]
Say = Callable[[str], None]


def dump(client: DaemonClient, f: Filter, emit: Emit) -> int:
    """What the audit log holds after f.after, a page at a time, as the live stream sends it
    (a finding that repeats one is not sent); the last cursor read."""
    after = f.after
    while True:
        records = client.query(replace(f, kind="finding", after=after, limit=PAGE))
        for record in records:
            if "repeat" not in record.finding.details:  # stored, never alerted (daemon/repeats.py)
                emit(svc.Alert(cursor=record.id, finding=record.finding))
            after = record.id
        if len(records) < PAGE:
            return after


def follow(client: DaemonClient, f: Filter, emit: Emit, say: Say) -> None:
    """The live stream from f.after on, opened again after the last cursor received whenever
    it breaks; returns only by an exception (KeyboardInterrupt, a refusal by the daemon)."""
    backoff = Backoff(first=0.25, cap=5.0)
    cursor = f.after
    down = False
    while True:
        try:
            cancel, alerts = client.subscribe(replace(f, after=cursor))
            try:
                for alert in alerts:
                    if down:
                        say(f"following {client.address} again, after cursor {cursor}")
                        down = False
                    emit(alert)
                    cursor = alert.cursor
                    backoff.succeeded()
            finally:
                cancel()
            raise Unreachable("AlertService.Subscribe", "ENDED", "")
        except Unreachable as exc:
            if not down:
                say(f"{client.address}: {exc}; resuming after cursor {cursor} when it is back")
                down = True
            client.reset()
            time.sleep(backoff.failed())


class CursorFile:
    """Where a forwarder keeps its cursor across restarts: one number, replaced whole (a file
    written beside it, then renamed), so a crash leaves the old cursor or the new, never half."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self._saved, self._at = -1, 0.0

    def load(self) -> int:
        """The cursor kept, 0 when there is no file yet; ValueError naming the file otherwise."""
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise ValueError(f"--cursor-file {self.path}: {exc.strerror}") from None
        if not text.isdigit():
            raise ValueError(f"--cursor-file {self.path}: holds {text[:40]!r}, not a cursor")
        return int(text)

    def save(self, cursor: int, *, now: bool = False) -> None:
        """Keep `cursor` (at most once a second unless `now`)."""
        if cursor == self._saved or (not now and time.monotonic() - self._at < 1.0):
            return
        spare = self.path.with_name(f".{self.path.name}.new")
        spare.write_text(f"{cursor}\n")
        os.replace(spare, self.path)
        self._saved, self._at = cursor, time.monotonic()


@dataclass
class Forwarder:
    """One run of the feed: `outputs` (stdout in `fmt` when none) fed from `client` after
    `filter.after`."""

    client: DaemonClient
    filter: Filter
    fmt: Format
    outputs: list[QueuedOutput] = field(default_factory=list)
    cursor_file: CursorFile | None = None
    say: Say = print
    last: int = 0  # the cursor of the last alert forwarded

    def __post_init__(self) -> None:
        self.last = self.filter.after

    def done(self) -> int:
        """Every alert up to this cursor is done with (stdout is written at once)."""
        return min((o.done_cursor() for o in self.outputs), default=self.last) if self.outputs else self.last

    def emit(self, alert: svc.Alert) -> None:
        if self.outputs:
            for output in self.outputs:
                output.offer(alert)
        else:
            sys.stdout.write(self.fmt.line(alert) + "\n")
            sys.stdout.flush()  # a pipe's reader sees each alert as it comes
        self.last = alert.cursor
        if self.cursor_file is not None:
            self.cursor_file.save(self.done())

    def run(self, *, live: bool, drain: float) -> int:
        """Forward until the log's end (or, `live`, until SIGTERM or Ctrl-C), then drain; the
        exit status: 0 all delivered, 1 an output lost some, 2 the daemon refused or (not
        `live`) could not be reached."""
        signal.signal(signal.SIGTERM, _terminate)
        for output in self.outputs:
            output.start()
        rc = 0
        try:
            if live:
                follow(self.client, self.filter, self.emit, self.say)
            else:
                dump(self.client, self.filter, self.emit)
        except KeyboardInterrupt:
            if live:  # where a forwarder started again picks up without a gap
                self.say(f"stopped after cursor {self.last} (--after {self.last} resumes there)")
        except DaemonError as exc:
            self.say(f"{self.client.address}: {exc}")
            rc = 2
        finally:
            self.client.close()
            rc = close_outputs(self.outputs, drain, rc, self.say)
            if self.cursor_file is not None:
                self.cursor_file.save(self.done(), now=True)
        return rc


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops it as Ctrl-C does: outputs drain, then it exits


def close_outputs(outputs: list[QueuedOutput], drain: float, rc: int, say: Say) -> int:
    """Let each output deliver what it holds for up to `drain` seconds, then say, per output,
    what it lost and why; 1 if any lost an alert (else `rc`). A second SIGTERM or Ctrl-C cuts
    the drain short: what is left is counted as undelivered, and said, all the same."""
    hurry = False
    for output in outputs:
        try:
            left = output.close(0 if hurry else drain)
        except KeyboardInterrupt:  # stopped again while draining: no more waiting, nor stopping
            hurry = True
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            left = output.close(0)
        if left or output.dropped or output.rejected:
            why = f" (last error: {output.last_error})" if output.last_error else ""
            cut = " (the drain was cut short)" if hurry and left else ""
            say(
                f"{output.name}: {output.sent} sent, {output.dropped} dropped, "
                f"{output.rejected} rejected, {left} undelivered{cut}{why}"
            )
            rc = rc or 1
    return rc


def _label(name: str) -> str:
    """An output's name for its metrics' label: its URL without credentials or query."""
    from urllib.parse import urlsplit

    parts = urlsplit(name)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"


class ForwarderCollector:
    """The forwarder's metrics: per output what it delivered, dropped, had rejected and holds,
    and the cursor of the last alert read from the daemon."""

    def __init__(self, forwarder: Forwarder) -> None:
        self.forwarder = forwarder

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        families = {
            "delivered": CounterMetricFamily(
                "kvguard_alerts_delivered", "alerts delivered", labels=["output"]
            ),
            "dropped": CounterMetricFamily(
                "kvguard_alerts_dropped", "alerts dropped from a full queue (said in-band)", labels=["output"]
            ),
            "rejected": CounterMetricFamily(
                "kvguard_alerts_rejected", "alerts the receiver refused", labels=["output"]
            ),
        }
        queued = GaugeMetricFamily(
            "kvguard_alerts_queued", "alerts waiting in the output's queue", labels=["output"]
        )
        for output in self.forwarder.outputs:
            label = [_label(output.name)]
            families["delivered"].add_metric(label, output.sent)
            families["dropped"].add_metric(label, output.dropped)
            families["rejected"].add_metric(label, output.rejected)
            queued.add_metric(label, output.pending())
        cursor = GaugeMetricFamily(
            "kvguard_alerts_cursor", "the cursor of the last alert read from the daemon"
        )
        cursor.add_metric([], self.forwarder.last)
        yield from (*families.values(), queued, cursor)
