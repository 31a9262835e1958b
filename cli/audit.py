"""`kvguard audit query | request | exposure`: the audit log's reading commands (from the
store or the daemon); cli/audit_chain.py has `verify | seal | new-key`. docs/operator.md §5
is the user's description (filters, outputs, TIME, exit codes).

Invariants: this module only reads the audit log (a store path that does not exist, or a
database without the `records` table, is refused before `Store()` could create anything);
both sources give the same output, built from record bodies only, in record (id) order.
Exit codes: 0 nothing found, 1 findings / exposure, 2 unusable input (a tenant the log never
named too) or unreachable source.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import orjson

from kvguard.cli import audit_chain, audit_receipts
from kvguard.cli.options import (
    DEFAULT_PORT,
    Subcommands,
    add_command,
    add_daemon_argument,
    add_group,
    add_output_argument,
    add_tls_arguments,
    new_parser,
    tls_from_args,
)
from kvguard.daemon.audit.exposure import exposure_of, format_exposure, unknown_tenant
from kvguard.daemon.audit.format import emit, parse_time
from kvguard.daemon.audit.source import (
    DEFAULT_STORE,
    KINDS,
    AuditItem,
    Source,
    UsageError,
    open_source,
)
from kvguard.proto import pb
from kvguard.proto.channel import TlsError
from kvguard.proto.filter import Filter
from kvguard.proto.vocabulary import SEVERITIES

_MAX_UINT32 = (1 << 32) - 1


# ---------------------------------------------------------------------------------------- request


def request_timeline(source: Source, req: str) -> list[AuditItem]:
    """Every record of request `req`, in record order: events (read launches listing it in any
    entry included), findings naming it as offender or victim, commands for it and operators'
    kills of it (the store indexes every request a record names)."""
    return list(source.records(Filter(req=req)))


# ---------------------------------------------------------------------------------------- commands


def _source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        metavar="URL",
        help=f"SQLAlchemy URL, or a SQLite file path (default: {DEFAULT_STORE}, unless --daemon)",
    )
    add_daemon_argument(
        p, None, f"read from the daemon at host[:port] (port {DEFAULT_PORT} if none) instead of a store"
    )
    add_output_argument(p)
    add_tls_arguments(p)


def _usage(prog: str, exc: Exception) -> int:
    print(f"{prog}: {exc}", file=sys.stderr)
    return 2


def _run(prog: str, args: argparse.Namespace, body: Callable[[Source], int]) -> int:
    import grpc
    from sqlalchemy.exc import SQLAlchemyError

    from kvguard.daemon.store import RowError

    try:
        source = open_source(args.store, args.daemon, tls_from_args(args))
    except (UsageError, TlsError) as exc:
        return _usage(prog, exc)
    try:
        return body(source)
    except grpc.RpcError as exc:
        code = exc.code().name if hasattr(exc, "code") else "error"
        detail = exc.details() if hasattr(exc, "details") else str(exc)
        print(f"{prog}: the daemon at {source.label}: {code}: {detail}", file=sys.stderr)
        return 2
    except (SQLAlchemyError, RowError) as exc:
        from kvguard.daemon.store import first_line

        print(f"{prog}: reading audit store {source.label} failed: {first_line(exc)}", file=sys.stderr)
        return 2
    finally:
        source.close()


def _times(args: argparse.Namespace) -> tuple[int, int]:
    since = parse_time(args.since, "--since") if args.since is not None else 0
    until = parse_time(args.until, "--until") if args.until is not None else 0
    if since and until and until < since:
        raise UsageError(f"--until {args.until!r} is before --since {args.since!r}")
    return since, until


def _tenant_times(args: argparse.Namespace) -> tuple[int, int]:
    """The --since/--until window of a command about one tenant (--tenant), checked."""
    if not args.tenant:
        raise UsageError("--tenant is empty")
    return _times(args)


TIMES = "nanoseconds, ISO-8601, or a time ago"  # daemon/audit/format.py's parse_time


def cmd_query(args: argparse.Namespace) -> int:
    """`kvguard audit query`: the matching records. Exit 0, or 2 on unusable input."""
    prog = "kvguard audit query"
    try:
        since, until = _times(args)
        if args.limit < 0 or args.limit > _MAX_UINT32:
            raise UsageError(f"--limit {args.limit} is not a count (0 to {_MAX_UINT32}; 0: no limit)")
    except UsageError as exc:
        return _usage(prog, exc)
    filters = Filter(
        kind=args.kind or "",
        tenant=args.tenant or "",
        req=args.req or "",
        node=args.node or "",
        findings=frozenset([args.finding] if args.finding else []),
        severities=frozenset(SEVERITIES[: SEVERITIES.index(args.severity) + 1])
        if args.severity
        else frozenset(),
        since_ns=since,
        until_ns=until,
        limit=args.limit,
    )

    def body(source: Source) -> int:
        n = emit(source.records(filters), args.output, sys.stdout)
        sys.stdout.flush()
        print(f"{n} record{'s' if n != 1 else ''} from {source.label}", file=sys.stderr)
        return 0

    return _run(prog, args, body)


def cmd_request(args: argparse.Namespace) -> int:
    """`kvguard audit request ID`: one request's timeline. Exit 1 when findings name it, else 0."""
    prog = "kvguard audit request"
    if not args.id:
        return _usage(prog, UsageError("the request ID is empty"))

    def body(source: Source) -> int:
        items = request_timeline(source, args.id)
        emit(items, args.output, sys.stdout)
        sys.stdout.flush()
        events = [i.body for i in items if isinstance(i.body, pb.Event)]
        found = [i.body for i in items if isinstance(i.body, pb.Finding)]
        findings = [f for f in found if not f.details.get("update_of")]  # not the updates of one
        fates = [f.details["outcome"] for f in found if f.details.get("update_of")]
        tenants = {getattr(getattr(e, e.WhichOneof("payload") or ""), "tenant", "") for e in events} - {""}
        nodes = ", ".join(dict.fromkeys(e.node for e in events)) or "no node"
        offender = sum(f.req == args.id for f in findings)
        actions = sum(i.kind == "action" for i in items)
        print(
            f"request {args.id}{' (' + ', '.join(sorted(tenants)) + ')' if tenants else ''}: "
            f"{len(events)} event(s) on {nodes}; {offender} finding(s) as offender, "
            f"{len(findings) - offender} as victim; {sum(i.kind == 'command' for i in items)} command(s)"
            + (f", {actions} operator action(s)" if actions else "")
            + (f"; what became of it: {', '.join(fates)}" if fates else "")
            + ("" if items else f"; no record of it in {source.label}"),
            file=sys.stderr,
        )
        return 1 if findings else 0

    return _run(prog, args, body)


