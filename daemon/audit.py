"""`kvguard audit query | request | exposure`: read the audit log, from the store or the daemon.

- `query`: the records that match a filter, as an aligned table or JSON Lines (one object per
  record: `id`, `kind` and the record itself, the protobuf JSON mapping with proto field names,
  under `event`, `finding` or `command`, i.e. the JSON form of `kvguard.v1.AuditRecord`).
- `request ID`: the timeline of one request across nodes, in record order: its events
  (including `read` launches that list it in any entry), the findings naming it as offender or
  as victim, and the commands sent for it.
- `exposure --tenant T`: the blast radius of a leak for one tenant: from the findings whose
  victim is T and whose offender is another tenant, which requests of which tenants read (or
  received, or overwrote) T's KV, when, and what was done about it.

Every command reads from exactly one source: `--store` (a SQLAlchemy URL or a SQLite file path)
or `--daemon host:port` (`AuditService.Query`). Invariants: this module only reads the audit
log (a store path that does not exist, or a database without the `records` table, is refused
before `Store()` could create anything; `Store()` still brings an older schema to the newest
revision); both sources give the same output, built from the record bodies only (never from
index columns a daemon does not serve), except the body of a command, which a daemon serves
only once AuditRecord carries one; records always come out in record (id) order.

Exit codes: 0 nothing found (no finding names the request, no exposure; `query` always 0),
1 findings / exposure, 2 unusable input or an unreachable source.

TIME arguments (`--since`, `--until`) take integer nanoseconds of the events' `ts_ns` clock, or
an ISO-8601 timestamp (a naive one is UTC), converted to nanoseconds since the Unix epoch. The
ISO form is only meaningful when the nodes stamp events with wall-clock time: the testbed and
many engines use a monotonic clock, whose nanoseconds are not dates. The TIME column shows
ts_ns as a UTC date when it is after 2000-01-01 as wall-clock time, else as plain nanoseconds.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, NamedTuple, Protocol, TextIO

import orjson
from google.protobuf.message import Message

from kvguard.daemon.tls import Tls, TlsError
from kvguard.daemon.tls import add_arguments as tls_arguments
from kvguard.daemon.tls import channel as daemon_channel
from kvguard.daemon.tls import from_args as tls_from_args
from kvguard.proto import pb
from kvguard.proto.capture import message_to_dict
from kvguard.proto.kvguard.v1 import services_pb2 as svc

DEFAULT_STORE = "kvguard-audit.db"
KINDS = ("event", "finding", "command")
WALL_CLOCK_FLOOR_NS = 946_684_800 * 10**9  # 2000-01-01T00:00:00Z
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MAX_INT64 = (1 << 63) - 1
_MAX_UINT32 = (1 << 32) - 1
# What the offender did to the victim's KV, by finding kind (the verb of the exposure report).
VERBS: dict[str, str] = {
    "stale_read": "read",
    "foreign_read": "read",
    "use_after_free": "read",
    "cross_tenant_share": "read",
    "early_release": "received",
    "transfer_mismatch": "received",
    "late_write": "overwrote",
    "double_free": "freed",
}
STOPPING_ACTIONS = frozenset({"deny", "block"})  # the request was refused, not terminated

Body = pb.Event | pb.Finding | svc.Command


class UsageError(Exception):
    """Unusable input: the message names the input; exit code 2."""


# ---------------------------------------------------------------------------------------- records


@dataclass(frozen=True, slots=True)
class AuditItem:
    """One record of the log: its id, kind and decoded body. `body` is None only for a command
    read from a daemon whose AuditRecord has no command body; then `req_hint` is the request
    the query asked for (the daemon matched it on the command's indexed request)."""

    id: int
    kind: str
    body: Body | None
    req_hint: str = ""

    def to_json_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "kind": self.kind}
        if self.body is not None:
            out[self.kind] = message_to_dict(self.body)
        return out


@dataclass(frozen=True, slots=True)
class Filters:
    """The fields of kvguard.v1.AuditQuery, which are the filters of Store.rows(): same names."""

    kind: str = ""
    tenant: str = ""
    req: str = ""
    node: str = ""
    finding: str = ""
    since_ns: int = 0
    until_ns: int = 0
    limit: int = 0


