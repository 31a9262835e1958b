"""The audit store's rows (`Record`): what is appended for each event, run of events, finding
and command, built from what the daemon already read of them (the heads of a batch, proto/wire.py).

Invariants: the consecutive events of a batch are stored as one record (kind `events`, a
run: its body their EventBatch, as they lie in the batch received, its id the first event's,
and one id per event); a run's events lie within RUN_SPAN_NS of its `ts_ns` and are at most
RUN_MAX; every request a record names beyond its `req` is in `named` (indexed), except the
requests of a `step` (a forward pass names its whole batch: indexing it cost a row per request
a step, most of the writer's time in a decode fleet): a step is found by the request's span on
its node (reads.py). The rows of the common events are split in C (daemon/_rows.c); any other
run the same way in Python.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from kvguard.daemon import _rows
from kvguard.ledger import Finding
from kvguard.proto import pb, wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.limits import SEQ_MAX

RUN_SPAN_NS = 1_000_000_000  # a run's events lie in [ts_ns, ts_ns + this]: time filters stay indexed
RUN_MAX = 1 << 16  # events in a run at most (a batch holds no more)
REFUSAL_BYTES = 1 << 16  # of a refused event's bytes, kept in its record

_PAYLOADS = pb.Event.DESCRIPTOR.oneofs_by_name["payload"].fields
# Which payloads carry the indexed columns (a getattr with a default is slow where it misses).
_HAS_REQ = frozenset(f.name for f in _PAYLOADS if "req" in f.message_type.fields_by_name)
_HAS_TENANT = frozenset(f.name for f in _PAYLOADS if "tenant" in f.message_type.fields_by_name)


class Record(NamedTuple):
    """One row to append. `body` is the serialized protobuf (Event, Finding, Command,
    Refusal or Action). A tuple: one is built per event, on the store writer's hot path."""

    kind: str  # event, events (a run), finding, command, refused, action
    node: str
    seq: int
    ts_ns: int
    body: bytes
    req: str = ""
    tenant: str = ""
    victim_tenant: str = ""
    finding: str = ""
    severity: str = ""
    named: tuple[str, ...] = ()  # the other requests it names (indexed in `named`)
    ids: int = 1  # the ids it takes: a run's events

    @staticmethod
    def of_event(event: pb.Event, body: bytes | None = None) -> Record:
        """The row of an event; `body` is its bytes as received, when the caller has them."""
        return Record.of_head(_event_head(event), body if body is not None else event.SerializeToString())

    @staticmethod
    def of_head(head: EventHead, body: bytes) -> Record:
        """The row of an event known by its head and its bytes."""
        node, seq, ts_ns, req, tenant, others = head
        return Record("event", node, seq, ts_ns, body, req, tenant, named=others)

    @staticmethod
    def of_run(heads: Sequence[EventHead], bodies: Sequence[bytes]) -> Record:
        """The row of consecutive events of one node (two or more, within RUN_SPAN_NS of the
        first, none earlier), `bodies` their bytes as received."""
        first = heads[0]
        data = svc.RawEventBatch(events=bodies).SerializeToString()
        named = _run_named(heads)
        return Record("events", first.node, first.seq, first.ts_ns, data, named=named, ids=len(heads))

    @staticmethod
    def of_refusal(
        node: str, epoch: int, seq: int, ts_ns: int, kind: str, reason: str, event: bytes
    ) -> Record:
        """The row of an event the daemon refused (`kind`: the counter it went to), on the
        stream of `node`: its first REFUSAL_BYTES kept as evidence, its size and the SHA-256 of
        all of it (so a copy of it held elsewhere can be matched); a seq or time the store cannot
        hold is 0 in the columns (the bytes still carry it)."""
        body = svc.Refusal(
            kind=kind,
            reason=reason,
            epoch=epoch,
            event=event[:REFUSAL_BYTES],
            size=len(event),
            sha256=hashlib.sha256(event).digest(),
        ).SerializeToString()
        seq = seq if 0 <= seq <= SEQ_MAX else 0
        return Record("refused", node, seq, ts_ns if -SEQ_MAX <= ts_ns <= SEQ_MAX else 0, body)

    @staticmethod
    def of_command(node: str, command: svc.Command, ts_ns: int, req: str = "") -> Record:
        """The row of a command to `node` (its id in the seq column)."""
        return Record("command", node, command.id, ts_ns, command.SerializeToString(), req)

    @staticmethod
    def of_action(action: svc.Action, node: str) -> Record:
        """The row of an operator's action, as the daemon filled it in: `node` the node it is
        about ("" for none), its kill's request in the req column."""
        req = action.kill.req if action.HasField("kill") else ""
        return Record("action", node, 0, action.ts_ns, action.SerializeToString(), req)

    @staticmethod
    def of_finding(finding: Finding) -> Record:
        return Record(
            "finding",
            finding.node,
            finding.seq,
            finding.ts_ns,
            finding.to_proto().SerializeToString(),
            finding.req,
            finding.tenant,
            finding.victim_tenant,
            finding.finding,
            finding.severity,
            _victim_named(finding.req, finding.victim_req),
        )