def cmd_exposure(args: argparse.Namespace) -> int:
    """`kvguard audit exposure --tenant T`: exit 1 when T's KV reached another tenant, else 0."""
    prog = "kvguard audit exposure"
    try:
        since, until = _tenant_times(args)
    except UsageError as exc:
        return _usage(prog, exc)

    def body(source: Source) -> int:
        unknown = unknown_tenant(source, args.tenant)
        if unknown:  # unusable input: a misspelt tenant must not read as a clean report
            return _usage(prog, UsageError(unknown))
        report = exposure_of(source, args.tenant, since, until)
        if args.output == "json":
            for offender in report.offenders.values():
                sys.stdout.write(orjson.dumps(offender.to_json_dict(report.tenant)).decode() + "\n")
            sys.stdout.write(orjson.dumps(report.summary_json()).decode() + "\n")
        else:
            format_exposure(report, sys.stdout)
        sys.stdout.flush()
        return 1 if report.offenders else 0

    return _run(prog, args, body)


def add_parser(sub: Subcommands) -> None:
    """Add the `audit` group, and its commands, to the `kvguard` subcommands."""
    add_parsers(
        add_group(
            sub,
            "audit",
            "the audit log",
            "Read the audit log, prove it intact, and seal it with an audit key.",
            "kvguard audit exposure --tenant acme --store kvguard-audit.db",
        )
    )


def add_parsers(audit_sub: Subcommands) -> None:
    """Add every `kvguard audit` command: verify, seal, head, new-key, query, request, exposure,
    and the receipts' (audit_receipts.py)."""
    audit_chain.add_parsers(audit_sub)
    p = add_command(
        audit_sub,
        "query",
        "the audit records that match a filter (table or JSON Lines)",
        "Print the audit records that match every filter given, in record order.",
        "kvguard audit query --store kvguard-audit.db --kind finding --tenant acme -o json",
    )
    _source_args(p)
    p.add_argument("--kind", choices=KINDS, help="only records of this kind")
    p.add_argument("--tenant", metavar="T", help="records of tenant T, as offender or as victim")
    p.add_argument("--req", metavar="R", help="records indexed under request R (see `audit request`)")
    p.add_argument("--node", metavar="N", help="records of node N")
    p.add_argument("--finding", metavar="KIND", help="findings of this kind (stale_read, ...)")
    p.add_argument(
        "--severity",
        choices=SEVERITIES,
        metavar="LEVEL",
        help="findings of this severity or above (critical, high, medium, low, info)",
    )
    p.add_argument(
        "--since", metavar="TIME", help="ts_ns at or after TIME (nanoseconds, ISO-8601, or ago: 24h)"
    )
    p.add_argument(
        "--until", metavar="TIME", help="ts_ns at or before TIME (nanoseconds, ISO-8601, or ago: 5m)"
    )
    p.add_argument("--limit", type=int, default=0, metavar="N", help="at most N records (0: all)")
    p.set_defaults(func=cmd_query)

    p = add_command(
        audit_sub,
        "request",
        "one request's timeline across nodes: events, findings naming it, commands",
        "Print one request's records across nodes (exit 1 if a finding names it).",
        "kvguard audit request g1 --daemon 127.0.0.1:7463",
    )
    p.add_argument("id", metavar="ID", help="the request id")
    _source_args(p)
    p.set_defaults(func=cmd_request)

    p = add_command(
        audit_sub,
        "exposure",
        "which requests of other tenants read, received or overwrote a tenant's KV",
        "Report which requests of other tenants read, received or overwrote a tenant's KV (exit 1 if any).",
        "kvguard audit exposure --tenant acme --since 2026-01-14T00:00:00",
    )
    p.add_argument("--tenant", required=True, metavar="T", help="the tenant whose KV may have leaked")
    p.add_argument(
        "--since", metavar="TIME", help="findings at or after TIME (nanoseconds, ISO-8601, or ago: 7d)"
    )
    p.add_argument(
        "--until", metavar="TIME", help="findings at or before TIME (nanoseconds, ISO-8601, or ago)"
    )
    _source_args(p)
    p.set_defaults(func=cmd_exposure)
    audit_receipts.add_parsers(audit_sub, _source_args)


def build_parser() -> argparse.ArgumentParser:
    """A parser of just the audit group (what `kvguard audit` adds these commands to)."""
    parser = new_parser(
        "kvguard audit",
        "Read the kvguard audit log, prove it intact, and seal it with an audit key.",
        "kvguard audit exposure --tenant acme --store kvguard-audit.db",
    )
    add_parsers(parser.add_subparsers(dest="audit_command", required=True))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """`kvguard audit ...` without the leading `audit`: main(["exposure", "--tenant", "acme"])."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2), already printed
        return exc.code if isinstance(exc.code, int) else 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
