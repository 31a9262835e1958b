"""Reading the audit store: the events to rebuild a ledger from (`event_batches`), the
records a filter takes (`rows`: the audit queries and the alert backlog), and the proof that
the chain is whole (`verify`).

Invariants: everything is read in id order, a run's events one by one under their own ids,
as if each were a record of its own; reading changes nothing; a filter means what
proto/filter.py says it means (the same as on the live alert stream). A request's records are
those indexed for it (`req`, `named`) and the steps naming it within its span on their node
(`spans`: a step is not indexed by its batch's requests, rows.py).
"""

from __future__ import annotations

import bisect
from collections.abc import Collection, Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np
from google.protobuf.message import DecodeError
from sqlalchemy import ColumnElement, Engine, and_, case, func, or_, select

from kvguard.daemon.store.chain import GENESIS, chain
from kvguard.daemon.store.rows import (
    RUN_SPAN_NS,
    indexed,
    named_of,
    named_with_steps,
    names,
    run_events,
    run_ids,
)
from kvguard.daemon.store.schema import COLUMNS, RowError, checked, named, records
from kvguard.proto import pb, wire
from kvguard.proto.filter import Filter


def holding(conn: Any, record_id: int) -> int:
    """The id of the record that holds id `record_id` (a run holds its events' ids), or
    `record_id` if none does yet."""
    c = records.c
    found = conn.execute(select(func.max(c.id)).where(c.id <= record_id)).scalar()
    return int(found) if found is not None else record_id


def events(engine: Engine, after: int = 0) -> Iterator[pb.Event]:
    """The stored events after id `after`, in the order they were applied, parsed."""
    for _, batch, skip in event_batches(engine, after):
        for i in range(skip, len(batch)):
            yield pb.Event.FromString(batch.event(i))


def event_batches(
    engine: Engine,
    after: int = 0,
    until: int | None = None,
    nodes: Collection[str] | None = None,
) -> Iterator[tuple[str, wire.Batch, int]]:
    """The stored events after id `after` (only those of `nodes`, if given), in the order they
    were applied, as their bytes: (node, its events, how many of them come before `after`) per
    record, a run's together (the daemon rebuilds its ledger from them at start, applying them
    as it applied them live)."""
    for _, node, batch, skip in _event_records(engine, after, until, nodes):
        yield node, batch, skip


def _event_records(
    engine: Engine, after: int, until: int | None, nodes: Collection[str] | None
) -> Iterator[tuple[int, str, wire.Batch, int]]:
    """(record id, node, its events, how many come before `after`) of each record of events
    after id `after` (up to `until`, a record's end; of `nodes`, if given), in id order."""
    c = records.c
    query = select(c.id, c.kind, c.node, c.body).where(c.kind.in_(EVENT_KINDS)).order_by(c.id)
    with engine.connect() as conn:
        query = query.where(c.id >= holding(conn, after + 1))
        if until is not None:  # a record's end: the records that start up to it end there too
            query = query.where(c.id <= until)
        if nodes is not None:
            query = query.where(c.node.in_(list(nodes)))
        with conn.execution_options(stream_results=True, yield_per=2000).execute(query) as result:
            for record_id, kind, node, body in result:
                if type(body) is not bytes or type(node) is not str or type(kind) is not str:
                    row = {"kind": kind, "node": node, "body": body}
                    kind, node, body = checked("records", f"record {record_id}", row).values()
                skip = after + 1 - record_id
                if kind == "event":
                    if skip <= 0:
                        yield int(record_id), node, wire.single(body), 0
                    continue
                yield int(record_id), node, wire.decode_batch(body, wrapped=False), max(0, skip)


def records_of(engine: Engine, kind: str) -> Iterator[tuple[int, str, bytes]]:
    """(id, node, body) of every record of `kind` (a kind of one record an id: not events), in
    id order (the records_kind_ts index finds them)."""
    c = records.c
    query = select(c.id, c.node, c.body).where(c.kind == kind).order_by(c.id)
    with (
        engine.connect() as conn,
        conn.execution_options(stream_results=True, yield_per=2000).execute(query) as result,
    ):
        for record_id, node, body in result:
            if type(body) is not bytes or type(node) is not str:
                node, body = checked("records", f"record {record_id}", {"node": node, "body": body}).values()
            yield int(record_id), node, body


