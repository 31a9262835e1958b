"""Where `kvguard audit` reads records from: the audit store (`StoreSource`) or a daemon
(`DaemonSource`, over AuditService.Query), behind one `Source` interface.

Invariants: a source only reads; every method yields records in id (record) order; both
sources decode records from their bodies only (never from index columns a daemon does not
serve), so every command built on them prints the same from either.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from kvguard.daemon.tls import Tls
from kvguard.daemon.tls import channel as daemon_channel
from kvguard.proto import pb
from kvguard.proto.capture import message_to_dict
from kvguard.proto.kvguard.v1 import services_pb2 as svc

DEFAULT_STORE = "kvguard-audit.db"
KINDS = ("event", "finding", "command")

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
            raise UsageError(f"cannot open audit store {where}: {first_line(exc)}") from None
        if not has_records:
            raise UsageError(f"{where} is not a kvguard audit store (no records table)")
        try:
            self.store = Store(where)
        except Exception as exc:
            raise UsageError(f"cannot open audit store {where}: {first_line(exc)}") from None
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


def first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def open_source(store: str | None, daemon: str | None, tls: Tls | None = None) -> Source:
    """The one source the arguments name (the default store when neither is given)."""
    if store is not None and daemon is not None:
        raise UsageError(f"give --store ({store}) or --daemon ({daemon}), not both")
    if daemon is not None:
        return DaemonSource(daemon, tls)
    return StoreSource(store if store is not None else DEFAULT_STORE)
