"""The audit store (`Store`): events, findings, commands and operators' actions, append-only,
in one hash chain, in SQLite (WAL, a file: the default) or PostgreSQL (any SQLAlchemy URL).

Invariants: records are only ever inserted; every event, finding and command has an id, 1, 2,
3, ... without gaps; each record's hash covers its id, every column and the previous record's
(chain.py), so `verify()` proves that nothing was altered, removed or reordered; a SQLite store
has one writer (the daemon's writer process), which owns the chain and its last hash; a
PostgreSQL store may have several (the daemons of a fleet on the bus), which take turns at the
chain's end under one transaction-scoped lock, each reading the end afresh. Each writer writes
the chain's head outside the database after each commit (head.py), so that `completeness()`
proves that nothing was removed from its end either, up to what that writer last wrote; a
store sealed with an audit key is appended to only with that key. Snapshots are kept bound to
the chain, the newest SNAPSHOTS_KEPT, their bodies in parts (snapshot_rows.py).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from typing import Any

from sqlalchemy import create_engine, event, func, select, text
from sqlalchemy.exc import SQLAlchemyError

from kvguard.daemon.store import head, reads, snapshot_rows
from kvguard.daemon.store.chain import GENESIS, chain, seal_tag, snapshot_digest
from kvguard.daemon.store.rows import Record, run_ids
from kvguard.daemon.store.schema import (
    COLUMNS,
    RowError,
    checked,
    first_line,
    migrate,
    records,
    seal,
    shown_url,
    store_url,
)
from kvguard.daemon.store.snapshot_rows import SNAPSHOT_PART
from kvguard.proto import pb, wire
from kvguard.proto.filter import Filter
from kvguard.proto.logs import logger

log = logger("store")

WAL_RESTART_S = 1.0  # how often the writer lets SQLite start its WAL over (restart_wal)
CHAIN_LOCK = 0x6B7667_636861696E  # PostgreSQL advisory lock: the chain's end, one writer at a time


class StoreError(RuntimeError):
    """The store could not commit: nothing of the batch is durable."""


def _ending(conn: Any, through: int | None) -> tuple[int, bytes] | None:
    """(the last id, the hash) of the record that holds id `through` (None: the last
    record), or None if there is none."""
    c = records.c
    query = select(c.id, c.kind, c.body, c.hash).order_by(c.id.desc()).limit(1)
    if through is not None:
        query = query.where(c.id <= through)
    row = conn.execute(query).first()
    if row is None:
        return None
    v = checked("records", f"record {row[0]}", {"id": row[0], "kind": row[1], "body": row[2], "hash": row[3]})
    return v["id"] + run_ids(v["kind"], v["body"]) - 1, v["hash"]


def _text(data: bytes) -> str | bytes:
    """A SQLite TEXT value as a str; its bytes when they are not UTF-8 (a store edited by hand,
    a faulty disk), which the row checks then name ("column node holds bytes ..., not text")
    where sqlite3 would raise from inside a query."""
    try:
        return data.decode()
    except UnicodeDecodeError:
        return data


def _checkpoint(conn: Any) -> None:
    """Copy what is committed in the WAL into the database file, as far as no reader still
    needs the frames (SQLite's PASSIVE checkpoint: it never waits for a reader or the writer)."""
    cursor = conn.cursor()
    cursor.execute("PRAGMA wal_checkpoint(PASSIVE)")
    cursor.close()


class Store:
    def __init__(self, where: str, *keys: bytes | None, head_file: str | None = None) -> None:
        """The store at `where`, with the audit keys given (None: none), each matched to the
        seals it made (StoreError for a key that made none of this store's seals), and its
        head in `head_file` (default: head.default_path)."""
        self.url = store_url(where)
        self.shown = shown_url(self.url)
        self.head_file = head_file or head.default_path(self.url)
        self._head_unsynced = False
        self._head_synced_at = 0.0
        self._head_failed = ""  # why the head could not be written last (said once)
        try:
            self._open(keys)
        except (SQLAlchemyError, ImportError, OSError) as exc:
            # A typo'd URL, a server that is down, a directory that is not there: the operator's
            # to fix, said in a line (the driver's first), not as SQLAlchemy's traceback.
            raise StoreError(f"audit store {self.shown} cannot be opened: {first_line(exc)}") from None

    def _open(self, keys: tuple[bytes | None, ...]) -> None:
        """Connect, migrate, read the seals and the chain's end."""
        sqlite = self.url.startswith("sqlite")
        self.engine = create_engine(self.url, connect_args={"check_same_thread": False} if sqlite else {})
        if sqlite:

            @event.listens_for(self.engine, "connect")
            def _pragmas(dbapi_conn: Any, _: Any) -> None:
                dbapi_conn.text_factory = _text  # a TEXT value that is not UTF-8 is named, not a crash
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
        self._shared = not sqlite  # writers take turns at the chain's end (see the module's invariants)
        self._last_row = 0  # the id of the last record this writer appended (0: none yet)
        mark = "?" if self.engine.dialect.paramstyle == "qmark" else "%s"
        names = ("id", *COLUMNS, "body", "prev_hash", "hash")
        self._insert = f"INSERT INTO records ({', '.join(names)}) VALUES ({', '.join([mark] * len(names))})"
        self._insert_named = f"INSERT INTO named (record_id, req) VALUES ({mark}, {mark})"
        with self.engine.connect() as conn:
            last = _ending(conn, None)
        self._next_id, self._last_hash = (last[0] + 1, last[1]) if last else (1, GENESIS)

    def _sealed(self, keys: list[bytes]) -> tuple[list[tuple[int, bytes]], dict[int, bytes]]:
        with self.engine.connect() as conn:
            rows = conn.execute(select(seal.c.from_id, seal.c.tag).order_by(seal.c.id)).all()
        seals = [
            tuple(checked("seal", f"seal {i + 1}", {"from_id": from_id, "tag": tag}).values())
            for i, (from_id, tag) in enumerate(rows)
        ]
        found: dict[int, bytes] = {}
        for key in keys:
            made = [
                i
                for i, (from_id, tag) in enumerate(seals)
                if hmac.compare_digest(seal_tag(key, from_id), tag)
            ]
            if seals and not made:
                raise StoreError(
                    f"audit store {self.shown}: an audit key given is not one its chain is sealed with"
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
            raise StoreError(f"audit store {self.shown}: no key to seal with")
        if self._seals and not (rotate and len(self._seals) - 1 in self._keys):
            raise StoreError(
                f"audit store {self.shown}: sealed already (the current seal from record "
                f"{self._seals[-1][0]} on)" + ("; rotating its key needs the current one" if rotate else "")
            )
        if rotate and not self._seals:
            raise StoreError(f"audit store {self.shown}: not sealed, so there is no key to rotate")
        with self.engine.begin() as conn:
            last = _ending(conn, None)
            from_id = (last[0] if last else 0) + 1
            tag = seal_tag(key, from_id)
            conn.execute(seal.insert().values(from_id=from_id, tag=tag))
        self._seals.append((from_id, tag))
        self._keys[len(self._seals) - 1] = key
        if self.head_file is not None:  # from now on the head is sealed too
            head.create(self.head_file, from_id - 1, last[1] if last else GENESIS, key)
        return from_id

    def write_key(self) -> bytes | None:
        """The key new records and snapshots are bound with (None: plain SHA-256); StoreError
        if the store is sealed and this Store was not given its current key."""
        if not self._seals:
            return None
        key = self._keys.get(len(self._seals) - 1)
        if key is None:
            raise StoreError(
                f"audit store {self.shown}: its chain is sealed (the current seal from record "
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
            try:
                cursor = self._raw.cursor()
                if self._shared:  # another daemon may have appended: its end, under the lock
                    self._shared_end(cursor)
                prev, record_id = self._last_hash, self._next_id
                values = []
                also = []
                for row in rows:
                    (
                        kind,
                        node,
                        seq,
                        ts_ns,
                        body,
                        req,
                        tenant,
                        victim_tenant,
                        finding,
                        severity,
                        others,
                        ids,
                    ) = row
                    columns = (kind, node, seq, ts_ns, req, tenant, victim_tenant, finding, severity)
                    digest = chain(prev, record_id, columns, body, mac)
                    values.append((record_id, *columns, body, prev, digest))
                    prev = digest
                    if others:
                        also += [(record_id, other) for other in others]
                    record_id += ids
                cursor.executemany(self._insert, values)
                if also:
                    cursor.executemany(self._insert_named, also)
                cursor.close()
                self._raw.commit()
            except Exception as exc:  # any failure means: not durable
                with contextlib.suppress(Exception):  # the commit failure is what gets reported
                    self._raw.rollback()
                raise StoreError(f"audit store {self.shown}: commit failed: {exc}") from exc
            self._next_id, self._last_hash = record_id, prev
            self._last_row = values[-1][0]
            self._write_head(mac)
        if self._checkpoints is not None:
            self._checkpoints.set()
        elif self.url.startswith("sqlite"):
            self._checkpoints = threading.Event()
            name = "kvguard-store-checkpoint"
            threading.Thread(target=self._checkpoint_loop, name=name, daemon=True).start()
        return [v[0] for v in values]

    def _shared_end(self, cursor: Any) -> None:
        """The chain's end as it is now (other writers may have appended), read under the
        chain's lock; StoreError if what this writer appended last is no longer there as it
        wrote it (records removed from the end, or rewritten, while it runs): appending after
        the new end would hide that."""
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", (CHAIN_LOCK,))  # held until this commit ends
        if self._last_row:
            cursor.execute("SELECT hash FROM records WHERE id = %s", (self._last_row,))
            mine = cursor.fetchone()
            if mine is None or bytes(mine[0]) != self._last_hash:
                what = "gone" if mine is None else "altered"
                raise StoreError(
                    f"audit store {self.shown}: record {self._last_row}, which this writer appended, is "
                    f"{what}: not appending after it (see `kvguard audit verify`)"
                )
        cursor.execute("SELECT id, kind, body, hash FROM records ORDER BY id DESC LIMIT 1")
        end = cursor.fetchone()
        if end is not None:
            self._next_id = end[0] + run_ids(end[1], bytes(end[2]))
            self._last_hash = bytes(end[3])

    def _write_head(self, key: bytes | None) -> None:
        """After a commit: the chain's new head, beside the store. A head that cannot be written
        fails no commit (the records are durable; verify then proves completeness only up to the
        head it finds, and says so); it is said once."""
        if self.head_file is None:
            return
        try:
            head.write(self.head_file, self._next_id - 1, self._last_hash, key)
        except OSError as exc:
            if exc.strerror != self._head_failed:
                self._head_failed = exc.strerror or str(exc)
                log.warning(
                    f"audit store {self.shown}: its head file {self.head_file} cannot be written "
                    f"({self._head_failed}): completeness is proven only up to the head it holds"
                )
            return
        self._head_failed = ""
        self._head_unsynced = True

    def sync_head(self, *, now: bool = False) -> None:
        """Make the head written after the last commits durable: for the writer to call while it
        has nothing to commit, at most once every head.SYNC_EVERY_S (`now`: at once). Off the
        commit's path: a head lost to a crash of the machine lags, which verify tells apart
        from a store that lost records."""
        due = time.monotonic()
        if not self._head_unsynced or self.head_file is None or (not now and due < self._head_synced_at):
            return
        self._head_synced_at = due + head.SYNC_EVERY_S
        self._head_unsynced = False
        with contextlib.suppress(OSError):  # a head that cannot be written was said at its write
            head.sync(self.head_file)

    def completeness(self) -> head.Completeness:
        """What the head file proves of the store's end: complete through which record, or
        what is missing (records deleted from its end, the head forged or rewritten, or no
        head for a store that has records). A sealed store's head is proven with its current
        audit key only."""
        try:
            found = head.read(self.head_file) if self.head_file is not None else None
        except head.HeadError as exc:
            return head.Completeness(False, 0, str(exc))
        key = None
        if self._seals:
            key = self._keys.get(len(self._seals) - 1)
            if key is None:
                return head.Completeness(
                    False,
                    0,
                    "the head is sealed with the store's current audit key: proving it needs that key",
                )
        with self.engine.connect() as conn:
            end = _ending(conn, None)
            at_head = None
            if found is not None:
                at_head = (0, GENESIS) if found.count == 0 else _ending(conn, found.count)
        return head.judge(self.head_file, found, end[0] if end else 0, at_head, key)

    def adopt_head(self) -> int:
        """Write the head for the store as it stands (`kvguard audit head`: a store written
        before heads were kept, or one whose loss of records was looked into); returns its
        last record. Sealed with the current audit key, which a sealed store needs."""
        if self.head_file is None:
            raise StoreError(f"audit store {self.shown}: an in-memory store has no head")
        key = self.write_key()
        with self.engine.connect() as conn:
            end = _ending(conn, None)
        count, last = end if end else (0, GENESIS)
        head.create(self.head_file, count, last, key)
        return count

    def restart_wal(self) -> bool:
        """Let SQLite write its WAL from the start again; for the writer to call while it has
        nothing to commit, at most once every WAL_RESTART_S (True if it ran now). The
        checkpoint thread copies committed pages into the database file alongside the
        commits, but SQLite starts the WAL over only at a commit that finds every frame
        copied, which under a steady stream of commits never happens: the WAL grew faster than
        the store, without end, and every commit appended to a growing file. Copying the last
        few frames here, on the writer's own connection between commits, lets the next commit
        start the WAL over (unless a reader still reads old frames: then at a later call)."""
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
        """How many events, findings, commands, refused events or actions (`kind`), or all of
        them (None)."""
        c = records.c
        with self.engine.connect() as conn:
            if kind not in (None, "", "event"):
                return int(conn.execute(select(func.count()).where(c.kind == kind)).scalar_one())
            # Ids have no gaps: the last one counts them all.
            last = _ending(conn, None)
            total = last[0] if last else 0
            if not kind:
                return total
            others = conn.execute(
                select(func.count()).where(c.kind.in_(("finding", "command", "refused", "action", "receipt")))
            ).scalar_one()
            return total - int(others)

    def tenants(self) -> list[str]:
        """Every tenant a record names, as offender or as victim, sorted."""
        c = records.c
        query = (
            select(c.tenant).where(c.tenant != "").union(select(c.victim_tenant).where(c.victim_tenant != ""))
        )
        with self.engine.connect() as conn:
            return sorted(str(t) for (t,) in conn.execute(query))

    def events(self, after: int = 0) -> Iterator[pb.Event]:
        """The stored events after id `after`, in the order they were applied, parsed."""
        return reads.events(self.engine, after)

    def event_batches(
        self,
        after: int = 0,
        until: int | None = None,
        nodes: Collection[str] | None = None,
    ) -> Iterator[tuple[str, wire.Batch, int]]:
        """The stored events after id `after` (and, `until` a record's end, up to it; only
        those of `nodes`, if given), in the order they were applied, as their bytes: (node, its
        events, how many of them come before `after`) per record, a run's together (the daemon
        rebuilds its ledger from them at start, applying them as it applied them live)."""
        return reads.event_batches(self.engine, after, until, nodes)

    def first_event(self, nodes: Collection[str]) -> int:
        """The id of the first record of events of any of `nodes` (0: none)."""
        return reads.first_event(self.engine, nodes)

    def snapshot_covers(self, held: Collection[str], through: int, nodes: Collection[str]) -> bool:
        """Whether a snapshot of `held` taken after record `through` covers `nodes`: every node
        it does not hold stored nothing up to it (its events all come after, in order)."""
        missing = set(nodes) - set(held)
        first = self.first_event(missing) if missing else 0
        return not (0 < first <= through)

    def last_id(self) -> int:
        """The id the store ends at now (0: empty): always the end of a committed group."""
        with self.engine.connect() as conn:
            last = _ending(conn, None)
        return last[0] if last else 0

    def audit_keys(self) -> list[bytes]:
        """The audit keys this Store was given (for a process that opens the same store)."""
        return list(self._given)

    def rows(self, f: Filter | None = None, **where: Any) -> Iterator[tuple[int, str, bytes]]:
        """(id, kind, body) of the records the filter `f` takes, or the one `where` spells (its
        fields by name), in id order (reads.rows)."""
        return reads.rows(self.engine, f if f is not None else Filter(**where))

    def receipt_facts(self, reqs: Collection[str]) -> dict[str, reads.ReceiptFacts]:
        """The findings naming each request of `reqs` and its newest receipt (reads.py)."""
        return reads.receipt_facts(self.engine, reqs)

    def record_hashes(self, ids: Collection[int]) -> dict[int, bytes]:
        return reads.record_hashes(self.engine, ids)

    def newest_of(self, kind: str, n: int, nodes: Collection[str] | None = None) -> list[bytes]:
        return reads.newest_of(self.engine, kind, n, nodes)

    def events_of_kinds(
        self, after: int, kinds: Collection[int], nodes: Collection[str] | None = None
    ) -> Iterator[tuple[int, str, int, bytes]]:
        """(id, node, payload, bytes) of the events after id `after` of these payloads (reads.py)."""
        return reads.events_of_kinds(self.engine, after, kinds, nodes)

    def records_of(self, kind: str) -> Iterator[tuple[int, str, bytes]]:
        """(id, node, body) of every record of `kind` (not events), in id order: what the
        daemon restores its commands' and actions' state from at start."""
        return reads.records_of(self.engine, kind)

    def verify(self) -> tuple[bool, int, str]:
        """Walk the chain: (intact, records checked, what is wrong where). A sealed store is
        proven only with its audit key (reads.verify)."""
        return reads.verify(self.engine, self._seals, self._keys, bool(self._given))

    def save_snapshot(self, body: bytes, through: int | None = None, part_bytes: int = SNAPSHOT_PART) -> int:
        """Store a snapshot of the state after record `through` (default: the last record
        committed, by any writer), its body in parts of `part_bytes` (snapshot_rows.py); returns
        that record's id. Keeps the newest SNAPSHOTS_KEPT."""
        mac = self.write_key()
        with self.engine.begin() as conn:
            last = _ending(conn, through)
            if through is not None and (last is None or last[0] != through):
                raise StoreError(
                    f"audit store {self.shown}: no record ends at id {through} to snapshot after"
                )
            through, after = last if last else (0, GENESIS)
            snapshot_rows.insert(conn, through, body, snapshot_digest(after, body, mac), part_bytes)
        return int(through)

    def latest_snapshot(self) -> tuple[int, bytes] | str:
        """(the last record it includes, its body) of the newest snapshot, or why there is
        none to use: a snapshot whose digest does not match the chain at its record is not."""
        with self.engine.connect() as conn:
            found = snapshot_rows.latest(conn)
        if isinstance(found, str):
            return found
        through, body, digest = found
        wrong = self.unbound(through, body, digest)
        return wrong if wrong is not None else (int(through), body)

    def bind(self, through: int, body: bytes) -> bytes:
        """The digest that binds a snapshot taken after record `through` to the chain there,
        for a snapshot kept outside the store (a cell's, on the bus). StoreError if no record
        ends there."""
        with self.engine.connect() as conn:
            last = _ending(conn, through) if through else None
        if through and (last is None or last[0] != through):
            raise StoreError(f"audit store {self.shown}: no record ends at id {through} to snapshot after")
        return snapshot_digest(last[1] if last else GENESIS, body, self.write_key())

    def unbound(self, through: int, body: bytes, digest: bytes) -> str | None:
        """Why a snapshot taken after record `through` with `digest` does not match the chain
        there (None: it does)."""
        try:
            with self.engine.connect() as conn:
                last = _ending(conn, through) if through else None
        except RowError as exc:
            return str(exc)
        if through and (last is None or last[0] != through):
            return f"the snapshot's record {through} is not in the store"
        try:
            key = self.write_key()  # snapshots are bound under the current seal's key
        except StoreError:
            return "the store is sealed: checking its snapshot needs its current audit key"
        if snapshot_digest(last[1] if last else GENESIS, body, key) != digest:
            return f"the snapshot taken after record {through} does not match the chain there"
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.sync_head(now=True)
        if self._checkpoints is not None:
            self._checkpoints.set()
        self._raw.close()
        self.engine.dispose()