class Source(Protocol):
    """Where the records come from: a store or a daemon. Every method yields in id order."""

    label: str

    def records(self, f: Filters) -> Iterator[AuditItem]: ...

    def reads_listing(self, req: str) -> Iterator[AuditItem]:
        """`read` events with an entry of `req` (at least those not indexed under `req`)."""
        ...

    def findings_with_victim(self, req: str) -> Iterator[AuditItem]:
        """Findings whose victim_req is `req`."""
        ...

    def close(self) -> None: ...


def _decode(kind: str, body: bytes) -> Body:
    if kind == "event":
        return pb.Event.FromString(body)
    if kind == "finding":
        return pb.Finding.FromString(body)
    return svc.Command.FromString(body)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _string_field(number: int, text: str) -> bytes:
    """The exact wire bytes of a string field (length-delimited): a prefilter needle."""
    data = text.encode()
    return _varint(number << 3 | 2) + _varint(len(data)) + data


_READ_FIELD = pb.Event.DESCRIPTOR.fields_by_name["read"].number
_ENTRY_REQ = pb.ReadEntry.DESCRIPTOR.fields_by_name["req"].number
_VICTIM_REQ = pb.Finding.DESCRIPTOR.fields_by_name["victim_req"].number


def _read_varint(body: bytes, i: int) -> tuple[int, int]:
    """(the varint at body[i], the index after it); IndexError if it runs off the end."""
    value = shift = 0
    while True:
        b = body[i]
        i += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if b < 0x80:
            return value, i


def _has_top_field(body: bytes, number: int) -> bool:
    """Whether a serialized message has top-level field `number`, by walking its tags without
    decoding it; True when the bytes cannot be walked (then the caller decodes to be sure)."""
    i, n = 0, len(body)
    try:
        while i < n:
            tag, i = _read_varint(body, i)
            if tag >> 3 == number:
                return True
            wire = tag & 7
            if wire == 0:
                _, i = _read_varint(body, i)
            elif wire == 1:
                i += 8
            elif wire == 5:
                i += 4
            elif wire == 2:
                length, i = _read_varint(body, i)
                i += length
            else:
                return True
    except IndexError:
        return True
    return False


def _lists_reader(event: pb.Event, req: str) -> bool:
    return event.WhichOneof("payload") == "read" and any(e.req == req for e in event.read.reads)


class StoreSource:
    """The audit store itself (read only)."""

    def __init__(self, where: str) -> None:
        from sqlalchemy import create_engine, inspect
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        from kvguard.daemon.store import Store, store_url

        url = store_url(where)
        try:
            parsed = make_url(url)
        except ArgumentError:
            raise UsageError(f"--store {where!r} is neither a SQLAlchemy URL nor a file path") from None
        database = parsed.database or ""
        local = parsed.drivername.startswith("sqlite") and database not in ("", ":memory:")
        if local and not database.startswith("file:"):
            path = Path(database)
            if not path.exists():
                raise UsageError(f"no audit store at {where} (no such file)")
            if not path.is_file():
                raise UsageError(f"audit store {where} is not a file")
        try:
            probe = create_engine(url)
            try:
                has_records = inspect(probe).has_table("records")
            finally:
                probe.dispose()
        except Exception as exc:  # driver missing, not a database, unreachable server
            raise UsageError(f"cannot open audit store {where}: {_first_line(exc)}") from None
        if not has_records:
            raise UsageError(f"{where} is not a kvguard audit store (no records table)")
        try:
            self.store = Store(where)
        except Exception as exc:
            raise UsageError(f"cannot open audit store {where}: {_first_line(exc)}") from None
        self.label = where

    def records(self, f: Filters) -> Iterator[AuditItem]:
        for record_id, kind, body in self.store.rows(**asdict(f)):
            yield AuditItem(record_id, kind, _decode(kind, body))

    def _scan(self, kind: str, req: str) -> Iterator[tuple[int, bytes]]:
        from sqlalchemy import select

        from kvguard.daemon.store import records

        c = records.c
        query = select(c.id, c.body).where(c.kind == kind, c.req != req).order_by(c.id)
        with self.store.engine.connect() as conn:
            yield from conn.execution_options(stream_results=True, yield_per=2000).execute(query)

    def reads_listing(self, req: str) -> Iterator[AuditItem]:
        # The index holds one request per record, so a read launch that lists `req` in a later
        # entry (or whose index entry is empty) is found only in the bodies: scan the events not
        # indexed under `req`, but decode only those whose bytes hold a read payload and the
        # exact encoding of `req` as an entry's request.
        needle = _string_field(_ENTRY_REQ, req)
        for record_id, body in self._scan("event", req):
            if needle in body and _has_top_field(body, _READ_FIELD):
                event = pb.Event.FromString(body)
                if _lists_reader(event, req):
                    yield AuditItem(record_id, "event", event)

    def findings_with_victim(self, req: str) -> Iterator[AuditItem]:
        needle = _string_field(_VICTIM_REQ, req)
        for record_id, body in self._scan("finding", req):
            if needle in body:
                finding = pb.Finding.FromString(body)
                if finding.victim_req == req:
                    yield AuditItem(record_id, "finding", finding)

    def close(self) -> None:
        self.store.close()