def indexed(event: pb.Event) -> tuple[str, str, tuple[str, ...]]:
    """An event's index columns: its request (a read launch's first), its tenant, and the other
    requests it names (in `named`). A step is not indexed by its requests: ("", "", ())."""
    kind = event.WhichOneof("payload") or ""
    if kind == "read":
        reads = event.read.reads
        first = reads[0].req if reads else ""  # the others go to `named`
        return first, "", _read_others(reads) if len(reads) > 1 else ()
    if not kind or kind == "step":
        return "", "", ()
    payload = getattr(event, kind)
    return (payload.req if kind in _HAS_REQ else ""), (payload.tenant if kind in _HAS_TENANT else ""), ()


def names(event: pb.Event) -> tuple[str, str, tuple[str, ...]]:
    """What an event names, as `indexed` spells it: the same, but a step names its batch's
    requests (each once, sorted, as the others: it has no request of its own)."""
    if event.WhichOneof("payload") == "step":
        return "", "", tuple(sorted(set(event.step.reqs) - {""}))
    return indexed(event)


class EventHead(NamedTuple):
    """What the store indexes of an event: its header and index columns."""

    node: str
    seq: int
    ts_ns: int
    req: str
    tenant: str
    others: tuple[str, ...]


def _head(body: bytes) -> EventHead:
    """An accepted event's head, from its bytes: the common events (alloc, write, free, a
    one-entry read: no tenant, no other request) read straight from them, as the ledger
    reads them; any other parsed."""
    hot = wire.event_head(body)
    if hot is not None:
        return EventHead(hot[1], hot[2], hot[3], hot[4], "", ())
    return _event_head(pb.Event.FromString(body))


def _event_head(event: pb.Event) -> EventHead:
    return EventHead(event.node, event.seq, event.ts_ns, *indexed(event))


def _run_named(heads: Iterable[EventHead]) -> tuple[str, ...]:
    """Every request the events of a run name, each once (indexed in `named`)."""
    names: set[str] = set()
    for head in heads:
        names.add(head.req)
        names.update(head.others)
    names.discard("")
    return tuple(sorted(names))


def run_events(body: bytes) -> Sequence[bytes]:
    """The events' bytes of a run's body."""
    return svc.RawEventBatch.FromString(body).events


def run_ids(kind: str, body: bytes) -> int:
    """The ids a stored record takes: a run's events, else one."""
    return len(run_events(body)) if kind == "events" else 1


def _victim_named(req: str, victim: str) -> tuple[str, ...]:
    """A finding's victim, when it names one besides its own request (indexed in `named`)."""
    return (victim,) if victim and victim != req else ()


def _read_others(reads: Sequence[pb.ReadEntry]) -> tuple[str, ...]:
    """The requests of a read launch after its first (indexed in `named`), each once."""
    first = reads[0].req
    return tuple(sorted({e.req for e in reads} - {first, ""}))