EVENT_KINDS = ("event", "events")
# The events after which a request holds nothing on its node: its span there ends.
ENDS = frozenset({"free", "finish", "abort", "reject", "kill"})


class Span(NamedTuple):
    """Where a request's steps may lie on one node: event ids [lo, hi] (hi None: to the end of
    the node's records), `first` the id of the record that holds lo; `handle`: the number its
    admit there gave it (Admit.handle, 0: none), by which steps name it instead of its name."""

    first: int
    lo: int
    hi: int | None
    handle: int = 0


ADMITS_LOOKED_AT = 16  # of a request's indexed records on a node, the first this many hold its admit


def _hit(req: str) -> ColumnElement[bool]:
    """The records indexed for request `req`: their own request, or one they name."""
    c = records.c
    return (c.req == req) | c.id.in_(select(named.c.record_id).where(named.c.req == req))


def _indexed_for(kind: str, body: bytes, req: str) -> list[tuple[int, str]]:
    """(position in the record, payload kind) of its events indexed for `req`."""
    return [(i, event.WhichOneof("payload") or "") for i, event in _events_for(kind, body, req)]


def _events_for(kind: str, body: bytes, req: str) -> list[tuple[int, pb.Event]]:
    """(position in the record, event) of its events indexed for `req`."""
    bodies = run_events(body) if kind == "events" else [body] if kind == "event" else []
    found = []
    for i, data in enumerate(bodies):
        event = pb.Event.FromString(data)
        own, _, others = indexed(event)
        if req == own or req in others:
            found.append((i, event))
    return found


def _handle(conn: Any, req: str, node: str) -> int:
    """The handle request `req`'s admit on `node` gave it (0: none, or no admit among its
    first indexed records there)."""
    c = records.c
    query = (
        select(c.id, c.kind, c.body)
        .where(_hit(req) & (c.node == node) & c.kind.in_(EVENT_KINDS))
        .order_by(c.id)
        .limit(ADMITS_LOOKED_AT)
    )
    for i, kind, body in conn.execute(query):
        kind, body = checked("records", f"record {i}", {"kind": kind, "body": body}).values()
        for _, event in _events_for(kind, body, req):
            if event.WhichOneof("payload") == "admit" and event.admit.handle:
                return int(event.admit.handle)
    return 0


def spans(conn: Any, req: str, node: str = "") -> dict[str, Span]:
    """Request `req`'s span on each node (on `node` only, if given) where an event is indexed
    for it: from its first indexed record there (a run's first event indexed for it) to its
    last (that one's last such event, or a finding after it) if its last indexed event there is
    a free, finish, abort, reject or kill of it; else to the end of the node's records (still
    running there, or ended unseen). A step naming it in that span is one of its records."""
    c = records.c
    last_event = func.max(case((c.kind.in_(EVENT_KINDS), c.id)))
    query = select(c.node, func.min(c.id), func.max(c.id), last_event).where(_hit(req)).group_by(c.node)
    if node:
        query = query.where(c.node == node)
    found = {}
    for name, first, last, last_ev in conn.execute(query).all():
        if last_ev is None:  # only findings or commands name it there
            continue
        ends = (first, last, last_ev)
        bodies = {
            i: tuple(checked("records", f"record {i}", {"kind": k, "body": b}).values())
            for i, k, b in conn.execute(select(c.id, c.kind, c.body).where(c.id.in_(ends)))
        }
        head = _indexed_for(*bodies[first], req)
        lo = first + (head[0][0] if head else 0)
        ending = _indexed_for(*bodies[last_ev], req)
        hi = None
        if ending and ending[-1][1] in ENDS:
            tail = _indexed_for(*bodies[last], req)
            hi = last + (tail[-1][0] if tail else 0)
        found[str(name)] = Span(int(first), int(lo), hi, _handle(conn, req, str(name)))
    return found