_RECORD_BODIES = frozenset(f.name for f in svc.AuditRecord.DESCRIPTOR.oneofs_by_name["body"].fields)


class DaemonSource:
    """A running daemon's AuditService."""

    def __init__(self, address: str, tls: Tls | None = None) -> None:
        from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc

        host, sep, port = address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise UsageError(f"--daemon {address!r} is not host:port")
        self.label = address
        self.channel = daemon_channel(address, tls)
        self.stub = svc_grpc.AuditServiceStub(self.channel)

    def records(self, f: Filters) -> Iterator[AuditItem]:
        for record in self.stub.Query(svc.AuditQuery(**asdict(f))):
            which = record.WhichOneof("body")
            body = getattr(record, which) if which else None
            yield AuditItem(record.id, record.kind, body, f.req if body is None else "")

    def reads_listing(self, req: str) -> Iterator[AuditItem]:
        # AuditQuery matches one indexed request per record: every event has to come over the
        # wire to find the read launches that list `req` after another request.
        for item in self.records(Filters(kind="event")):
            if isinstance(item.body, pb.Event) and _lists_reader(item.body, req):
                yield item

    def findings_with_victim(self, req: str) -> Iterator[AuditItem]:
        for item in self.records(Filters(kind="finding")):
            if isinstance(item.body, pb.Finding) and item.body.victim_req == req:
                yield item

    def close(self) -> None:
        self.channel.close()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def open_source(store: str | None, daemon: str | None, tls: Tls | None = None) -> Source:
    """The one source the arguments name (the default store when neither is given)."""
    if store is not None and daemon is not None:
        raise UsageError(f"give --store ({store}) or --daemon ({daemon}), not both")
    if daemon is not None:
        return DaemonSource(daemon, tls)
    return StoreSource(store if store is not None else DEFAULT_STORE)


# ---------------------------------------------------------------------------------------- time


def parse_time(text: str, option: str = "TIME") -> int:
    """Integer nanoseconds, or an ISO-8601 timestamp (naive: UTC) as nanoseconds since the epoch.
    UsageError naming the option and the value if it is neither."""
    value = text.strip()
    if re.fullmatch(r"\d+", value):
        ns = int(value)
        if ns > _MAX_INT64:
            raise UsageError(f"{option} {text!r} is out of range (at most {_MAX_INT64} ns)")
        return ns
    frac_ns = 0
    match = re.fullmatch(r"(.*T\d\d:\d\d:\d\d)[.,](\d+)(.*)", value)
    if match:
        value = match.group(1) + match.group(3)
        frac_ns = int(match.group(2)[:9].ljust(9, "0"))
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        raise UsageError(
            f"{option} {text!r} is not a time: give integer nanoseconds or an ISO-8601 timestamp "
            "such as 2026-03-01T12:00:00Z"
        ) from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    seconds = (when - _EPOCH) // timedelta(seconds=1)
    if seconds < 0:
        raise UsageError(f"{option} {text!r} is before 1970-01-01")
    return seconds * 10**9 + frac_ns


def format_time(ts_ns: int) -> str:
    """ts_ns for people: a UTC date if it reads as wall-clock time, else nanoseconds."""
    if ts_ns >= WALL_CLOCK_FLOOR_NS:
        seconds, ns = divmod(ts_ns, 10**9)
        when = _EPOCH + timedelta(seconds=seconds)
        return f"{when:%Y-%m-%dT%H:%M:%S}.{ns:09d}Z"
    return str(ts_ns) if ts_ns else ""


