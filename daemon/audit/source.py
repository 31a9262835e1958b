"""Where `kvguard audit` reads records from: the audit store (`StoreSource`) or a daemon
(`DaemonSource`, over AuditService.Query), behind one `Source` interface.

Invariants: a source only reads; every method yields records in id (record) order; both
sources decode records from their bodies only (never from index columns a daemon does not
serve), so every command built on them prints the same from either.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from kvguard.proto import pb
from kvguard.proto.capture import message_to_dict
from kvguard.proto.channel import Tls
from kvguard.proto.channel import channel as daemon_channel
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc

DEFAULT_STORE = "kvguard-audit.db"
KINDS = ("event", "finding", "command", "refused", "action", "receipt")

Body = pb.Event | pb.Finding | svc.Command | svc.Refusal | svc.Action | svc.SignedReceipt


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


class Source(Protocol):
    """Where the records come from: a store or a daemon. Every method yields in id order."""

    label: str

    def records(self, f: Filter) -> Iterator[AuditItem]: ...

    def tenants(self) -> list[str]: ...

    def close(self) -> None: ...


def _decode(kind: str, body: bytes) -> Body:
    if kind == "event":
        return pb.Event.FromString(body)
    if kind == "finding":
        return pb.Finding.FromString(body)
    if kind == "refused":
        return svc.Refusal.FromString(body)
    if kind == "action":
        return svc.Action.FromString(body)
    if kind == "receipt":
        return svc.SignedReceipt.FromString(body)
    return svc.Command.FromString(body)


class StoreSource:
    """The audit store itself (read only)."""

    def __init__(self, where: str) -> None:
        from kvguard.daemon.store import Store, first_line, missing_store

        if (missing := missing_store(where)) is not None:
            raise UsageError(missing)
        try:
            self.store = Store(where)
        except Exception as exc:
            raise UsageError(f"cannot open audit store {where}: {first_line(exc)}") from None
        self.label = where

    def records(self, f: Filter) -> Iterator[AuditItem]:
        for record_id, kind, body in self.store.rows(f):
            yield AuditItem(record_id, kind, _decode(kind, body))

    def tenants(self) -> list[str]:
        """Every tenant the log names (an admission's, a finding's offender or victim)."""
        return self.store.tenants()

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

    def records(self, f: Filter) -> Iterator[AuditItem]:
        for record in self.stub.Query(f.audit_query()):
            which = record.WhichOneof("body")
            body = getattr(record, which) if which else None
            yield AuditItem(record.id, record.kind, body, f.req if body is None else "")

    def tenants(self) -> list[str]:
        """The tenants the daemon's findings name, as offender or victim (its API serves records,
        not an index of tenants: admissions that raised nothing are not among them)."""
        found: set[str] = set()
        for item in self.records(Filter(kind="finding")):
            if isinstance(item.body, pb.Finding):
                found.update((item.body.tenant, item.body.victim_tenant))
        found.discard("")
        return sorted(found)

    def close(self) -> None:
        self.channel.close()


def open_source(store: str | None, daemon: str | None, tls: Tls | None = None) -> Source:
    """The one source the arguments name (the default store when neither is given)."""
    if store is not None and daemon is not None:
        raise UsageError(f"give --store ({store}) or --daemon ({daemon}), not both")
    if daemon is not None:
        return DaemonSource(daemon, tls)
    return StoreSource(store if store is not None else DEFAULT_STORE)
