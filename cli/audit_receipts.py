"""`kvguard audit receipt | receipts | verify-receipt | receipt-key`: each request's signed
integrity receipt (docs/receipts.md), fetched from the store or the daemon, handed to a
tenant, and checked offline with only the daemon's public key.

Invariants: a request's current receipt is its newest; an older one is shown as superseded,
never as current; `verify-receipt` reads only the file and the key, and says what a receipt
proves and what it does not. Exit codes: `receipt` 0 clean, 1 findings, 2 none or unusable
input; `verify-receipt` 0 holds, 1 refused (with the reason), 2 unusable input.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import orjson

from kvguard.cli.options import Subcommands, add_command, tls_from_args
from kvguard.daemon.audit.format import format_time
from kvguard.daemon.audit.source import Source, UsageError
from kvguard.proto import receipt
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc


def receipts_of(source: Source, f: Filter) -> dict[str, list[tuple[int, svc.SignedReceipt]]]:
    """Every receipt record the filter takes, by request, oldest first (the last: current)."""
    out: dict[str, list[tuple[int, svc.SignedReceipt]]] = {}
    for item in source.records(f):
        if isinstance(item.body, svc.SignedReceipt):
            r = svc.Receipt.FromString(item.body.receipt)
            out.setdefault(r.req, []).append((item.id, item.body))
    return out


def _describe(record_id: int, signed: svc.SignedReceipt, out: TextIO, superseded_by: int = 0) -> None:
    r = svc.Receipt.FromString(signed.receipt)
    state = f"SUPERSEDED by record {superseded_by}" if superseded_by else "current"
    out.write(f"receipt of request {r.req} (tenant {r.tenant}): {r.verdict.upper()}, {state}\n")
    out.write(
        f"  record {record_id}, signed {format_time(r.issued_ns)} by {r.daemon or '?'} key {signed.key_id}"
    )
    out.write(f", kvguard {r.kvguard_version}, rules {r.ruleset_digest[:16]}\n")
    nodes = ", ".join(f"{n.node} (epoch {n.epoch})" for n in r.nodes)
    out.write(f"  ran on {nodes} from {format_time(r.first_ns)} to {format_time(r.last_ns)}\n")
    out.write(f"  attended {r.pages_attended} pages over {r.tokens} tokens; its pages' KV: ")
    out.write(
        ", ".join(f"{s.pages} {s.kind}" + (f" ({s.rule})" if s.rule else "") for s in r.sources) or "none"
    )
    out.write("\n")
    for f in r.findings:
        out.write(f"  finding record {f.record}: {f.finding} as {f.role}, {f.action or '-'}\n")
    out.write(
        f"  ends at chain record {r.chain_record}"
        + (f", supersedes record {r.supersedes}" if r.supersedes else "")
    )
    out.write("\n")


def cmd_receipt(args: argparse.Namespace) -> int:
    """`kvguard audit receipt REQ`: exit 0 clean, 1 findings, 2 none (or unusable input)."""
    from kvguard.cli.audit import _run

    prog = "kvguard audit receipt"

    def body(source: Source) -> int:
        found = receipts_of(source, Filter(kind="receipt", req=args.req)).get(args.req, [])
        if not found:
            print(
                f"{prog}: no receipt of request {args.req!r}: kvguard never saw it end where its client is "
                "answered (or has not yet: a receipt follows its end within a second)",
                file=sys.stderr,
            )
            return 2
        record_id, signed = found[-1]
        if args.output == "json":
            sys.stdout.write(receipt.to_file(signed).decode())
        else:
            if args.all:
                for (older, old), (newer, _) in itertools.pairwise(found):
                    _describe(older, old, sys.stdout, superseded_by=newer)
            _describe(record_id, signed, sys.stdout)
        sys.stdout.flush()
        return 0 if svc.Receipt.FromString(signed.receipt).verdict == "clean" else 1

    return _run(prog, args, body)


def cmd_receipts(args: argparse.Namespace) -> int:
    """`kvguard audit receipts --tenant T`: each of T's requests' current receipt (one JSON
    line each, or a file each in --out-dir). Exit 0, or 2 on unusable input."""
    from kvguard.cli.audit import _run, _tenant_times, _usage

    prog = "kvguard audit receipts"
    try:
        since, until = _tenant_times(args)
    except UsageError as exc:
        return _usage(prog, exc)

    def body(source: Source) -> int:
        found = receipts_of(
            source, Filter(kind="receipt", tenant=args.tenant, since_ns=since, until_ns=until)
        )
        current = [(req, *kept[-1], len(kept) - 1) for req, kept in found.items()]
        current = [c for c in current if svc.Receipt.FromString(c[2].receipt).tenant == args.tenant]
        if args.out_dir:
            directory = Path(args.out_dir)
            directory.mkdir(parents=True, exist_ok=True)
        for req, record_id, signed, superseded in current:
            r = svc.Receipt.FromString(signed.receipt)
            if args.out_dir:
                (directory / f"receipt-{record_id}.json").write_bytes(receipt.to_file(signed))
            elif args.output == "json":
                sys.stdout.write(orjson.dumps(orjson.loads(receipt.to_file(signed))).decode() + "\n")
            else:
                was = f" ({superseded} superseded)" if superseded else ""
                print(f"{record_id:>10}  {format_time(r.issued_ns)}  {r.verdict:8}  {req}{was}")
        if args.out_dir:
            print(f"{len(current)} receipts of tenant {args.tenant} in {args.out_dir}")
        sys.stdout.flush()
        return 0

    return _run(prog, args, body)


def cmd_verify_receipt(args: argparse.Namespace) -> int:
    """`kvguard audit verify-receipt FILE --key PUB`: offline. Exit 0 holds, 1 refused, 2 unusable."""
    prog = "kvguard audit verify-receipt"
    try:
        public = receipt.load_public(args.key)
    except receipt.ReceiptError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 2
    try:
        signed = receipt.from_file(args.file)
    except receipt.ReceiptError as exc:
        print(f"REFUSED: {exc}")
        return 1
    verdict = receipt.verify(signed, public, tenant=args.tenant or "", req=args.req or "")
    if not verdict.ok:
        print(f"REFUSED: {args.file}: {verdict.reason}")
        return 1
    r = verdict.receipt
    assert r is not None
    print(f"VALID: receipt of request {r.req} of tenant {r.tenant}: {r.verdict.upper()}")
    print("it proves:")
    for line in verdict.proves:
        print(f"  - {line}")
    print("it does not prove:")
    for line in verdict.does_not:
        print(f"  - {line}")
    return 0


def cmd_receipt_key(args: argparse.Namespace) -> int:
    """`kvguard audit receipt-key`: the public half, from the key file or the daemon."""
    prog = "kvguard audit receipt-key"
    if args.key:
        try:
            sys.stdout.write(receipt.public_pem(receipt.load_private(args.key).public_key()).decode())
        except receipt.ReceiptError as exc:
            print(f"{prog}: {exc}", file=sys.stderr)
            return 2
        return 0
    import grpc

    from kvguard.proto.channel import TlsError, channel
    from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc

    try:
        with channel(args.daemon, tls_from_args(args)) as ch:
            state = svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(own=True), timeout=10)
    except (grpc.RpcError, TlsError) as exc:
        said = exc.details() if isinstance(exc, grpc.RpcError) else str(exc)
        print(f"{prog}: the daemon at {args.daemon}: {said}", file=sys.stderr)
        return 2
    if not state.receipt_key:
        print(
            f"{prog}: the daemon at {args.daemon} signs no receipts (it has no --receipt-key)",
            file=sys.stderr,
        )
        return 2
    sys.stdout.write(state.receipt_key)
    return 0


def add_parsers(audit_sub: Subcommands, source_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add `receipt`, `receipts`, `verify-receipt` and `receipt-key` to `kvguard audit`."""
    from kvguard.cli.options import add_daemon_argument, add_tls_arguments

    p = add_command(
        audit_sub,
        "receipt",
        "a request's signed integrity receipt: where the KV it attended came from",
        "Print a request's current receipt (exit 0 clean, 1 findings, 2 none); -o json writes the file "
        "a tenant verifies with `verify-receipt`.",
        "kvguard audit receipt chat-42 --daemon 127.0.0.1:7463 -o json",
    )
    p.add_argument("req", metavar="REQ", help="the request (what the engine's kvguard-receipt header says)")
    p.add_argument("--all", action="store_true", help="also the receipts it superseded")
    source_args(p)
    p.set_defaults(func=cmd_receipt)

    p = add_command(
        audit_sub,
        "receipts",
        "every current receipt of a tenant's requests, to hand to the tenant",
        "List (or write, one file each) the current receipt of each of a tenant's requests.",
        "kvguard audit receipts --tenant acme --since 7d --out-dir acme-receipts",
    )
    p.add_argument("--tenant", required=True, metavar="T")
    p.add_argument("--since", metavar="TIME", help="receipts signed at or after TIME")
    p.add_argument("--until", metavar="TIME", help="receipts signed at or before TIME")
    p.add_argument("--out-dir", metavar="DIR", help="write each as DIR/receipt-RECORD.json")
    source_args(p)
    p.set_defaults(func=cmd_receipts)

    p = add_command(
        audit_sub,
        "verify-receipt",
        "check a receipt file offline with the daemon's public key",
        "Check a receipt with no daemon and no store: its signature, its key, and (given) that it is "
        "of your tenant and request; say what it proves and what it does not.",
        "kvguard audit verify-receipt chat-42.receipt.json --key receipt.pub --tenant acme",
    )
    p.add_argument("file", help="a receipt file (`kvguard audit receipt REQ -o json`)")
    p.add_argument("--key", required=True, metavar="PUB", help="the daemon's public receipt key (PEM)")
    p.add_argument("--tenant", metavar="T", help="refuse it unless it is of tenant T's request")
    p.add_argument("--req", metavar="R", help="refuse it unless it is of request R")
    p.set_defaults(func=cmd_verify_receipt)

    p = add_command(
        audit_sub,
        "receipt-key",
        "the public key that verifies the daemon's receipts (PEM), to publish",
        "Print the public half of the daemon's receipt key: asked of the daemon, or read from the key.",
        "kvguard audit receipt-key --daemon 127.0.0.1:7463",
    )
    add_daemon_argument(p)
    p.add_argument("--key", metavar="FILE", help="read it from the daemon's private key file instead")
    add_tls_arguments(p)
    p.set_defaults(func=cmd_receipt_key)