# ---------------------------------------------------------------------------------------- rendering


def page_ranges(pages: Iterable[int]) -> str:
    """[1, 2, 3, 4, 7, 3] -> '1-4,7,3': ascending runs compressed, order kept."""
    parts: list[str] = []
    run: list[int] = []
    for page in pages:
        if run and page == run[-1] + 1:
            run.append(page)
            continue
        if run:
            parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
        run = [page]
    if run:
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    return ",".join(parts)


def _fields(msg: Message, skip: frozenset[str] = frozenset()) -> str:
    parts = []
    for fd, value in msg.ListFields():
        if fd.name in skip:
            continue
        if fd.is_repeated:
            values = list(value)
            if fd.name == "pages":
                text = page_ranges(values)
            elif len(values) > 8:
                text = f"[{len(values)} values]"
            else:
                text = ",".join(str(v) for v in values)
        else:
            text = str(value)
        parts.append(f"{fd.name}={text}")
    return " ".join(parts)


class Row(NamedTuple):
    """A record as the columns of the table."""

    id: str
    time: str
    kind: str
    node: str
    seq: str
    req: str
    tenant: str
    what: str
    message: str


HEADER = Row("ID", "TIME", "KIND", "NODE", "SEQ", "REQ", "TENANT", "WHAT", "MESSAGE")


def item_row(item: AuditItem) -> Row:
    body = item.body
    rid = str(item.id)
    if isinstance(body, pb.Event):
        payload = body.WhichOneof("payload") or ""
        p = getattr(body, payload) if payload else None
        if payload == "read":
            reqs = ",".join(dict.fromkeys(e.req for e in body.read.reads))
            what = "read " + "; ".join(f"{e.req} {_fields(e, frozenset({'req'}))}" for e in body.read.reads)
            return Row(rid, format_time(body.ts_ns), "event", body.node, str(body.seq), reqs, "", what, "")
        req = getattr(p, "req", "")
        tenant = getattr(p, "tenant", "")
        message = getattr(p, "reason", "") if payload in ("reject", "abort") else ""
        what = f"{payload} {_fields(p, frozenset({'req', 'tenant', 'reason'}))}" if p is not None else ""
        return Row(
            rid,
            format_time(body.ts_ns),
            "event",
            body.node,
            str(body.seq),
            req,
            tenant,
            what.strip(),
            message,
        )
    if isinstance(body, pb.Finding):
        what = f"{body.finding} {body.severity}"
        if body.victim_req or body.victim_tenant:
            what += f" victim={body.victim_tenant or '?'}/{body.victim_req or '?'}"
        if body.HasField("pool"):
            what += f" pool={body.pool}"
        if body.pages:
            what += f" pages={page_ranges(body.pages)}"
        what += f" action={body.action or '-'}"
        return Row(
            rid,
            format_time(body.ts_ns),
            "finding",
            body.node,
            str(body.seq),
            body.req,
            body.tenant,
            what,
            body.message,
        )
    if isinstance(body, svc.Command):
        which = body.WhichOneof("body")
        if which == "kill":
            k = body.kill
            return Row(
                rid,
                "",
                "command",
                "",
                str(body.id),
                k.req,
                "",
                f"kill {k.req} for {k.finding} (rule {k.rule})",
                "",
            )
        if which == "quarantine":
            q = body.quarantine
            what = f"quarantine pool={q.pool} pages={page_ranges(q.pages)} for {q.finding}"
            return Row(rid, "", "command", "", str(body.id), "", "", what, "")
        return Row(rid, "", "command", "", str(body.id), "", "", "empty command", "")
    return Row(rid, "", item.kind, "", "", item.req_hint, "", "(the daemon does not serve this body)", "")


