"""The audit store: events, findings and commands, append-only, in one hash chain.

SQLite (WAL) in a file by default, PostgreSQL (or any SQLAlchemy URL) for clusters. The
schema is created and changed only by Alembic migrations (daemon/migrations). Invariants:
records are only ever inserted; every event, finding and command has an id, 1, 2, 3, ...
without gaps; each record's hash covers its id, every column and the previous record's hash,
so `verify()` proves that nothing was altered, removed or reordered; one store has one writer
(the daemon), which owns the chain. The consecutive events a batch delivered are stored as
one record (kind `events`, a run): its body is the events' bytes as an EventBatch, its id the
first event's, and it takes one id per event; every request they name is indexed (`named`),
and their times lie within RUN_SPAN_NS of its `ts_ns`. Reads expand runs, so every reader
sees one (id, "event", bytes) per event, as if each were a record of its own: storing a batch
of 64 events costs one row and one hash instead of 64 (the writer's cost is per row).
A plain hash chain can be recomputed by whoever can write the database; a store sealed with
an audit key (kept outside it, `--audit-key`) chains its records from the seal on with
HMAC-SHA256 under that key instead, which only the key's holder can recompute: appending to a
sealed store needs the key, and verify proves a sealed store only with it.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from alembic import command
from alembic.config import Config
from sqlalchemy import (
    BigInteger,
    Column,
    Engine,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    create_engine,
    event,
    func,
    select,
    text,
)

from kvguard.daemon import _rows
from kvguard.ledger.findings import Finding
from kvguard.proto import pb, wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
GENESIS = bytes(32)

metadata = MetaData()
records = Table(
    "records",
    metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=False),
    Column("kind", String(16), nullable=False),
    Column("node", String(128), nullable=False),
    Column("seq", BigInteger(), nullable=False),
    Column("ts_ns", BigInteger(), nullable=False),
    Column("req", String(256), nullable=False),
    Column("tenant", String(128), nullable=False),
    Column("victim_tenant", String(128), nullable=False),
    Column("finding", String(32), nullable=False),
    Column("severity", String(16), nullable=False),
    Column("body", LargeBinary(), nullable=False),
    Column("prev_hash", LargeBinary(32), nullable=False),
    Column("hash", LargeBinary(32), nullable=False),
)
_COLUMNS = ("kind", "node", "seq", "ts_ns", "req", "tenant", "victim_tenant", "finding", "severity")
snapshots = Table(
    "snapshots",
    metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    Column("through_id", BigInteger(), nullable=False),
    Column("created_ns", BigInteger(), nullable=False),
    Column("body", LargeBinary(), nullable=False),
    Column("digest", LargeBinary(32), nullable=False),
)
SNAPSHOTS_KEPT = 2
seal = Table(
    "seal",
    metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    Column("from_id", BigInteger(), nullable=False),
    Column("tag", LargeBinary(32), nullable=False),
)
MIN_KEY_BYTES = 32
# The requests a record names beyond its `req` column (migration 0006): derived, outside the
# chain; one B-tree by request (0007: WITHOUT ROWID in SQLite), as the queries read it.
named = Table(
    "named",
    metadata,
    Column("req", String(256), primary_key=True),
    Column("record_id", BigInteger(), primary_key=True, autoincrement=False),
    sqlite_with_rowid=False,
)


WAL_RESTART_S = 1.0  # how often the writer lets SQLite start its WAL over (restart_wal)
RUN_SPAN_NS = 1_000_000_000  # a run's events lie in [ts_ns, ts_ns + this]: time filters stay indexed
RUN_MAX = 1 << 16  # events in a run at most (a batch holds no more)

_PAYLOADS = pb.Event.DESCRIPTOR.oneofs_by_name["payload"].fields
# Which payloads carry the indexed columns (a getattr with a default is slow where it misses).
_HAS_REQ = frozenset(f.name for f in _PAYLOADS if "req" in f.message_type.fields_by_name)
_HAS_TENANT = frozenset(f.name for f in _PAYLOADS if "tenant" in f.message_type.fields_by_name)


class Record(NamedTuple):
    """One row to append. `body` is the serialized protobuf (Event, Finding or Command).
    A tuple: one is built per event, on the store writer's hot path."""

    kind: str  # event, finding, command
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