def named_of(kind: str, body: bytes) -> tuple[str, ...]:
    """What a stored record names beyond its `req` column, from its body: the `named` rows it
    must have (the writer's Record.named, recomputed)."""
    if kind == "event":
        return indexed(pb.Event.FromString(body))[2]
    if kind == "events":
        return _run_named(_head(e) for e in run_events(body))
    if kind == "finding":
        f = pb.Finding.FromString(body)
        return _victim_named(f.req, f.victim_req)
    return ()


def named_with_steps(kind: str, body: bytes) -> tuple[str, ...]:
    """named_of as the writer indexed a record before steps were left out of the index (a
    step's first request its `req`, the others named): stores written then hold these rows,
    which still read right (a step is also in its requests' spans) and verify."""
    bodies = [body] if kind == "event" else run_events(body) if kind == "events" else []
    steps = [e.step.reqs for e in map(pb.Event.FromString, bodies) if e.WhichOneof("payload") == "step"]
    if not steps:
        return named_of(kind, body)
    found = set(named_of(kind, body))
    for reqs in steps:
        found.update(reqs)
    if kind == "event":
        found.discard(steps[0][0] if steps[0] else "")
    found.discard("")
    return tuple(sorted(found))


class EventRun(NamedTuple):
    """Events [start, stop) of the batch `batch` (an index into the group's batches): the
    daemon names the events it accepted this way instead of building their rows, which the
    store's writer does on its own core."""

    batch: int
    start: int
    stop: int


def rows_of(batches: Sequence[wire.Batch], parts: Sequence[Record | EventRun]) -> list[Record]:
    """The rows of a group: each EventRun as run records (its events' bytes as they arrived;
    a new run where an event's time falls outside the run's span; a lone event as an event
    record), Records as they are. `batches` are the batches as the daemon read them (their
    heads read once, on receipt); only the accepted events are used (a refused one may not
    even be an event)."""
    rows: list[Record] = []
    for part in parts:
        if isinstance(part, EventRun):
            rows += run_rows(batches[part.batch], part.start, part.stop)
        else:
            rows.append(part)
    return rows


def run_rows(batch: wire.Batch, start: int, stop: int) -> list[Record]:
    """The rows of consecutive accepted events of one node, batch[start:stop]: the common
    events (alloc, write, free, a one-entry read) split in C from their heads (`_rows.c`),
    any other shape through _parsed_run_rows, the same rows."""
    split = _rows.split_runs(batch.data, batch.heads, start, stop, RUN_SPAN_NS, RUN_MAX)
    if split is None:
        return _parsed_run_rows([batch.event(i) for i in range(start, stop)])
    rows = []
    for first, last, node, seq, ts_ns, req, names, body in split:
        if last - first == 1:
            rows.append(Record("event", node, seq, ts_ns, body, req))
        else:
            if body is None:  # its events do not lie back to back in the batch's bytes
                body = svc.RawEventBatch(
                    events=[batch.event(i) for i in range(first, last)]
                ).SerializeToString()
            rows.append(Record("events", node, seq, ts_ns, body, named=names, ids=last - first))
    return rows


def _parsed_run_rows(bodies: Sequence[bytes]) -> list[Record]:
    """run_rows from each event's head (`_head`: in C where it can, else protobuf's parse)."""
    rows: list[Record] = []
    heads = [_head(body) for body in bodies]
    start, stop_at = 0, len(heads)
    while start < stop_at:
        t0 = heads[start].ts_ns
        stop = start + 1
        last = min(stop_at, start + RUN_MAX)
        while stop < last and t0 <= heads[stop].ts_ns <= t0 + RUN_SPAN_NS:
            stop += 1
        if stop - start == 1:
            rows.append(Record.of_head(heads[start], bodies[start]))
        else:
            rows.append(Record.of_run(heads[start:stop], bodies[start:stop]))
        start = stop
    return rows