class Table:
    """Aligned columns, streamed: widths come from the header and the first `sample` rows; the
    last column (the message) is not padded."""

    def __init__(self, out: TextIO, sample: int = 1000) -> None:
        self.out = out
        self.sample = sample
        self.pending: list[Row] = []
        self.widths: list[int] | None = None
        self.count = 0

    def add(self, row: Row) -> None:
        self.count += 1
        if self.widths is None:
            self.pending.append(row)
            if len(self.pending) >= self.sample:
                self._start()
        else:
            self._write(row)

    def _start(self) -> None:
        rows = [HEADER, *self.pending]
        self.widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER) - 1)]
        for row in rows:
            self._write(row)
        self.pending = []

    def _write(self, row: Row) -> None:
        assert self.widths is not None
        cells = list(row)
        line = "  ".join(cell.ljust(w) for cell, w in zip(cells[:-1], self.widths, strict=True))
        self.out.write((line + "  " + cells[-1]).rstrip() + "\n")

    def close(self) -> None:
        if self.widths is None:
            self._start()


def _emit(items: Iterable[AuditItem], output: str, out: TextIO) -> int:
    if output == "json":
        n = 0
        for item in items:
            out.write(orjson.dumps(item.to_json_dict()).decode() + "\n")
            n += 1
        return n
    table = Table(out)
    for item in items:
        table.add(item_row(item))
    table.close()
    return table.count


# ---------------------------------------------------------------------------------------- request


def request_timeline(source: Source, req: str) -> list[AuditItem]:
    """Every record of request `req`, in record order: events (read launches listing it in any
    entry included), findings naming it as offender or victim, commands for it."""
    items: dict[int, AuditItem] = {}
    for item in source.records(Filters(req=req)):
        items[item.id] = item
    for item in source.reads_listing(req):
        items.setdefault(item.id, item)
    for item in source.findings_with_victim(req):
        items.setdefault(item.id, item)
    return [items[i] for i in sorted(items)]


# ---------------------------------------------------------------------------------------- exposure


@dataclass
class VictimPart:
    """What one offending request did to one victim request's pages on one node and pool."""

    victim_req: str
    node: str
    pool: int | None
    pages: set[int] = field(default_factory=set)
    findings: Counter[str] = field(default_factory=Counter)
    actions: set[str] = field(default_factory=set)
    first_ts_ns: int = 0
    last_ts_ns: int = 0
    record_ids: list[int] = field(default_factory=list)