def rows(engine: Engine, f: Filter) -> Iterator[tuple[int, str, bytes]]:
    """(id, kind, body) of the events, findings and commands the filter takes, in id order
    (after `f.after`, at most `f.limit`); a run's events one by one, each as (its id, "event",
    its bytes). A tenant or a request matches as offender or as victim; a request also takes
    the steps naming it within its spans (`spans`)."""
    c = records.c
    # Runs are selected by what may match (their first id and time, every request they
    # name), and their events filtered one by one below.
    query = select(c.id, c.kind, c.node, c.ts_ns, c.body).order_by(c.id)
    if f.kind:
        query = query.where(c.kind.in_(EVENT_KINDS) if f.kind == "event" else c.kind == f.kind)
    if f.tenant:
        query = query.where((c.tenant == f.tenant) | (c.victim_tenant == f.tenant) | (c.kind == "events"))
    if f.node:
        query = query.where(c.node == f.node)
    if f.findings:
        query = query.where(c.finding.in_(sorted(f.findings)))
    if f.severities:
        query = query.where(c.severity.in_(sorted(f.severities)))
    if f.since_ns:
        query = query.where(c.ts_ns >= max(f.since_ns - RUN_SPAN_NS, -(1 << 63)))
    if f.until_ns:
        query = query.where(c.ts_ns <= f.until_ns)
    inspect = bool(f.tenant or f.req or f.since_ns or f.until_ns)  # a run's events must be decoded
    left = f.limit or -1
    with engine.connect() as conn:
        steps: dict[str, Span] = {}
        if f.req:  # indexed for it (its own request, or one it names), or a step in its spans
            steps = spans(conn, f.req, f.node) if f.kind in ("", "event") else {}
            scans = [
                and_(c.node == node, c.id >= s.first, *([c.id <= s.hi] if s.hi is not None else []))
                for node, s in steps.items()
            ]
            taken = _hit(f.req)
            query = query.where(taken | (c.kind.in_(EVENT_KINDS) & or_(*scans)) if scans else taken)
        if f.after:
            query = query.where(c.id >= holding(conn, f.after + 1))
        with conn.execution_options(stream_results=True, yield_per=2000).execute(query) as result:
            for record_id, record_kind, node, ts_ns, body in result:
                if type(body) is not bytes or type(ts_ns) is not int or type(record_kind) is not str:
                    row = {"kind": record_kind, "node": node, "ts_ns": ts_ns, "body": body}
                    record_kind, node, ts_ns, body = checked("records", f"record {record_id}", row).values()
                if record_kind != "events":
                    # since_ns 0 is no bound (proto3's unset), not the epoch: a record of a
                    # clock before 1970 (ts_ns < 0) is still read.
                    if record_id <= f.after or (f.since_ns and ts_ns < f.since_ns):
                        continue
                    if (
                        record_kind == "event"
                        and f.req
                        and not _event_matches(body, f, steps.get(node), record_id)
                    ):
                        continue
                    yield record_id, record_kind, body
                    left -= 1
                    if not left:
                        return
                    continue
                span = steps.get(node)
                for i, data in enumerate(run_events(body)):
                    if record_id + i <= f.after or (
                        inspect and not _event_matches(data, f, span, record_id + i)
                    ):
                        continue
                    yield record_id + i, "event", data
                    left -= 1
                    if not left:
                        return


