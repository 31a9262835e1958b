"""`kvguard replay CAPTURE`: a JSON Lines capture run through the ledger and the ruleset, its
findings on stdout (-o table: one finding a line; -o json: JSON Lines) and a summary on
stderr; with `--to ADDR`, its events sent to a daemon instead, as their nodes' agents would
(the client is cli/send.py).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TextIO

import orjson

from kvguard.cli.options import (
    DEFAULT_PORT,
    Subcommands,
    add_command,
    add_output_argument,
    add_tls_arguments,
    listen_address,
    tls_from_args,
)

# The ruleset (CEL), grpc and the agents' upstream are imported in the commands that use them,
# so that `kvguard --help` does not wait for them.


def _open_capture(path: str) -> TextIO:
    if path == "-":
        return sys.stdin
    return open(path, encoding="utf-8", errors="replace")


def cmd_replay(args: argparse.Namespace) -> int:
    """Findings of the capture: exit 1 if any, 0 if none, 2 on an unusable ruleset or capture."""
    if args.to:
        return cmd_replay_to(args)
    from kvguard.ruleset import RulesetError, load_ruleset
    from kvguard.ruleset.replay import format_text, replay

    try:
        ruleset = load_ruleset(Path(args.rules) if args.rules else None)
    except RulesetError as exc:
        print(f"kvguard replay: the ruleset is not usable:\n{exc}", file=sys.stderr)
        return 2
    try:
        stream = _open_capture(args.capture)
    except OSError as exc:
        print(f"kvguard replay: cannot read capture {args.capture}: {exc.strerror}", file=sys.stderr)
        return 2
    source = "standard input" if args.capture == "-" else args.capture
    out = sys.stdout
    if args.output == "json":

        def emit(finding):  # type: ignore[no-untyped-def]
            out.write(orjson.dumps(finding.to_json_dict()).decode() + "\n")
    else:

        def emit(finding):  # type: ignore[no-untyped-def]
            out.write(format_text(finding) + "\n")

    def error(err):  # type: ignore[no-untyped-def]
        print(f"{source}:{err.line}: {err.reason}", file=sys.stderr)

    try:
        with stream:
            summary = replay(stream, ruleset, emit, error)
    except BrokenPipeError:
        raise  # stdout's reader went away: kvguard's main ends quietly (cli/__init__.py)
    except OSError as exc:
        print(f"kvguard replay: reading {source} failed: {exc}", file=sys.stderr)
        return 2
    out.flush()
    print(summary.text(source), file=sys.stderr)
    if summary.lines and not summary.applied and summary.bad:
        return 2
    return 1 if summary.total_findings else 0


def cmd_replay_to(args: argparse.Namespace) -> int:
    """The capture sent to the daemon at --to: exit 0 if all of it was taken, 1 if lines were
    bad or refused, 2 if the capture cannot be read or the daemon refused the stream."""
    import grpc

    from kvguard.agents.upstream import DaemonRefused
    from kvguard.cli.send import send_capture

    tls = tls_from_args(args)
    source = "standard input" if args.capture == "-" else args.capture
    try:
        stream = _open_capture(args.capture)
    except OSError as exc:
        print(f"kvguard replay: cannot read capture {args.capture}: {exc.strerror}", file=sys.stderr)
        return 2
    try:
        with stream:
            summary = send_capture(stream, args.to, tls=tls)
    except (grpc.RpcError, DaemonRefused) as exc:
        detail = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        print(f"kvguard replay: the daemon at {args.to} refused: {detail}", file=sys.stderr)
        return 2
    for err in summary.bad_lines:
        print(f"{source}:{err.line}: {err.reason}", file=sys.stderr)
    for line, reason in summary.rejected:
        print(f"{source}:{line}: refused by the daemon: {reason}", file=sys.stderr)
    print(
        f"sent {summary.events} events from {source} to {args.to}: {summary.accepted} stored, "
        f"{summary.repeats} already there, {len(summary.rejected)} refused, "
        f"{len(summary.bad_lines)} bad line(s)",
        file=sys.stderr,
    )
    return 0 if not (summary.rejected or summary.bad_lines) else 1


def add_parser(sub: Subcommands) -> None:
    """Add `replay` to the `kvguard` subcommands."""
    p = add_command(
        sub,
        "replay",
        "run a JSON Lines capture through the ledger and the ruleset",
        "Run a capture through the ledger and the ruleset and print its findings, or send it to a daemon.",
        "kvguard replay capture.jsonl -o json",
    )
    p.add_argument("capture", help="capture file (JSON Lines of kvguard.v1 events), or - for standard input")
    p.add_argument("--rules", metavar="DIR", help="rules directory (default: the bundled rules)")
    add_output_argument(p, "text", help="findings format (text: the table's older name, still taken)")
    p.add_argument(
        "--to",
        type=listen_address,
        metavar="ADDR",
        help=f"send the events to the daemon at ADDR (host[:port], port {DEFAULT_PORT} if none) instead, "
        "as agents would",
    )
    add_tls_arguments(p)
    p.set_defaults(func=cmd_replay)