def _indexed(event: pb.Event) -> tuple[str, str, tuple[str, ...]]:
    """An event's index columns: its request (a read launch's first), its tenant, and the
    other requests it names."""
    kind = event.WhichOneof("payload") or ""
    if kind == "read":
        reads = event.read.reads
        first = reads[0].req if reads else ""  # the others go to `named`
        return first, "", _read_others(reads) if len(reads) > 1 else ()
    if not kind:
        return "", "", ()
    payload = getattr(event, kind)
    return (payload.req if kind in _HAS_REQ else ""), (payload.tenant if kind in _HAS_TENANT else ""), ()


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
    return EventHead(event.node, event.seq, event.ts_ns, *_indexed(event))


def _run_named(heads: Iterable[EventHead]) -> tuple[str, ...]:
    """Every request the events of a run name, each once (indexed in `named`)."""
    names: set[str] = set()
    for head in heads:
        names.add(head.req)
        names.update(head.others)
    names.discard("")
    return tuple(sorted(names))


def _run_events(body: bytes) -> Sequence[bytes]:
    """The events' bytes of a run's body."""
    return svc.RawEventBatch.FromString(body).events


def _ids(kind: str, body: bytes) -> int:
    """The ids a stored record takes: a run's events, else one."""
    return len(_run_events(body)) if kind == "events" else 1


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
        return _indexed(pb.Event.FromString(body))[2]
    if kind == "events":
        return _run_named(_head(e) for e in _run_events(body))
    if kind == "finding":
        f = pb.Finding.FromString(body)
        return _victim_named(f.req, f.victim_req)
    return ()


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


_ID = struct.Struct(">Q").pack
_LEN = struct.Struct(">I").pack


_PREFIXED: dict[str, bytes] = {}  # length-prefixed bytes of the few distinct kinds, nodes, ...


def _prefixed(text: str) -> bytes:
    """A low-cardinality column (kind, node, victim tenant, finding, severity), encoded once."""
    data = _PREFIXED.get(text)
    if data is None:
        if len(_PREFIXED) > 65536:
            _PREFIXED.clear()
        raw = text.encode()
        data = _PREFIXED[text] = _LEN(len(raw)) + raw
    return data


def _chain(prev: bytes, record_id: int, columns: Sequence[Any], body: bytes, key: bytes | None) -> bytes:
    """sha256(prev hash, id, each column length-prefixed (as text), body length-prefixed), or
    under `key` HMAC-SHA256 of the same. Written out column by column: it runs once per
    stored event, on the writer's hot path."""
    kind, node, seq, ts_ns, req, tenant, victim_tenant, finding, severity = columns
    seq_b, ts_b, req_b, tenant_b = b"%d" % seq, b"%d" % ts_ns, req.encode(), tenant.encode()
    data = b"".join(
        (
            prev,
            _ID(record_id),
            _prefixed(kind),
            _prefixed(node),
            _LEN(len(seq_b)),
            seq_b,
            _LEN(len(ts_b)),
            ts_b,
            _LEN(len(req_b)),
            req_b,
            _LEN(len(tenant_b)),
            tenant_b,
            _prefixed(victim_tenant),
            _prefixed(finding),
            _prefixed(severity),
            _LEN(len(body)),
            body,
        )
    )
    return _digest(data, key)


def _digest(data: bytes, key: bytes | None) -> bytes:
    """SHA-256 of `data`, or under an audit key HMAC-SHA256 (which only the key's holder can make)."""
    return hashlib.sha256(data).digest() if key is None else hmac.digest(key, data, "sha256")


def _snapshot_digest(after: bytes, body: bytes, key: bytes | None) -> bytes:
    """What binds a snapshot to the record it was taken after: the digest of that record's
    hash and the body (under the audit key in a sealed store)."""
    return _digest(after + body, key)


def _seal_tag(key: bytes, from_id: int) -> bytes:
    return _digest(b"kvguard audit seal from %d" % from_id, key)