def _event_matches(data: bytes, f: Filter, span: Span | None, event_id: int) -> bool:
    """Whether an event (of a run, or a record of its own) passes the filter's time, tenant and
    request: indexed for the request, or a step naming it within its `span` on the event's node."""
    event = pb.Event.FromString(data)
    if (f.since_ns and event.ts_ns < f.since_ns) or (f.until_ns and event.ts_ns > f.until_ns):
        return False
    own, own_tenant, others = names(event)
    if f.req and event.WhichOneof("payload") == "step" and event.step.handles:  # by the handle of its span
        if span is None or not span.handle or span.handle not in event.step.handles:
            return False
    elif (f.tenant and own_tenant != f.tenant) or (f.req and f.req != own and f.req not in others):
        return False
    if f.tenant and own_tenant != f.tenant:
        return False
    if not f.req or event.WhichOneof("payload") != "step":
        return True
    return span is not None and span.lo <= event_id and (span.hi is None or event_id <= span.hi)


def _checked_index(rows: Iterable[Any]) -> Iterator[tuple[int, str]]:
    """The rows of the index of named requests, each checked (RowError for a value edited in)."""
    for record_id, req in rows:
        if type(record_id) is not int or type(req) is not str:
            checked("named", f"the index row ({record_id!r}, {req!r})", {"record_id": record_id, "req": req})
        yield record_id, req


def verify(
    engine: Engine, seals: list[tuple[int, bytes]], keys: dict[int, bytes], given: bool
) -> tuple[bool, int, str]:
    """Walk the chain: (intact, records checked, what is wrong where). A sealed store is
    proven only with its audit key; a key given for a store that is not sealed proves
    nothing either (the seal may have been removed along with a rewrite). The index of
    named requests, outside the chain, is checked against the bodies it derives from (a
    row removed from it would hide a read launch from a request's timeline)."""
    if given and not seals:
        return (
            False,
            0,
            "an audit key was given but the chain is not sealed (never sealed, or the seal was removed)",
        )
    # Seal i covers its records up to the next seal's first record (a later seal made at
    # the same record replaces it).
    starts = [from_id for from_id, _ in seals] + [1 << 63]
    segment = -1  # the seal covering the record (-1: before any)
    prev, expected_id, n = GENESIS, 1, 0
    with (
        engine.connect() as conn,
        engine.connect() as side,
        conn.execution_options(stream_results=True, yield_per=2000).execute(
            select(records).order_by(records.c.id)
        ) as result,
        side.execution_options(stream_results=True, yield_per=2000).execute(
            select(named.c.record_id, named.c.req).order_by(named.c.record_id)
        ) as named_rows,
    ):
        index = _checked_index(named_rows)
        try:
            pending = next(index, None)
            for row in result:
                v = checked("records", f"record {row.id}", dict(row._mapping))
                if v["id"] != expected_id:
                    return False, n, f"record {expected_id} is missing (next is {v['id']})"
                if v["prev_hash"] != prev:
                    return False, n, f"record {v['id']}: the chain is broken before it"
                while v["id"] >= starts[segment + 1]:
                    segment += 1
                key = keys.get(segment)
                if segment >= 0 and key is None:
                    return (
                        False,
                        n,
                        f"records from {starts[segment]} on are sealed with an audit key not given: "
                        "proving them needs it",
                    )
                if chain(prev, v["id"], [v[name] for name in COLUMNS], v["body"], key) != v["hash"]:
                    return False, n, f"record {v['id']} ({v['kind']} of {v['node']}) was altered"
                listed = []
                while pending is not None and pending[0] <= v["id"]:
                    listed.append((pending[0], pending[1]))
                    pending = next(index, None)
                listed.sort()
                # (named_with_steps: a store written while steps were indexed)
                if listed != [(v["id"], req) for req in named_of(v["kind"], v["body"])] and listed != [
                    (v["id"], req) for req in named_with_steps(v["kind"], v["body"])
                ]:
                    return False, n, f"record {v['id']}: the index of the requests it names was altered"
                ids = run_ids(v["kind"], v["body"])
                if v["kind"] == "events" and ids < 2:
                    return False, n, f"record {v['id']}: a run of {ids} events"
                prev, expected_id, n = v["hash"], expected_id + ids, n + ids
        except RowError as exc:  # a value its column cannot hold: edited outside kvguard
            return False, n, str(exc)
        except DecodeError as exc:  # a body rewritten, its hash recomputed (a chain not sealed)
            return False, n, f"record {v['id']}: its body is not a {v['kind']} record ({exc})"
    if pending is not None:
        return False, n, f"the index of named requests lists record {pending[0]}, past the last record"
    return True, n, ""