@dataclass
class Offender:
    """One request of another tenant that reached the victim tenant's KV."""

    tenant: str
    req: str
    parts: dict[tuple[str, str, int | None], VictimPart] = field(default_factory=dict)
    kill_commands: int = 0
    kill_events: list[str] = field(default_factory=list)  # who killed it locally (guard@node)
    first_kill_record: int = 0  # the record id of the first kill command or kill event

    @property
    def findings(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for part in self.parts.values():
            total.update(part.findings)
        return total

    @property
    def actions(self) -> list[str]:
        return sorted({a for part in self.parts.values() for a in part.actions})

    @property
    def first_ts_ns(self) -> int:
        return min(p.first_ts_ns for p in self.parts.values())

    @property
    def last_ts_ns(self) -> int:
        return max(p.last_ts_ns for p in self.parts.values())

    @property
    def outcome(self) -> str:
        """killed (a kill command or a guard's kill), stopped (denied or blocked), unchecked."""
        if self.kill_commands or self.kill_events:
            return "killed"
        if STOPPING_ACTIONS & set(self.actions):
            return "stopped"
        return "unchecked"

    def add(self, record_id: int, f: pb.Finding) -> None:
        pool = f.pool if f.HasField("pool") else None
        key = (f.victim_req, f.node, pool)
        part = self.parts.get(key)
        if part is None:
            part = self.parts[key] = VictimPart(f.victim_req, f.node, pool, first_ts_ns=f.ts_ns)
        part.pages.update(f.pages)
        part.findings[f.finding] += 1
        if f.action:
            part.actions.add(f.action)
        part.first_ts_ns = min(part.first_ts_ns, f.ts_ns)
        part.last_ts_ns = max(part.last_ts_ns, f.ts_ns)
        part.record_ids.append(record_id)

    def to_json_dict(self, victim_tenant: str) -> dict[str, Any]:
        return {
            "type": "exposure",
            "tenant": victim_tenant,
            "offender_tenant": self.tenant,
            "req": self.req,
            "findings": dict(sorted(self.findings.items())),
            "actions": self.actions,
            "first_ts_ns": self.first_ts_ns,
            "last_ts_ns": self.last_ts_ns,
            "kill_commands": self.kill_commands,
            "kill_events": self.kill_events,
            "first_kill_record": self.first_kill_record,
            "outcome": self.outcome,
            "victims": [
                {
                    "victim_req": p.victim_req,
                    "node": p.node,
                    **({"pool": p.pool} if p.pool is not None else {}),
                    "pages": sorted(p.pages),
                    "findings": dict(sorted(p.findings.items())),
                    "actions": sorted(p.actions),
                    "first_ts_ns": p.first_ts_ns,
                    "last_ts_ns": p.last_ts_ns,
                    "record_ids": p.record_ids,
                }
                for p in self.parts.values()
            ],
        }


@dataclass
class Exposure:
    """The exposure of one tenant: offending requests grouped by tenant, in order of first finding."""

    tenant: str
    since_ns: int = 0
    until_ns: int = 0
    offenders: dict[tuple[str, str], Offender] = field(default_factory=dict)
    findings_seen: int = 0

    def add(self, record_id: int, f: pb.Finding) -> None:
        self.findings_seen += 1
        if f.victim_tenant != self.tenant or f.tenant == self.tenant:
            return
        key = (f.tenant, f.req)
        offender = self.offenders.get(key)
        if offender is None:
            offender = self.offenders[key] = Offender(f.tenant, f.req)
        offender.add(record_id, f)

    def by_tenant(self) -> dict[str, list[Offender]]:
        groups: dict[str, list[Offender]] = defaultdict(list)
        for offender in self.offenders.values():
            groups[offender.tenant].append(offender)
        return dict(groups)

    def verbs(self) -> str:
        kinds = {k for o in self.offenders.values() for k in o.findings}
        verbs = list(dict.fromkeys(VERBS.get(k, "touched") for k in sorted(kinds, key=_verb_rank)))
        if len(verbs) <= 1:
            return verbs[0] if verbs else "read"
        return ", ".join(verbs[:-1]) + " or " + verbs[-1]

    def window(self) -> str:
        if self.since_ns and self.until_ns:
            return f" between {format_time(self.since_ns)} and {format_time(self.until_ns)}"
        if self.since_ns:
            return f" since {format_time(self.since_ns)}"
        if self.until_ns:
            return f" until {format_time(self.until_ns)}"
        return ""

    def summary(self) -> str:
        t = self.tenant
        if not self.offenders:
            return f"{t}: no request of another tenant reached {t}'s KV{self.window()} (0 exposures)."
        groups = self.by_tenant()
        n = len(self.offenders)
        outcomes = Counter(o.outcome for o in self.offenders.values())
        tenants = ", ".join(g or "unknown tenant" for g in groups)
        text = (
            f"{t}: {n} request{'s' if n != 1 else ''} of {len(groups)} other tenant"
            f"{'s' if len(groups) != 1 else ''} ({tenants}) {self.verbs()} {t}'s KV{self.window()}; "
            f"{outcomes['killed']} {'was' if outcomes['killed'] == 1 else 'were'} killed, "
        )
        if outcomes["stopped"]:
            text += (
                f"{outcomes['stopped']} {'was' if outcomes['stopped'] == 1 else 'were'} denied or blocked, "
            )
        return text + f"{outcomes['unchecked']} went unchecked."

    def summary_json(self) -> dict[str, Any]:
        outcomes = Counter(o.outcome for o in self.offenders.values())
        return {
            "type": "summary",
            "tenant": self.tenant,
            "since_ns": self.since_ns,
            "until_ns": self.until_ns,
            "requests": len(self.offenders),
            "tenants": list(self.by_tenant()),
            "killed": outcomes["killed"],
            "stopped": outcomes["stopped"],
            "unchecked": outcomes["unchecked"],
            "text": self.summary(),
        }


def _verb_rank(kind: str) -> tuple[int, str]:
    order = ["read", "received", "overwrote", "freed"]
    verb = VERBS.get(kind, "touched")
    return (order.index(verb) if verb in order else len(order), kind)


def exposure_of(source: Source, tenant: str, since_ns: int = 0, until_ns: int = 0) -> Exposure:
    """The findings where `tenant` is the victim and another tenant the offender, grouped, with
    whether each offending request was killed (a daemon kill command or a guard's kill event)."""
    report = Exposure(tenant, since_ns, until_ns)
    for item in source.records(Filters(kind="finding", tenant=tenant, since_ns=since_ns, until_ns=until_ns)):
        if isinstance(item.body, pb.Finding):
            report.add(item.id, item.body)
    for offender in report.offenders.values():
        if not offender.req:
            continue
        for item in source.records(Filters(req=offender.req)):
            body = item.body
            if isinstance(body, svc.Command) and body.WhichOneof("body") == "kill":
                if body.kill.req != offender.req:
                    continue
                offender.kill_commands += 1
            elif isinstance(body, pb.Event) and body.WhichOneof("payload") == "kill" and body.kill.req:
                offender.kill_events.append(body.kill.by or body.node)
            else:
                continue
            offender.first_kill_record = offender.first_kill_record or item.id
    return report


def format_exposure(report: Exposure, out: TextIO) -> None:
    t = report.tenant
    if report.offenders:
        n = len(report.offenders)
        out.write(
            f"exposure of {t}{report.window()}: {n} request{'s' if n != 1 else ''} of other tenants "
            f"reached {t}'s KV\n"
        )
    for group, offenders in report.by_tenant().items():
        out.write(
            f"\n{group or 'unknown tenant'} ({len(offenders)} request{'s' if len(offenders) != 1 else ''})\n"
        )
        for o in offenders:
            if o.outcome == "killed":
                how = []
                if o.kill_commands:
                    how.append(f"{o.kill_commands} kill command{'s' if o.kill_commands != 1 else ''} sent")
                if o.kill_events:
                    how.append("killed by " + ", ".join(dict.fromkeys(o.kill_events)))
                outcome = "killed (" + "; ".join(how) + f"; the first at record {o.first_kill_record})"
            elif o.outcome == "stopped":
                outcome = (
                    "stopped (" + ", ".join(a for a in o.actions if a in STOPPING_ACTIONS) + "), not killed"
                )
            else:
                outcome = "UNCHECKED: no kill, no denial"
            span = format_time(o.first_ts_ns)
            if o.last_ts_ns != o.first_ts_ns:
                span += f" to {format_time(o.last_ts_ns)}"
            out.write(f"  {o.req or '?'}: {outcome}; action {', '.join(o.actions) or '-'}; at {span}\n")
            rows = []
            for p in o.parts.values():
                when = format_time(p.first_ts_ns)
                if p.last_ts_ns != p.first_ts_ns:
                    when += f" to {format_time(p.last_ts_ns)}"
                rows.append(
                    (
                        f"victim {p.victim_req or '?'}",
                        f"node {p.node or '?'}",
                        f"pool {p.pool}" if p.pool is not None else "pool -",
                        f"pages {page_ranges(sorted(p.pages)) or '-'}",
                        ", ".join(f"{k} x{c}" if c > 1 else k for k, c in sorted(p.findings.items())),
                        f"action {', '.join(sorted(p.actions)) or '-'}",
                        f"at {when}",
                        "records " + ",".join(map(str, p.record_ids)),
                    )
                )
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            for r in rows:
                out.write(
                    "    " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n"
                )
    if report.offenders:
        out.write("\n")
    out.write(report.summary() + "\n")


# ---------------------------------------------------------------------------------------- commands


def _source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--store",
        metavar="URL",
        help=f"SQLAlchemy URL, or a SQLite file path (default: {DEFAULT_STORE}, unless --daemon)",
    )
    p.add_argument("--daemon", metavar="ADDR", help="read from the daemon at host:port instead of a store")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    tls_arguments(p)