class AuditKeyError(ValueError):
    """An audit key file that must not be used: what is wrong with it, by name."""


def read_audit_key(path: str) -> bytes:
    """The audit key in `path` (at least MIN_KEY_BYTES, trailing whitespace aside). Refused if
    anyone but its owner may read or write it: a key others can read seals nothing."""
    try:
        st = os.stat(path)
        with open(path, "rb") as f:
            key = f.read().rstrip()
    except OSError as exc:
        raise AuditKeyError(f"audit key {path}: {exc.strerror}") from None
    if st.st_mode & 0o077:
        raise AuditKeyError(
            f"audit key {path}: others may read or write it (mode {st.st_mode & 0o777:o}); chmod 600 it"
        )
    if len(key) < MIN_KEY_BYTES:
        raise AuditKeyError(f"audit key {path}: {len(key)} bytes, at least {MIN_KEY_BYTES} needed")
    return key


def new_audit_key(path: str) -> None:
    """Write a new random audit key (64 hex digits) to `path`, readable by its owner only;
    never over an existing file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(os.urandom(MIN_KEY_BYTES).hex() + "\n")


def store_url(where: str) -> str:
    """A SQLAlchemy URL, or a plain file path taken as a SQLite database."""
    return where if "://" in where else f"sqlite:///{Path(where).resolve()}"


def migrations(conn: Any) -> Config:
    """Alembic's configuration of the store's migrations, run on `conn` (in its transaction)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = conn
    return config


def migrate(engine: Engine) -> None:
    """Bring the schema to the newest revision (Alembic)."""
    with engine.begin() as conn:
        command.upgrade(migrations(conn), "head")


class StoreError(RuntimeError):
    """The store could not commit: nothing of the batch is durable."""


def _holding(conn: Any, record_id: int) -> int:
    """The id of the record that holds id `record_id` (a run holds its events' ids), or
    `record_id` if none does yet."""
    c = records.c
    found = conn.execute(select(func.max(c.id)).where(c.id <= record_id)).scalar()
    return int(found) if found is not None else record_id


def _ending(conn: Any, through: int | None) -> tuple[int, bytes] | None:
    """(the last id, the hash) of the record that holds id `through` (None: the last
    record), or None if there is none."""
    c = records.c
    query = select(c.id, c.kind, c.body, c.hash).order_by(c.id.desc()).limit(1)
    if through is not None:
        query = query.where(c.id <= through)
    row = conn.execute(query).first()
    return (row[0] + _ids(row[1], row[2]) - 1, row[3]) if row else None


def _checkpoint(conn: Any) -> None:
    """Copy what is committed in the WAL into the database file, as far as no reader still
    needs the frames (SQLite's PASSIVE checkpoint: it never waits for a reader or the writer)."""
    cursor = conn.cursor()
    cursor.execute("PRAGMA wal_checkpoint(PASSIVE)")
    cursor.close()


