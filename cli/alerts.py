"""`kvguard alerts`: the daemon's alerts for a SIEM, as a client of its AlertService (as
falcosidekick runs beside Falco): OCSF, CEF or JSON lines, on stdout (to pipe into any
collector) or to outputs named by URL (syslog over UDP, TCP or TLS; HTTP; a file). The feed
itself is the part sinks/ (its forwarder, encodings and transports); this is its command line.

Exit codes: 0 all delivered; 1 some alert was dropped, rejected or left undelivered by an
output; 2 unusable options or an unreachable daemon (without --follow); 141 stdout's reader
went away (cli/__init__.py).
"""

from __future__ import annotations

import argparse
import sys

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
from kvguard.sinks.registry import FORMATS, TRANSPORTS

DEFAULT_QUEUE = 10_000  # alerts an output holds while it is slow or down (output.DEFAULT_CAPACITY)


def _say(line: str) -> None:
    print(f"kvguard alerts: {line}", file=sys.stderr, flush=True)


def _headers(lines: list[str]) -> dict[str, str]:
    headers = {}
    for line in lines:
        name, sep, value = line.partition(":")
        if not sep or not name.strip():
            raise ValueError(f"--to-header {line!r}: not 'Name: value'")
        headers[name.strip()] = value.strip()
    return headers


def cmd_alerts(args: argparse.Namespace) -> int:
    from kvguard.proto.client import DaemonClient
    from kvguard.proto.filter import Filter
    from kvguard.sinks.fields import severities_from
    from kvguard.sinks.forwarder import CursorFile, Forwarder, ForwarderCollector
    from kvguard.sinks.output import Options
    from kvguard.sinks.registry import format_named, open_output

    fmt = format_named(args.format)
    try:
        options = Options(
            capacity=args.queue, ca=args.to_ca or args.tls_ca, headers=_headers(args.to_header or [])
        )
        outputs = [open_output(url, fmt, options) for url in args.to or []]
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
    client = DaemonClient(args.daemon, tls_from_args(args))
    forwarder = Forwarder(client, f, fmt, outputs, kept, say=_say)
    metrics = None
    if args.metrics_listen:
        from kvguard.proto.metrics_http import MetricsError, serve_metrics

        try:
            metrics = serve_metrics(args.metrics_listen, ForwarderCollector(forwarder), tls_from_args(args))
        except MetricsError as exc:
            _say(str(exc))
            return 2
        _say(f"metrics on {metrics.url}")
    try:
        return forwarder.run(live=args.follow, drain=args.drain)
    finally:
        if metrics is not None:
            metrics.stop()


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
    p.add_argument(
        "--format",
        choices=tuple(FORMATS),
        default="json",
        help="the encoding of each alert: "
        + "; ".join(f"{name}: {f.summary}" for name, f in FORMATS.items()),
    )
    p.add_argument(
        "--min-severity", choices=SEVERITIES, default=SEVERITIES[-1], help="the lowest severity sent"
    )
    p.add_argument(
        "--to",
        action="append",
        metavar="URL",
        help="an output (repeatable; stdout when none): "
        + "; ".join(f"{scheme}://...: {t.summary}" for scheme, t in TRANSPORTS.items())
        + " (syslog: ?facility=NAME, local0 if none)",
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
