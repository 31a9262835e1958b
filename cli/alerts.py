"""`kvguard alerts`: the daemon's alerts for a SIEM, as a client of its AlertService (as
falcosidekick runs beside Falco): OCSF, CEF or JSON lines, on stdout (to pipe into any
collector) or to outputs named by URL (syslog over UDP, TCP or TLS; HTTP; a file).

Invariants: with --follow the stream is resumed after the last cursor received whenever it
breaks (the daemon restarts, the network), so no alert is missed or repeated; each output
has its own queue and thread (daemon/sinks/outputs.py): a slow one drops its oldest alerts
and says so in-band, never holding back stdout or the others. Without --follow it prints
what the audit log holds and exits. A reader of stdout that goes away ends it quietly.
With --cursor-file the cursor up to which every output is done (delivered, rejected, or dropped
and said) is kept in a file, written at most every second and at exit, and read at start: a
restarted forwarder (the unit kvguard-alerts.service) goes on from there.
Exit codes: 0 all delivered; 1 some alert was dropped, rejected or left undelivered by an
output; 2 unusable options or an unreachable daemon (without --follow); 141 stdout's reader
went away (cli/__init__.py).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from kvguard.cli.options import (
    Subcommands,
    add_command,
    add_daemon_argument,
    add_tls_arguments,
    positive_count,
    seconds,
    tls_from_args,
)
from kvguard.proto.vocabulary import FINDING_KINDS, INTERNAL_KINDS, SEVERITIES

if TYPE_CHECKING:  # grpc and protobuf load when the command runs, not for every kvguard command
    from kvguard.daemon.sinks.outputs import QueuedOutput
    from kvguard.proto.filter import Filter
    from kvguard.proto.kvguard.v1 import services_pb2 as svc
    from kvguard.tui.client import DaemonClient

FORMAT_NAMES = ("json", "ocsf", "cef")
PAGE = 1000  # audit records one query reads (without --follow)
DEFAULT_QUEUE = 10_000  # alerts an output holds while it is slow or down (outputs.DEFAULT_CAPACITY)

Emit = Callable[["svc.Alert"], None]


def _say(line: str) -> None:
    print(f"kvguard alerts: {line}", file=sys.stderr, flush=True)


def _terminate(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM stops it as Ctrl-C does: outputs drain, then it exits


def dump(client: DaemonClient, f: Filter, emit: Emit) -> int:
    """What the audit log holds after f.after, a page at a time, as the live stream sends it
    (a finding that repeats one is not sent); the last cursor read."""
    from dataclasses import replace

    from kvguard.proto.kvguard.v1 import services_pb2 as svc

    after = f.after
    while True:
        records = client.query(replace(f, kind="finding", after=after, limit=PAGE))
        for record in records:
            if "repeat" not in record.finding.details:  # stored, never alerted (daemon/repeats.py)
                emit(svc.Alert(cursor=record.id, finding=record.finding))
            after = record.id
        if len(records) < PAGE:
            return after


def follow(client: DaemonClient, f: Filter, emit: Emit) -> None:
    """The live stream from f.after on, opened again after the last cursor received whenever
    it breaks; returns only by an exception (KeyboardInterrupt, a refusal by the daemon)."""
    from dataclasses import replace

    from kvguard.tui.client import Backoff, Unreachable

    backoff = Backoff(first=0.25, cap=5.0)
    cursor = f.after
    down = False
    while True:
        try:
            cancel, alerts = client.subscribe(replace(f, after=cursor))
            try:
                for alert in alerts:
                    if down:
                        _say(f"following {client.address} again, after cursor {cursor}")
                        down = False
                    emit(alert)
                    cursor = alert.cursor
                    backoff.succeeded()
            finally:
                cancel()
            raise Unreachable("AlertService.Subscribe", "ENDED", "")
        except Unreachable as exc:
            if not down:
                _say(f"{client.address}: {exc}; resuming after cursor {cursor} when it is back")
                down = True
            client.reset()
            time.sleep(backoff.failed())


def _headers(lines: list[str]) -> dict[str, str]:
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--to-header {line!r}: not 'Name: value'")
        headers[name.strip()] = value.strip()
    return headers


def _stdout_writer(line_of: Callable[[svc.Alert], str]) -> Emit:
    def write(alert: svc.Alert) -> None:
        sys.stdout.write(line_of(alert) + "\n")
        sys.stdout.flush()  # a pipe's reader sees each alert as it comes

    return write


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


def _label(name: str) -> str:
    """An output's name for its metrics' label: its URL without credentials or query."""
    from urllib.parse import urlsplit

    parts = urlsplit(name)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{f':{parts.port}' if parts.port else ''}{parts.path}"


class AlertsCollector:
    """The forwarder's metrics: per output what it delivered, dropped, had rejected and holds,
    and the cursor of the last alert read from the daemon."""

    def __init__(self, outputs: list[QueuedOutput], last: list[int]) -> None:
        self.outputs, self.last = outputs, last

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
        for output in self.outputs:
            label = [_label(output.name)]
            families["delivered"].add_metric(label, output.sent)
            families["dropped"].add_metric(label, output.dropped)
            families["rejected"].add_metric(label, output.rejected)
            queued.add_metric(label, output.pending())
        cursor = GaugeMetricFamily(
            "kvguard_alerts_cursor", "the cursor of the last alert read from the daemon"
        )
        cursor.add_metric([], self.last[0])
        yield from (*families.values(), queued, cursor)


def _offer_to(outputs: list[QueuedOutput]) -> Emit:
    def offer(alert: svc.Alert) -> None:
        for output in outputs:
            output.offer(alert)

    return offer


def cmd_alerts(args: argparse.Namespace) -> int:
    from kvguard.daemon.sinks.fields import severities_from
    from kvguard.daemon.sinks.formats import FORMATS
    from kvguard.daemon.sinks.outputs import open_output
    from kvguard.proto.filter import Filter
    from kvguard.tui.client import DaemonClient, DaemonError

    fmt = FORMATS[args.format]
    try:
        headers = _headers(args.to_header or [])
        outputs = [
            open_output(url, fmt, ca=args.to_ca or args.tls_ca, headers=headers, capacity=args.queue)
            for url in args.to or []
        ]
    except ValueError as exc:
        _say(f"--to {exc}" if not str(exc).startswith("--") else str(exc))
        return 2
    severities = severities_from(args.min_severity) if args.min_severity != SEVERITIES[-1] else frozenset()
    kept = CursorFile(args.cursor_file) if args.cursor_file else None
    try:
        after = args.after if args.after or kept is None else kept.load()
    except ValueError as exc:
        _say(str(exc))
        return 2
    f = Filter(
        severities=severities,
        findings=frozenset(args.kind or ()),
        node=args.node or "",
        tenant=args.tenant or "",
        after=after,
    )
    forward = _offer_to(outputs) if outputs else _stdout_writer(fmt.line)
    last = [after]  # the cursor of the last alert forwarded

    def done() -> int:
        """Every alert up to this cursor is done with (stdout is written at once)."""
        return min((o.done_cursor() for o in outputs), default=last[0]) if outputs else last[0]

    def emit(alert: svc.Alert) -> None:
        forward(alert)
        last[0] = alert.cursor
        if kept is not None:
            kept.save(done())

    metrics = None
    if args.metrics_listen:
        from kvguard.proto.metrics_http import MetricsError, serve_metrics

        try:
            metrics = serve_metrics(args.metrics_listen, AlertsCollector(outputs, last), tls_from_args(args))
        except MetricsError as exc:
            _say(str(exc))
            return 2
        _say(f"metrics on {metrics.url}")
    client = DaemonClient(args.daemon, tls_from_args(args))
    signal.signal(signal.SIGTERM, _terminate)
    for output in outputs:
        output.start()
    rc = 0
    try:
        if args.follow:
            follow(client, f, emit)
        else:
            dump(client, f, emit)
    except KeyboardInterrupt:
        if args.follow:  # where a forwarder started again picks up without a gap
            _say(f"stopped after cursor {last[0]} (--after {last[0]} resumes there)")
    except DaemonError as exc:
        _say(f"{args.daemon}: {exc}")
        rc = 2
    finally:
        client.close()
        rc = close_outputs(outputs, args.drain, rc)
        if kept is not None:
            kept.save(done(), now=True)
        if metrics is not None:
            metrics.stop()
    return rc


def close_outputs(outputs: list[QueuedOutput], drain: float, rc: int) -> int:
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
            _say(
                f"{output.name}: {output.sent} sent, {output.dropped} dropped, "
                f"{output.rejected} rejected, {left} undelivered{cut}{why}"
            )
            rc = rc or 1
    return rc


def add_parser(sub: Subcommands) -> None:
    """Add `alerts` to the `kvguard` subcommands."""
    p = add_command(
        sub,
        "alerts",
        "the alert feed for SIEMs: OCSF, CEF or JSON lines to stdout, syslog, HTTP or a file",
        "The daemon's alerts, as a SIEM takes them: printed (what the audit log holds, or followed live with "
        "--follow) on stdout, or sent to syslog (UDP, TCP, TLS), an HTTP collector or a file. Each --to "
        "output has its own queue: a slow one drops its oldest alerts and says so in-band.",
        "kvguard alerts --follow --format cef --min-severity high --to syslog+tls://siem:6514 --to-ca ca.pem",
    )
    p.add_argument("-f", "--follow", action="store_true", help="follow the live alerts (resumes by itself)")
    p.add_argument("--format", choices=FORMAT_NAMES, default="json", help="the encoding of each alert")
    p.add_argument(
        "--min-severity", choices=SEVERITIES, default=SEVERITIES[-1], help="the lowest severity sent"
    )
    p.add_argument(
        "--to",
        action="append",
        metavar="URL",
        help="an output (repeatable; stdout when none): syslog+udp://HOST:PORT, syslog+tcp://..., "
        "syslog+tls://... (port 514, TLS 6514, when none; ?facility=NAME, local0 if none), http(s)://..., "
        "file:///PATH",
    )
    p.add_argument(
        "--after",
        type=int,
        default=0,
        metavar="CURSOR",
        help="start after this alert's cursor (over --cursor-file)",
    )
    p.add_argument(
        "--cursor-file",
        metavar="FILE",
        help="keep the cursor every output is done up to here, and start after the one it holds",
    )
    p.add_argument("--node", metavar="NODE", help="only the alerts of this node")
    p.add_argument(
        "--tenant", metavar="TENANT", help="only the alerts naming this tenant (offender or victim)"
    )
    p.add_argument(
        "--kind",
        action="append",
        choices=FINDING_KINDS + INTERNAL_KINDS,
        metavar="KIND",
        help="only this finding kind (repeatable)",
    )
    p.add_argument("--metrics-listen", metavar="HOST:PORT", help="serve Prometheus metrics here (per output)")
    p.add_argument(
        "--to-ca",
        metavar="PEM",
        help="the CA that signs syslog+tls and https receivers (default: --tls-ca, else the system's)",
    )
    p.add_argument(
        "--to-header",
        action="append",
        metavar="'NAME: VALUE'",
        help="an HTTP header (repeated)",
    )
    p.add_argument("--queue", type=positive_count, default=DEFAULT_QUEUE, help="alerts each output holds")
    p.add_argument(
        "--drain", type=seconds, default=10.0, metavar="SECONDS", help="at exit, how long outputs may deliver"
    )
    add_daemon_argument(p)
    add_tls_arguments(p)
    p.set_defaults(func=cmd_alerts)
