"""`kvguard audit verify | seal | new-key`: the audit log's proof of integrity. Every record
is chained to the one before it by its hash; a store sealed with an audit key (HMAC-SHA256,
kept off the database's machine) cannot be rewritten, chain and all, by someone without it.

- `verify`: prove that no record was altered, removed or reordered (with the keys, that the
  sealed part is the key holder's), and up to which record the store is complete (its head,
  store/head.py); and say whether the ledger snapshot is bound to the chain.
- `seal`: seal a store's chain from its next record on, or rotate its key (daemon stopped).
- `head`: write the head for a store as it stands (one written before heads were kept).
- `new-key`: write a new random key, mode 600.

Invariant: none of them creates a store: a store path that does not exist, or a database
without the `records` table, is refused (exit 2) before `Store()` could create it, so that a
typo is never proven "0 records, chain intact" (the daemon creates stores).
Exit codes: 0 proven / done, 1 not proven or not done (the reason on stderr), 2 no such store
or an unusable option (as every kvguard command says of unusable input).
cli/audit.py adds these commands to the `kvguard audit` group.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import orjson

from kvguard.cli.options import Subcommands, add_command, add_output_argument

# The store (SQLAlchemy, alembic) is imported when a command runs, so that `kvguard --help`
# does not wait for it.


class Verdict:
    """What `audit verify` found, said as lines (table) or as one JSON object (json)."""

    def __init__(self, store: str) -> None:
        self.fields: dict[str, Any] = {"store": store, "intact": False, "complete": False}
        self.said: list[str] = []  # on stdout, as a table
        self.problems: list[str] = []  # on stderr

    def say(self, output: str) -> None:
        if output == "json":
            print(orjson.dumps(self.fields).decode())
        else:
            for line in self.said:
                print(line)
        sys.stdout.flush()
        for line in self.problems:
            print(line, file=sys.stderr)


def cmd_verify(args: argparse.Namespace) -> int:
    """`kvguard audit verify`: exit 0 when the chain (and every seal) is proven intact, 1 when
    not, 2 when there is no such store."""
    verdict = Verdict(args.store)
    code = _verify(args, verdict)
    verdict.fields["ok"] = code == 0
    if code == 2:
        print(f"kvguard audit verify: {verdict.fields['error']}", file=sys.stderr)
        if args.output == "json":
            print(orjson.dumps(verdict.fields).decode())
        return 2
    verdict.say(args.output)
    return code


def _verify(args: argparse.Namespace, verdict: Verdict) -> int:
    from kvguard.daemon.store import AuditKeyError, RowError, Store, StoreError, missing_store, read_audit_key

    try:
        keys = [read_audit_key(path) for path in args.audit_key or ()]
        if (missing := missing_store(args.store)) is not None:
            verdict.fields["error"] = missing
            return 2
        store = Store(args.store, *keys, head_file=args.audit_head)
    except (AuditKeyError, StoreError) as exc:
        verdict.fields["error"] = str(exc)
        verdict.problems.append(f"kvguard audit verify: {exc}")
        return 1
    except RowError as exc:
        verdict.fields["error"] = f"NOT proven intact: {exc}"
        verdict.problems.append(f"kvguard audit verify: audit store {args.store}: NOT proven intact: {exc}")
        return 1
    try:
        return _verdict(store, verdict)
    finally:
        store.close()


def _verdict(store: Any, verdict: Verdict) -> int:
    ok, n, problem = store.verify()
    seals = store.seals
    verdict.fields.update(store=store.url, records=n, intact=ok, sealed_from=list(seals))
    if not ok:
        verdict.fields["error"] = f"NOT proven intact after {n} good records: {problem}"
        verdict.problems.append(f"audit log {store.url}: {verdict.fields['error']}")
        return 1
    sealed = "" if not seals else f", sealed with the audit key from record {seals[0]} on"
    if len(seals) > 1:
        sealed += f" (key rotated at record{'s' if len(seals) > 2 else ''} {', '.join(map(str, seals[1:]))})"
    complete = store.completeness()
    verdict.fields.update(complete=bool(complete.proven), completeness=str(complete.said))
    if not complete.proven:
        verdict.said.append(f"audit log {store.url}: {n} records, chain intact{sealed}")
        verdict.fields["error"] = f"NOT proven complete: {complete.said}"
        verdict.problems.append(f"audit log {store.url}: {verdict.fields['error']}")
        return 1
    verdict.said.append(f"audit log {store.url}: {n} records, chain intact{sealed}; {complete.said}")
    # The ledger snapshot a restart would load is derived data, outside the chain, but bound
    # to it: one that does not match is not loaded (the store is replayed), and is said here.
    found = store.latest_snapshot()
    if isinstance(found, str):
        verdict.fields["snapshot"] = found
        replays = "" if found == "no snapshot" else " (a restart replays the store)"
        verdict.said.append(f"ledger snapshot: {found}{replays}")
    else:
        verdict.fields["snapshot"] = f"after record {found[0]}"
        verdict.fields["snapshot_through"] = found[0]
        verdict.said.append(f"ledger snapshot: after record {found[0]}, bound to the chain there")
    return 0


def cmd_seal(args: argparse.Namespace) -> int:
    """`kvguard audit seal`: exit 0 once sealed (or the key rotated), 1 when it was not, 2 when
    there is no such store."""
    from kvguard.daemon.store import AuditKeyError, Store, StoreError, missing_store, read_audit_key

    if (missing := missing_store(args.store)) is not None:  # a new store is sealed by its daemon
        print(
            f"kvguard audit seal: {missing} (a daemon started with --audit-key seals a new one)",
            file=sys.stderr,
        )
        return 2
    try:
        key = read_audit_key(args.audit_key)
        if args.current_key:  # a rotation: the holder of the current key seals on with a new one
            store = Store(args.store, read_audit_key(args.current_key), head_file=args.audit_head)
            if lost := _loss(store):
                raise StoreError(f"audit store {store.url}: not sealed: not proven complete: {lost}")
            from_id = store.seal(key, rotate=True)
            print(
                f"audit log {store.url}: sealed with the new audit key from record {from_id} on (key rotated)"
            )
            return 0
        plain = Store(args.store, head_file=args.audit_head)
        if plain.seals:
            raise StoreError(
                f"audit store {plain.url}: sealed already (the current seal from record "
                f"{plain.seals[-1]} on); to rotate its key, give the current one as --current-key"
            )
        ok, n, problem = plain.verify()
        plain.close()
        if not ok:  # sealing vouches for nothing before it, but says so only of a sound chain
            raise StoreError(f"audit store {plain.url}: not sealed: the chain is not intact ({problem})")
        if lost := _loss(plain):
            raise StoreError(f"audit store {plain.url}: not sealed: not proven complete: {lost}")
        store = Store(args.store, key, head_file=args.audit_head)
        from_id = store.seal()
    except (AuditKeyError, StoreError) as exc:
        print(f"kvguard audit seal: {exc}", file=sys.stderr)
        return 1
    print(
        f"audit log {store.url}: {n} records, chain intact; "
        f"sealed with the audit key from record {from_id} on"
    )
    return 0


def _loss(store: Any) -> str:
    """What the store's head proves missing, or "": complete, or no head yet (a store written
    before heads were kept). Sealing, or writing a head, over a loss would cover it up."""
    complete = store.completeness()
    if complete.proven or store.head_file is None or not os.path.exists(store.head_file):
        return ""
    return str(complete.said)


def cmd_head(args: argparse.Namespace) -> int:
    """`kvguard audit head`: exit 0 once the head is written, 1 when it was not, 2 when there is
    no such store."""
    from kvguard.daemon.store import AuditKeyError, RowError, Store, StoreError, missing_store, read_audit_key

    if (missing := missing_store(args.store)) is not None:
        print(f"kvguard audit head: {missing}", file=sys.stderr)
        return 2
    try:
        keys = [read_audit_key(path) for path in args.audit_key or ()]
        store = Store(args.store, *keys, head_file=args.audit_head)
        ok, n, problem = store.verify()
        if not ok:
            raise StoreError(f"audit store {store.url}: no head written: the chain is not intact ({problem})")
        if lost := _loss(store):
            raise StoreError(
                f"audit store {store.url}: no head written over one that proves records missing: {lost}; "
                "if that loss is known and accepted, move the head file aside first"
            )
        through = store.adopt_head()
    except (AuditKeyError, StoreError, RowError) as exc:
        print(f"kvguard audit head: {exc}", file=sys.stderr)
        return 1
    print(
        f"audit log {store.url}: {n} records, chain intact; "
        f"its head, at record {through}, written to {store.head_file}"
    )
    return 0


def cmd_new_key(args: argparse.Namespace) -> int:
    """`kvguard audit new-key PATH`: exit 0 once written, 1 when it cannot be."""
    from kvguard.daemon.store import new_audit_key

    try:
        new_audit_key(args.path)
    except OSError as exc:
        print(f"kvguard audit new-key: {args.path}: {exc.strerror}", file=sys.stderr)
        return 1
    print(f"audit key written to {args.path} (mode 600): keep it off the database's machine or disk")
    return 0


def _head_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--audit-head",
        metavar="FILE",
        help="the chain's head file, as the daemon was given it (default: beside a SQLite store, its file "
        "name + .head; for PostgreSQL, kvguard-audit-DATABASE.head in $STATE_DIRECTORY, else here)",
    )


def add_parsers(audit_sub: Subcommands) -> None:
    """Add `verify`, `seal`, `head` and `new-key` to the `kvguard audit` subcommands."""
    p = add_command(
        audit_sub,
        "verify",
        "prove that no record was altered, removed or reordered",
        "Prove the audit log's hash chain intact, and with its keys, that the sealed part is theirs.",
        "kvguard audit verify --store kvguard-audit.db --audit-key audit.key",
    )
    p.add_argument("--store", default="kvguard-audit.db", help="SQLAlchemy URL, or a SQLite file path")
    p.add_argument(
        "--audit-key",
        metavar="FILE",
        action="append",
        help="a key the store is sealed with (needed to prove what it sealed; once per key a rotation left)",
    )
    _head_argument(p)
    add_output_argument(p, help="output format (json: one object: store, records, intact, complete, ...)")
    p.set_defaults(func=cmd_verify)

    p = add_command(
        audit_sub,
        "seal",
        "seal a store's chain with an audit key from its next record on (daemon stopped)",
        "Seal the store's chain with an audit key from its next record on, or rotate its key.",
        "kvguard audit seal --store kvguard-audit.db --audit-key new.key --current-key audit.key",
    )
    p.add_argument("--store", default="kvguard-audit.db", help="SQLAlchemy URL, or a SQLite file path")
    p.add_argument("--audit-key", metavar="FILE", required=True, help="the key (`kvguard audit new-key`)")
    p.add_argument(
        "--current-key",
        metavar="FILE",
        help="rotate: the key the store is sealed with now; the new one follows it",
    )
    _head_argument(p)
    p.set_defaults(func=cmd_seal)

    p = add_command(
        audit_sub,
        "head",
        "write the chain's head for a store as it stands (a store written before heads were kept)",
        "Verify the chain, then write its head (record count and last hash, sealed) beside the store.",
        "kvguard audit head --store kvguard-audit.db --audit-key audit.key",
    )
    p.add_argument("--store", default="kvguard-audit.db", help="SQLAlchemy URL, or a SQLite file path")
    p.add_argument(
        "--audit-key",
        metavar="FILE",
        action="append",
        help="the store's audit keys, if it is sealed (once each)",
    )
    _head_argument(p)
    p.set_defaults(func=cmd_head)

    p = add_command(
        audit_sub,
        "new-key",
        "write a new random audit key (for --audit-key), mode 600",
        "Write a new random audit key, readable by its owner only; it never overwrites a file.",
        "kvguard audit new-key /etc/kvguard/audit.key",
    )
    p.add_argument("path", help="where (never over an existing file)")
    p.set_defaults(func=cmd_new_key)
