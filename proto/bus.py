"""The bus: how agents and daemons meet on NATS JetStream when one daemon no longer holds the
fleet (docs/design.md, "Past one daemon"). The names here are the contract; agents/bus.py and
daemon/bus.py speak it.

- A node's events go to the cluster's stream `KVGUARD_<cluster>` on the subject
  `kvguard.v1.<cluster>.<cell>.<node>` (a probe's events, `node/ebpf` and `node/shim`, on
  `...<node>.<probe>`), one message per batch: the same bytes as a batch on the gRPC stream.
  Each message carries the batch's last position (`Kvguard-Last: epoch:seq`) and a message id
  (`node:epoch:first-last`) that JetStream de-duplicates within its window; past the window,
  a batch's identity is its subject's sequence: the agent publishes with the sequence it
  expects its subject to be at, so a batch stored already can never be stored again.
- A node's status goes to `kvguard.ctl.<cluster>.<node>.status` (not stored), commands to it
  on `kvguard.ctl.<cluster>.<node>.cmd`: only daemons may publish there.
- Which daemon judges a cell is a lease in the KV bucket `KVGUARD_CELLS_<cluster>`: key
  `cell.<cell>` holds its daemon's name and lapses unless renewed; `daemon.<name>` says a
  daemon is alive.
- Each cell's latest ledger snapshot is the object `cell.<cell>` of the object store
  `KVGUARD_SNAPSHOTS_<cluster>` (daemon/cell_snapshots.py says its form).

Names become subject tokens by percent-encoding every byte outside [A-Za-z0-9_-], so that any
node name is one token, and a dot, a wildcard or a space in it cannot widen a subject.
Invariant: token() is injective and untoken(token(x)) == x.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

ROOT = "kvguard.v1"  # the events' subjects
CONTROL = "kvguard.ctl"  # statuses and commands: never stored
LAST = "Kvguard-Last"  # header: the batch's last (epoch, seq), as "epoch:seq"
MSG_ID = "Nats-Msg-Id"
EXPECTED_LAST = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = 10071  # JetStream's err_code when a subject is not at the expected sequence
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a cluster's name: it is in stream and bucket names
_SAFE = "-_"


class BusError(ValueError):
    """A bus setting that cannot be used: names the setting and the reason."""


def token(name: str) -> str:
    """`name` as one subject token (see the module's docstring)."""
    if not name:
        raise BusError("an empty name cannot be a subject token")
    return quote(name, safe=_SAFE).replace(".", "%2E").replace("~", "%7E")


def untoken(tok: str) -> str:
    return unquote(tok)


def check_cluster(cluster: str) -> str:
    if not _NAME.fullmatch(cluster):
        raise BusError(f"bus cluster {cluster!r}: 1 to 64 of A-Z a-z 0-9 _ - (it names a stream)")
    return cluster


def check_cell(cell: str) -> str:
    if not _NAME.fullmatch(cell):
        raise BusError(f"cell {cell!r}: 1 to 64 of A-Z a-z 0-9 _ - (it names a lease and a consumer)")
    return cell


def stream_name(cluster: str) -> str:
    return f"KVGUARD_{check_cluster(cluster)}"


def bucket_name(cluster: str) -> str:
    return f"KVGUARD_CELLS_{check_cluster(cluster)}"


def snapshots_name(cluster: str) -> str:
    """The object store of the cells' ledger snapshots (one object a cell: snapshot_name)."""
    return f"KVGUARD_SNAPSHOTS_{check_cluster(cluster)}"


def snapshot_name(cell: str) -> str:
    return f"cell.{cell}"


def source_tokens(source: str) -> str:
    """A stream's source (`node`, or a probe's `node/probe`) as its subject's last tokens."""
    node, _, probe = source.partition("/")
    return f"{token(node)}.{token(probe)}" if probe else token(node)


def events_subject(cluster: str, cell: str, source: str) -> str:
    return f"{ROOT}.{cluster}.{cell}.{source_tokens(source)}"


def cell_filter(cluster: str, cell: str) -> str:
    """Every events subject of `cell`: its nodes' and their probes'."""
    return f"{ROOT}.{cluster}.{cell}.>"


def lease_key(cell: str) -> str:
    return f"cell.{cell}"


def consumer_name(cell: str) -> str:
    return f"cell_{cell}"


def status_subject(cluster: str, node: str) -> str:
    return f"{CONTROL}.{cluster}.{token(node)}.status"


def command_subject(cluster: str, node: str) -> str:
    return f"{CONTROL}.{cluster}.{token(node)}.cmd"


@dataclass(frozen=True, slots=True)
class Subject:
    """Whose an events subject is."""

    cluster: str
    cell: str
    source: str  # node, or node/probe


def parse_subject(subject: str) -> Subject:
    """The cluster, cell and source an events subject names (BusError if it is not one)."""
    parts = subject.split(".")
    if len(parts) not in (5, 6) or ".".join(parts[:2]) != ROOT:
        raise BusError(f"subject {subject!r} is not {ROOT}.<cluster>.<cell>.<node>[.<probe>]")
    source = untoken(parts[4]) + (f"/{untoken(parts[5])}" if len(parts) == 6 else "")
    return Subject(parts[2], parts[3], source)


def msg_id(source: str, first: tuple[int, int], last: tuple[int, int]) -> str:
    """A batch's message id: its source and the positions it spans."""
    return f"{source}:{first[0]}:{first[1]}-{last[0]}:{last[1]}"


def last_header(last: tuple[int, int]) -> str:
    return f"{last[0]}:{last[1]}"


def parse_last(value: str | None) -> tuple[int, int]:
    """A message's `Kvguard-Last` as (epoch, seq); (0, 0) if absent or not two numbers."""
    epoch, _, seq = (value or "").partition(":")
    try:
        return int(epoch), int(seq)
    except ValueError:
        return 0, 0


def node_permissions(cluster: str, node: str) -> dict[str, Any]:
    """What a node's agent may do on the bus, for the server's configuration: publish its own
    events and status, read back its own last message, and hear its own commands (and, as
    any user, the replies to its own inbox)."""
    stream = stream_name(cluster)
    mine = [f"{ROOT}.{cluster}.*.{token(node)}", f"{ROOT}.{cluster}.*.{token(node)}.*"]
    return {
        "publish": {
            "allow": [
                *mine,
                status_subject(cluster, node),
                *(f"$JS.API.DIRECT.GET.{stream}.{s}" for s in mine),
            ]
        },
        "subscribe": {"allow": [command_subject(cluster, node)]},
    }


def certificate_subject(pem: Path) -> str:
    """A certificate's subject as a bus that maps certificates to users names it (RFC 4514,
    as NATS's verify_and_map compares it); BusError naming the file if it is not one."""
    from cryptography import x509

    try:
        return x509.load_pem_x509_certificate(pem.read_bytes()).subject.rfc4514_string()
    except OSError as exc:
        raise BusError(f"bus certificate {pem}: {exc.strerror}") from None
    except ValueError as exc:
        raise BusError(f"bus certificate {pem}: not a PEM certificate ({exc})") from None


def inbox(user: str) -> str:
    """A bus user's own reply subjects (no one else's replies can be heard)."""
    return f"_INBOX_{token(user)}"


@dataclass(frozen=True, slots=True)
class BusSettings:
    """Where the bus is and who speaks on it: `servers` (nats:// URLs), the kvguard cluster's
    name, and either the bus user and the file holding its password, or this side's
    certificate (a bus that knows its clients by certificate)."""

    servers: Sequence[str]
    cluster: str
    user: str = ""
    password_file: Path | None = None
    replicas: int = 3  # of the stream and the lease bucket (the daemon creates them)
    tls_ca: Path | None = None  # the CA of the servers' certificate: TLS to them, verified
    # This side's certificate and key: its identity on a bus that knows its clients by their
    # certificates (`kvguard bus config --tls-ca`), in place of a user and password.
    tls_cert: Path | None = None
    tls_key: Path | None = None

    def __post_init__(self) -> None:
        check_cluster(self.cluster)
        if not self.servers:
            raise BusError("bus: no server given (nats://host:port)")
        for server in self.servers:
            if not server.startswith(("nats://", "tls://")):
                raise BusError(f"bus server {server!r}: not a nats:// or tls:// URL")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise BusError("--bus-tls-cert and --bus-tls-key go together")
        if self.tls_cert is not None and self.tls_ca is None:
            raise BusError("--bus-tls-cert needs --bus-tls-ca: the servers are verified too")
        if self.tls_cert is not None and (self.user or self.password_file is not None):
            raise BusError(
                "--bus-tls-cert is this side's identity on the bus: no --bus-user or password with it"
            )

    def identity(self, name: str) -> str:
        """Who this side is on the bus: its user, its certificate's subject (the user a bus
        that maps certificates knows it as), or else `name`."""
        if self.user:
            return self.user
        if self.tls_cert is not None:
            return certificate_subject(self.tls_cert)
        return name

    def password(self) -> str | None:
        """The user's password, from a file only its owner may read (BusError otherwise)."""
        if self.password_file is None:
            return None
        where = f"bus password file {self.password_file}"
        try:
            mode = self.password_file.stat().st_mode
            text = self.password_file.read_text().strip()
        except OSError as exc:
            raise BusError(f"{where}: {exc.strerror}") from None
        if mode & 0o077:
            raise BusError(f"{where}: others may read or write it (mode {mode & 0o777:o}); chmod 600 it")
        if not text:
            raise BusError(f"{where}: it is empty")
        return text

    def tls_context(self) -> ssl.SSLContext:
        """TLS that verifies the servers against `tls_ca`, presenting `tls_cert` if given
        (BusError naming a file that cannot be read)."""
        try:
            context = ssl.create_default_context(cafile=str(self.tls_ca))
        except (OSError, ssl.SSLError) as exc:
            raise BusError(f"bus TLS CA {self.tls_ca}: {getattr(exc, 'strerror', None) or exc}") from None
        if self.tls_cert is not None:
            try:
                context.load_cert_chain(str(self.tls_cert), str(self.tls_key))
            except (OSError, ssl.SSLError) as exc:
                why = getattr(exc, "strerror", None) or exc
                raise BusError(f"bus certificate {self.tls_cert} (key {self.tls_key}): {why}") from None
        return context

    async def connect(self, name: str, **callbacks: Any) -> Any:
        """A connection to the bus as this user (nats.aio.client.Client), reconnecting for ever."""
        import nats

        user = self.user or None
        if self.tls_ca is not None:
            callbacks["tls"] = self.tls_context()
        return await nats.connect(
            list(self.servers),
            name=name,
            user=user,
            password=self.password() if user else None,
            inbox_prefix=inbox(self.identity(name)).encode(),
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            **callbacks,
        )