class Store:
    def __init__(self, where: str, *keys: bytes | None) -> None:
        """The store at `where`, with the audit keys given (None: none), each matched to the
        seals it made (StoreError for a key that made none of this store's seals)."""
        self.url = store_url(where)
        sqlite = self.url.startswith("sqlite")
        self.engine = create_engine(self.url, connect_args={"check_same_thread": False} if sqlite else {})
        if sqlite:

            @event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_conn: Any, _: Any) -> None:
                cursor = dbapi_conn.cursor()
                cursor.execute("PRAGMA journal_mode=WAL")
                cursor.execute("PRAGMA synchronous=FULL")  # a commit survives a crash of the machine too
                cursor.close()

        migrate(self.engine)
        self._given = [k for k in keys if k is not None]
        # Seals as (from_id, tag), in the order they were made (the last is the current one; a
        # rotation adds one), and the key of each seal whose key was given, by its index.
        self._seals, self._keys = self._sealed(self._given)
        self._lock = threading.Lock()
        # The hot insert bypasses SQLAlchemy's per-row parameter handling: one long-lived DBAPI
        # connection, one executemany of tuples per commit.
        self._raw = self.engine.raw_connection()
        self._checkpoints: threading.Event | None = None
        self._restart_due = 0.0  # restart_wal() does nothing before this (time.monotonic())
        self._closed = False
        if sqlite:
            # WAL pages go back into the database file from a thread of their own: done by the
            # committing connection (SQLite's default), a checkpoint and its fsync of the whole
            # file would now and then stall a commit, and with it every ack and alert waiting.
            cursor = self._raw.cursor()
            cursor.execute("PRAGMA wal_autocheckpoint=0")
            cursor.close()
        mark = "?" if self.engine.dialect.paramstyle == "qmark" else "%s"
        names = ("id", *_COLUMNS, "body", "prev_hash", "hash")
        self._insert = f"INSERT INTO records ({', '.join(names)}) VALUES ({', '.join([mark] * len(names))})"
        self._insert_named = f"INSERT INTO named (record_id, req) VALUES ({mark}, {mark})"
        with self.engine.connect() as conn:
            last = _ending(conn, None)
        self._next_id, self._last_hash = (last[0] + 1, last[1]) if last else (1, GENESIS)

    def _sealed(self, keys: list[bytes]) -> tuple[list[tuple[int, bytes]], dict[int, bytes]]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(seal.c.from_id, seal.c.tag).order_by(seal.c.id)).all()
        seals = [(int(from_id), bytes(tag)) for from_id, tag in rows]
        found: dict[int, bytes] = {}
        for key in keys:
            made = [
                i
                for i, (from_id, tag) in enumerate(seals)
                if hmac.compare_digest(_seal_tag(key, from_id), tag)
            ]
            if seals and not made:
                raise StoreError(
                    f"audit store {self.url}: an audit key given is not one its chain is sealed with"
                )
            found.update((i, key) for i in made)
        return seals, found

    @property
    def sealed_from(self) -> int | None:
        """The first record sealed with an audit key (None: the store is not sealed)."""
        return self._seals[0][0] if self._seals else None

    @property
    def seals(self) -> list[int]:
        """The first record of each seal, oldest first: a key rotation adds one."""
        return [from_id for from_id, _ in self._seals]

    def seal(self, key: bytes | None = None, *, rotate: bool = False) -> int:
        """Seal the store with `key` (default: the key this Store was given) from its next
        record on; returns that record. Done on purpose, with no daemon writing (`kvguard
        audit seal`, or the daemon on an empty store): a seal that appears by itself later
        would hide a rewrite of everything before it. A sealed store is sealed again (its
        key rotated: `rotate`) only by the holder of its current key."""
        key = key if key is not None else (self._given[-1] if self._given else None)
        if key is None:
            raise StoreError(f"audit store {self.url}: no key to seal with")
        if self._seals and not (rotate and len(self._seals) - 1 in self._keys):
            raise StoreError(
                f"audit store {self.url}: sealed already (the current seal from record {self._seals[-1][0]} "
                "on)" + ("; rotating its key needs the current one" if rotate else "")
            )
        if rotate and not self._seals:
            raise StoreError(f"audit store {self.url}: not sealed, so there is no key to rotate")
        with self.engine.begin() as conn:
            last = _ending(conn, None)
            from_id = (last[0] if last else 0) + 1
            tag = _seal_tag(key, from_id)
            conn.execute(seal.insert().values(from_id=from_id, tag=tag))
        self._seals.append((from_id, tag))
        self._keys[len(self._seals) - 1] = key
        return from_id

    def write_key(self) -> bytes | None:
        """The key new records and snapshots are bound with (None: plain SHA-256); StoreError
        if the store is sealed and this Store was not given its current key."""
        if not self._seals:
            return None
        key = self._keys.get(len(self._seals) - 1)
        if key is None:
            raise StoreError(
                f"audit store {self.url}: its chain is sealed (the current seal from record "
                f"{self._seals[-1][0]} on); writing to it needs that audit key (--audit-key)"
            )
        return key

    def append(self, rows: Sequence[Record]) -> list[int]:
        """Append rows in one transaction; returns their ids (a run's: its first event's).
        StoreError if it did not commit."""
        if not rows:
            return []
        mac = self.write_key()
        with self._lock:
            prev, record_id = self._last_hash, self._next_id
            values = []
            also = []
            for row in rows:
                kind, node, seq, ts_ns, body, req, tenant, victim_tenant, finding, severity, others, ids = row
                columns = (kind, node, seq, ts_ns, req, tenant, victim_tenant, finding, severity)
                digest = _chain(prev, record_id, columns, body, mac)
                values.append((record_id, *columns, body, prev, digest))
                prev = digest
                if others:
                    also += [(record_id, other) for other in others]
                record_id += ids
            try:
                cursor = self._raw.cursor()
                cursor.executemany(self._insert, values)
                if also:
                    cursor.executemany(self._insert_named, also)
                cursor.close()
                self._raw.commit()
            except Exception as exc:  # any failure means: not durable
                with contextlib.suppress(Exception):  # the commit failure is what gets reported
                    self._raw.rollback()
                raise StoreError(f"audit store {self.url}: commit failed: {exc}") from exc
            self._next_id, self._last_hash = record_id, prev
        if self._checkpoints is not None:
            self._checkpoints.set()
        elif self.url.startswith("sqlite"):
            self._checkpoints = threading.Event()
            name = "kvguard-store-checkpoint"
            threading.Thread(target=self._checkpoint_loop, name=name, daemon=True).start()
        return [v[0] for v in values]

    def restart_wal(self) -> bool:
        """Let SQLite write its WAL from the start again; for the writer to call while it has
        nothing to commit, at most once every WAL_RESTART_S (True if it ran now). The
        checkpoint thread copies committed pages into the database file alongside the
        commits, but SQLite starts the WAL over only at a commit that finds every frame
        copied, which under a steady stream of commits never happens: the WAL grew ~3x as
        fast as the store (580 MB in 10 s at the goal rate), without end, and every commit
        appended to a growing file. Copying the last few frames here, on the writer's own
        connection between commits, lets the next commit start the WAL over (unless a reader
        still reads old frames: then at a later call)."""
        now = time.monotonic()
        if self._checkpoints is None or now < self._restart_due:  # not SQLite, or nothing written yet
            return False
        self._restart_due = now + WAL_RESTART_S
        with self._lock:
            _checkpoint(self._raw)  # BUSY while the thread's runs: then at a later call
        return True

    def _checkpoint_loop(self) -> None:
        assert self._checkpoints is not None
        conn = self.engine.raw_connection()
        try:
            while True:
                self._checkpoints.wait()
                self._checkpoints.clear()
                if self._closed:
                    return
                _checkpoint(conn)
                time.sleep(0.05)  # at most 20 a second, each copying everything committed since
        finally:
            conn.close()

    def space(self) -> tuple[int, int | None]:
        """(bytes the store takes, bytes free to it where it lies; None where that cannot be
        seen from here: a PostgreSQL server's disk)."""
        if self.engine.url.get_backend_name() == "sqlite":
            path = Path(self.engine.url.database or "")
            used = 0
            for part in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
                with contextlib.suppress(FileNotFoundError):
                    used += part.stat().st_size
            room = os.statvfs(path.parent)
            return used, room.f_bavail * room.f_frsize
        with self.engine.connect() as conn:
            return int(conn.execute(text("SELECT pg_database_size(current_database())")).scalar_one()), None

    def count(self, kind: str | None = None) -> int:
        """How many events, findings or commands (`kind`), or all of them (None)."""
        c = records.c
        with self.engine.connect() as conn:
            if kind not in (None, "", "event"):
                return int(conn.execute(select(func.count()).where(c.kind == kind)).scalar_one())
            # Ids have no gaps: the last one counts them all.
            last = _ending(conn, None)
            total = last[0] if last else 0
            if not kind:
                return total
            others = conn.execute(select(func.count()).where(c.kind.in_(("finding", "command")))).scalar_one()
            return total - int(others)

    def events(self, after: int = 0) -> Iterator[pb.Event]:
        """The stored events after id `after`, in the order they were applied, parsed."""
        for _, batch, skip in self.event_batches(after):
            for i in range(skip, len(batch)):
                yield pb.Event.FromString(batch.event(i))

    def event_batches(self, after: int = 0) -> Iterator[tuple[str, wire.Batch, int]]:
        """The stored events after id `after`, in the order they were applied, as their bytes:
        (node, its events, how many of them come before `after`) per record, a run's together
        (the daemon rebuilds its ledger from them at start, applying them as it applied them
        live)."""
        c = records.c
        query = select(c.id, c.kind, c.node, c.body).where(c.kind.in_(("event", "events"))).order_by(c.id)
        with self.engine.connect() as conn:
            query = query.where(c.id >= _holding(conn, after + 1))
            with conn.execution_options(stream_results=True, yield_per=2000).execute(query) as result:
                for record_id, kind, node, body in result:
                    if kind == "event":
                        if record_id > after:
                            yield node, wire.single(bytes(body)), 0
                        continue
                    yield node, wire.decode_batch(bytes(body), wrapped=False), max(0, after + 1 - record_id)

    def rows(
        self,
        *,
        kind: str = "",
        after: int = 0,
        tenant: str = "",
        req: str = "",
        node: str = "",
        finding: str = "",
        since_ns: int = 0,
        until_ns: int = 0,
        limit: int = 0,
    ) -> Iterator[tuple[int, str, bytes]]:
        """(id, kind, body) of the events, findings and commands that match, in id order; a
        run's events one by one, each as (its id, "event", its bytes). A tenant matches as
        offender or as victim."""
        c = records.c
        # Runs are selected by what may match (their first id and time, every request they
        # name), and their events filtered one by one below.
        query = select(c.id, c.kind, c.ts_ns, c.body).order_by(c.id)
        if kind:
            query = query.where(c.kind.in_(("event", "events")) if kind == "event" else c.kind == kind)
        if tenant:
            query = query.where((c.tenant == tenant) | (c.victim_tenant == tenant) | (c.kind == "events"))
        if req:  # its own request, or one it names beyond it (a read launch's batch, a victim, a run)
            query = query.where(
                (c.req == req) | c.id.in_(select(named.c.record_id).where(named.c.req == req))
            )
        if node:
            query = query.where(c.node == node)
        if finding:
            query = query.where(c.finding == finding)
        if since_ns:
            query = query.where(c.ts_ns >= since_ns - RUN_SPAN_NS)
        if until_ns:
            query = query.where(c.ts_ns <= until_ns)
        inspect = bool(tenant or req or since_ns or until_ns)  # a run's events must be decoded
        left = limit or -1
        with self.engine.connect() as conn:
            if after:
                query = query.where(c.id >= _holding(conn, after + 1))
            with conn.execution_options(stream_results=True, yield_per=2000).execute(query) as result:
                for record_id, record_kind, ts_ns, body in result:
                    if record_kind != "events":
                        if record_id <= after or ts_ns < since_ns:
                            continue
                        yield record_id, record_kind, body
                        left -= 1
                        if not left:
                            return
                        continue
                    for i, data in enumerate(_run_events(body)):
                        if record_id + i <= after:
                            continue
                        if inspect:
                            event = pb.Event.FromString(data)
                            if (since_ns and event.ts_ns < since_ns) or (until_ns and event.ts_ns > until_ns):
                                continue
                            own, own_tenant, others = _indexed(event)
                            if (tenant and own_tenant != tenant) or (
                                req and req != own and req not in others
                            ):
                                continue
                        yield record_id + i, "event", data
                        left -= 1
                        if not left:
                            return

    def save_snapshot(self, body: bytes, through: int | None = None) -> int:
        """Store a snapshot of the state after record `through` (default: the last record
        committed, by any writer); returns that record's id. Keeps the newest SNAPSHOTS_KEPT."""
        mac = self.write_key()
        with self.engine.begin() as conn:
            last = _ending(conn, through)
            if through is not None and (last is None or last[0] != through):
                raise StoreError(f"audit store {self.url}: no record ends at id {through} to snapshot after")
            through, after = last if last else (0, GENESIS)
            digest = _snapshot_digest(after, body, mac)
            conn.execute(
                snapshots.insert().values(
                    through_id=through, created_ns=time.time_ns(), body=body, digest=digest
                )
            )
            kept = select(snapshots.c.id).order_by(snapshots.c.id.desc()).limit(SNAPSHOTS_KEPT)
            conn.execute(snapshots.delete().where(snapshots.c.id.not_in(kept.scalar_subquery())))
        return int(through)

    def latest_snapshot(self) -> tuple[int, bytes] | str:
        """(the last record it includes, its body) of the newest snapshot, or why there is
        none to use: a snapshot whose digest does not match the chain at its record is not."""
        with self.engine.connect() as conn:
            row = conn.execute(
                select(snapshots.c.through_id, snapshots.c.body, snapshots.c.digest)
                .order_by(snapshots.c.id.desc())
                .limit(1)
            ).first()
            if row is None:
                return "no snapshot"
            through, body, digest = row
            last = _ending(conn, through) if through else None
        if through and (last is None or last[0] != through):
            return f"the snapshot's record {through} is not in the store"
        after = last[1] if last else None
        try:
            key = self.write_key()  # snapshots are bound under the current seal's key
        except StoreError:
            return "the store is sealed: checking its snapshot needs its current audit key"
        if _snapshot_digest(after or GENESIS, body, key) != digest:
            return f"the snapshot taken after record {through} does not match the chain there"
        return int(through), bytes(body)

    def verify(self) -> tuple[bool, int, str]:
        """Walk the chain: (intact, records checked, what is wrong where). A sealed store is
        proven only with its audit key; a key given for a store that is not sealed proves
        nothing either (the seal may have been removed along with a rewrite). The index of
        named requests, outside the chain, is checked against the bodies it derives from (a
        row removed from it would hide a read launch from a request's timeline)."""
        if self._given and not self._seals:
            return (
                False,
                0,
                "an audit key was given but the chain is not sealed (never sealed, or the seal was removed)",
            )
        # Seal i covers its records up to the next seal's first record (a later seal made at
        # the same record replaces it).
        starts = [from_id for from_id, _ in self._seals] + [1 << 63]
        segment = -1  # the seal covering the record (-1: before any)
        prev, expected_id, n = GENESIS, 1, 0
        with (
            self.engine.connect() as conn,
            self.engine.connect() as side,
            conn.execution_options(stream_results=True, yield_per=2000).execute(
                select(records).order_by(records.c.id)
            ) as result,
            side.execution_options(stream_results=True, yield_per=2000).execute(
                select(named.c.record_id, named.c.req).order_by(named.c.record_id)
            ) as named_rows,
        ):
            index = iter(named_rows)
            pending = next(index, None)
            for row in result:
                v = row._mapping
                if v["id"] != expected_id:
                    return False, n, f"record {expected_id} is missing (next is {v['id']})"
                if v["prev_hash"] != prev:
                    return False, n, f"record {v['id']}: the chain is broken before it"
                while v["id"] >= starts[segment + 1]:
                    segment += 1
                key = self._keys.get(segment)
                if segment >= 0 and key is None:
                    return (
                        False,
                        n,
                        f"records from {starts[segment]} on are sealed with an audit key not given: "
                        "proving them needs it",
                    )
                if _chain(prev, v["id"], [v[name] for name in _COLUMNS], v["body"], key) != v["hash"]:
                    return False, n, f"record {v['id']} ({v['kind']} of {v['node']}) was altered"
                indexed = []
                while pending is not None and pending[0] <= v["id"]:
                    indexed.append((pending[0], pending[1]))
                    pending = next(index, None)
                if sorted(indexed) != [(v["id"], req) for req in named_of(v["kind"], v["body"])]:
                    return False, n, f"record {v['id']}: the index of the requests it names was altered"
                ids = _ids(v["kind"], v["body"])
                if v["kind"] == "events" and ids < 2:
                    return False, n, f"record {v['id']}: a run of {ids} events"
                prev, expected_id, n = v["hash"], expected_id + ids, n + ids
        if pending is not None:
            return False, n, f"the index of named requests lists record {pending[0]}, past the last record"
        return True, n, ""

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._checkpoints is not None:
            self._checkpoints.set()
        self._raw.close()
        self.engine.dispose()