def _usage(prog: str, exc: Exception) -> int:
    print(f"{prog}: {exc}", file=sys.stderr)
    return 2


def _run(prog: str, args: argparse.Namespace, body: Callable[[Source], int]) -> int:
    import grpc
    from sqlalchemy.exc import SQLAlchemyError

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
    except SQLAlchemyError as exc:
        print(f"{prog}: reading audit store {source.label} failed: {_first_line(exc)}", file=sys.stderr)
        return 2
    finally:
        source.close()


def _times(args: argparse.Namespace) -> tuple[int, int]:
    since = parse_time(args.since, "--since") if args.since is not None else 0
    until = parse_time(args.until, "--until") if args.until is not None else 0
    if since and until and until < since:
        raise UsageError(f"--until {args.until!r} is before --since {args.since!r}")
    return since, until


def cmd_query(args: argparse.Namespace) -> int:
    """`kvguard audit query`: the matching records. Exit 0, or 2 on unusable input."""
    prog = "kvguard audit query"
    try:
        since, until = _times(args)
        if args.limit < 0 or args.limit > _MAX_UINT32:
            raise UsageError(f"--limit {args.limit} is not a count (0 to {_MAX_UINT32}; 0: no limit)")
    except UsageError as exc:
        return _usage(prog, exc)
    filters = Filters(
        kind=args.kind or "",
        tenant=args.tenant or "",
        req=args.req or "",
        node=args.node or "",
        finding=args.finding or "",
        since_ns=since,
        until_ns=until,
        limit=args.limit,
    )

    def body(source: Source) -> int:
        n = _emit(source.records(filters), args.output, sys.stdout)
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
        _emit(items, args.output, sys.stdout)
        sys.stdout.flush()
        events = [i.body for i in items if isinstance(i.body, pb.Event)]
        findings = [i.body for i in items if isinstance(i.body, pb.Finding)]
        tenants = {getattr(getattr(e, e.WhichOneof("payload") or ""), "tenant", "") for e in events} - {""}
        nodes = ", ".join(dict.fromkeys(e.node for e in events)) or "no node"
        offender = sum(f.req == args.id for f in findings)
        print(
            f"request {args.id}{' (' + ', '.join(sorted(tenants)) + ')' if tenants else ''}: "
            f"{len(events)} event(s) on {nodes}; {offender} finding(s) as offender, "
            f"{len(findings) - offender} as victim; {sum(i.kind == 'command' for i in items)} command(s)"
            + ("" if items else f"; no record of it in {source.label}"),
            file=sys.stderr,
        )
        return 1 if findings else 0

    return _run(prog, args, body)