class ReceiptFacts(NamedTuple):
    """What the store says of a request when its receipt is issued: the findings that name it
    ((record id, finding), in order) and its newest receipt ((record id, body) or None)."""

    findings: list[tuple[int, pb.Finding]]
    latest: tuple[int, bytes] | None


def receipt_facts(engine: Engine, reqs: Collection[str]) -> dict[str, ReceiptFacts]:
    """The findings naming each of `reqs` and each one's newest receipt: two queries for them
    all (the signer's batch)."""
    wanted = sorted(set(reqs))
    out = {req: ReceiptFacts([], None) for req in wanted}
    if not wanted:
        return out
    c = records.c
    victims = select(named.c.record_id).where(named.c.req.in_(wanted))
    findings = (
        select(c.id, c.body)
        .where((c.kind == "finding") & (c.req.in_(wanted) | c.id.in_(victims)))
        .order_by(c.id)
    )
    receipts = select(c.id, c.req, c.body).where((c.kind == "receipt") & c.req.in_(wanted)).order_by(c.id)
    with engine.connect() as conn:
        for record_id, body in conn.execute(findings):
            finding = pb.Finding.FromString(body)
            for req in {finding.req, finding.victim_req} & out.keys():
                out[req].findings.append((int(record_id), finding))
        for record_id, req, body in conn.execute(receipts):
            out[req] = out[req]._replace(latest=(int(record_id), body))
    return out


def record_hashes(engine: Engine, ids: Collection[int]) -> dict[int, bytes]:
    """For each id of `ids` the store holds, the chain hash of the record that holds it (a
    run of events holds its events' ids): one read of the rows they span."""
    if not ids:
        return {}
    c = records.c
    wanted = sorted(ids)
    with engine.connect() as conn:
        first = holding(conn, wanted[0])
        rows = conn.execute(
            select(c.id, c.hash).where((c.id >= first) & (c.id <= wanted[-1])).order_by(c.id)
        ).all()
    starts = [int(i) for i, _ in rows]
    out = {}
    for i in wanted:
        at = bisect.bisect_right(starts, i) - 1
        if at >= 0:
            out[i] = bytes(rows[at][1])
    return out


def first_event(engine: Engine, nodes: Collection[str]) -> int:
    """The id of the first record of events of any of `nodes` (0: none)."""
    c = records.c
    query = select(func.min(c.id)).where(c.kind.in_(EVENT_KINDS) & c.node.in_(list(nodes)))
    with engine.connect() as conn:
        found = conn.execute(query).scalar()
    return int(found) if found is not None else 0


def newest_of(engine: Engine, kind: str, n: int, nodes: Collection[str] | None = None) -> list[bytes]:
    """The bodies of the newest `n` records of `kind` (not events; of `nodes`, if given), newest first."""
    c = records.c
    query = select(c.body).where(c.kind == kind).order_by(c.id.desc()).limit(n)
    if nodes is not None:
        query = query.where(c.node.in_(list(nodes)))
    with engine.connect() as conn:
        return [bytes(body) for (body,) in conn.execute(query)]


def events_of_kinds(
    engine: Engine, after: int, kinds: Collection[int], nodes: Collection[str] | None = None
) -> Iterator[tuple[int, str, int, bytes]]:
    """(id, node, payload, bytes) of each stored event after id `after` whose payload is one
    of `kinds` (wire.PAYLOAD numbers), in order: found by their heads, parsed by none."""
    wanted = np.array(sorted(kinds), np.int64)
    for record_id, node, batch, skip in _event_records(engine, after, None, nodes):
        kinds_of = batch.heads["kind"]
        hits = np.flatnonzero(np.isin(kinds_of[skip:], wanted)) + skip
        for i in hits.tolist():
            yield record_id + i, node, int(kinds_of[i]), batch.event(i)