def cmd_exposure(args: argparse.Namespace) -> int:
    """`kvguard audit exposure --tenant T`: exit 1 when T's KV reached another tenant, else 0."""
    prog = "kvguard audit exposure"
    try:
        if not args.tenant:
            raise UsageError("--tenant is empty")
        since, until = _times(args)
    except UsageError as exc:
        return _usage(prog, exc)

    def body(source: Source) -> int:
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


def add_parsers(audit_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Add `query`, `request` and `exposure` to the `kvguard audit` subcommands."""
    p = audit_sub.add_parser("query", help="the audit records that match a filter (table or JSON Lines)")
    _source_args(p)
    p.add_argument("--kind", choices=KINDS, help="only records of this kind")
    p.add_argument("--tenant", metavar="T", help="records of tenant T, as offender or as victim")
    p.add_argument("--req", metavar="R", help="records indexed under request R (see `audit request`)")
    p.add_argument("--node", metavar="N", help="records of node N")
    p.add_argument("--finding", metavar="KIND", help="findings of this kind (stale_read, ...)")
    p.add_argument("--since", metavar="TIME", help="ts_ns at or after TIME (nanoseconds, or ISO-8601)")
    p.add_argument("--until", metavar="TIME", help="ts_ns at or before TIME (nanoseconds, or ISO-8601)")
    p.add_argument("--limit", type=int, default=0, metavar="N", help="at most N records (0: all)")
    p.set_defaults(func=cmd_query)

    p = audit_sub.add_parser(
        "request", help="one request's timeline across nodes: events, findings naming it, commands"
    )
    p.add_argument("id", metavar="ID", help="the request id")
    _source_args(p)
    p.set_defaults(func=cmd_request)

    p = audit_sub.add_parser(
        "exposure", help="which requests of other tenants read, received or overwrote a tenant's KV"
    )
    p.add_argument("--tenant", required=True, metavar="T", help="the tenant whose KV may have leaked")
    p.add_argument("--since", metavar="TIME", help="findings at or after TIME (nanoseconds, or ISO-8601)")
    p.add_argument("--until", metavar="TIME", help="findings at or before TIME (nanoseconds, or ISO-8601)")
    _source_args(p)
    p.set_defaults(func=cmd_exposure)


def build_parser() -> argparse.ArgumentParser:
    """A parser of just the audit group (what `kvguard audit` adds these commands to)."""
    parser = argparse.ArgumentParser(prog="kvguard audit", description="Query the kvguard audit log.")
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
