"""The audit store's schema (tables), its migrations (Alembic, daemon/migrations) and where a
store lies (`store_url`).

Invariant: the schema is created and changed only by the migrations; a value read that its
column cannot hold (SQLite keeps any value in any column: a row edited outside kvguard) is
refused by name (`RowError`: the row, the column, what it holds), never passed on; `records` is the hash
chain (append-only, one id per event, finding or command), `named` indexes every request a
record names beyond its `req` column but a step's batch (derived, outside the chain; a
request's steps are found within its span on each node, reads.py), `snapshots` (their bodies
whole or in `snapshot_parts`) and `seal` are bound to the chain (store.py, chain.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

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
    inspect,
    make_url,
)
from sqlalchemy.exc import ArgumentError

from kvguard.proto.limits import NODE_BYTES, REQ_BYTES, TENANT_BYTES

MIGRATIONS = Path(__file__).resolve().parent.parent / "migrations"

metadata = MetaData()
records = Table(
    "records",
    metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True, autoincrement=False),
    Column("kind", String(16), nullable=False),
    Column("node", String(NODE_BYTES), nullable=False),
    Column("seq", BigInteger(), nullable=False),
    Column("ts_ns", BigInteger(), nullable=False),
    Column("req", String(REQ_BYTES), nullable=False),
    Column("tenant", String(TENANT_BYTES), nullable=False),
    Column("victim_tenant", String(TENANT_BYTES), nullable=False),
    Column("finding", String(32), nullable=False),
    Column("severity", String(16), nullable=False),
    Column("body", LargeBinary(), nullable=False),
    Column("prev_hash", LargeBinary(32), nullable=False),
    Column("hash", LargeBinary(32), nullable=False),
)
COLUMNS = ("kind", "node", "seq", "ts_ns", "req", "tenant", "victim_tenant", "finding", "severity")
snapshots = Table(
    "snapshots",
    metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    Column("through_id", BigInteger(), nullable=False),
    Column("created_ns", BigInteger(), nullable=False),
    Column("body", LargeBinary(), nullable=False),
    Column("digest", LargeBinary(32), nullable=False),
    Column("parts", Integer(), nullable=False, server_default="0"),  # 0: the body is whole in `body`
)
# A snapshot's body in parts (migration 0008): no SQL value need hold a large ledger whole.
snapshot_parts = Table(
    "snapshot_parts",
    metadata,
    Column("snapshot_id", BigInteger(), primary_key=True, autoincrement=False),
    Column("part", Integer(), primary_key=True, autoincrement=False),
    Column("body", LargeBinary(), nullable=False),
)
SNAPSHOTS_KEPT = 2
seal = Table(
    "seal",
    metadata,
    Column("id", BigInteger().with_variant(Integer(), "sqlite"), primary_key=True),
    Column("from_id", BigInteger(), nullable=False),
    Column("tag", LargeBinary(32), nullable=False),
)
# The requests a record names beyond its `req` column (migration 0006): derived, outside the
# chain; one B-tree by request (0007: WITHOUT ROWID in SQLite), as the queries read it.
named = Table(
    "named",
    metadata,
    Column("req", String(REQ_BYTES), primary_key=True),
    Column("record_id", BigInteger(), primary_key=True, autoincrement=False),
    sqlite_with_rowid=False,
)


class RowError(ValueError):
    """A row holding a value its column cannot (text in an integer column, ...): which row,
    which column, what it holds. Only an edit outside kvguard makes one."""


def _python_type(column: Column[Any]) -> type:
    return bytes if isinstance(column.type, LargeBinary) else str if isinstance(column.type, String) else int


# What each column of each table reads back as: int, str or bytes.
_TYPES = {
    t.name: {c.name: _python_type(c) for c in t.columns}
    for t in (records, snapshots, snapshot_parts, seal, named)
}
_WANTED = {int: "an integer", str: "text", bytes: "a blob"}


def _described(value: Any) -> str:
    if value is None:
        return "NULL"
    if isinstance(value, str):
        return f"text {value[:24]!r}" + ("..." if len(value) > 24 else "")
    if isinstance(value, bytes | memoryview):
        return f"a blob of {len(value)} bytes"
    return f"{type(value).__name__} {value!r}"


def checked(table: str, label: str, values: dict[str, Any]) -> dict[str, Any]:
    """`values` (a row's columns of `table` by name), each of its column's type (a blob as
    bytes), or RowError naming `label` (the row: "record 11"), the column and what it holds."""
    types = _TYPES[table]
    for name, value in values.items():
        want = types[name]
        if want is bytes and isinstance(value, memoryview):
            values[name] = value = bytes(value)
        if type(value) is not want:  # bool is an int, but no column reads back as one
            raise RowError(f"{label}: column {name} holds {_described(value)}, not {_WANTED[want]}")
    return values


def store_url(where: str) -> str:
    """A SQLAlchemy URL, or a plain file path taken as a SQLite database."""
    return where if "://" in where else f"sqlite:///{Path(where).resolve()}"


def first_line(exc: BaseException) -> str:
    """What a failure said, in one line: a driver's own words, without SQLAlchemy's statement
    and background link."""
    said = str(getattr(exc, "orig", None) or exc).strip() or type(exc).__name__
    return said.splitlines()[0]


def missing_store(where: str) -> str | None:
    """Why `where` names no audit store to read (no such file, not a file, no `records`
    table, unreachable), or None; it creates nothing (`Store()` would create what is missing)."""
    url = store_url(where)
    try:
        parsed = make_url(url)
    except ArgumentError:
        return f"--store {where!r} is neither a SQLAlchemy URL nor a file path"
    database = parsed.database or ""
    local = parsed.drivername.startswith("sqlite") and database not in ("", ":memory:")
    if local and not database.startswith("file:"):
        path = Path(database)
        if not path.exists():
            return f"no audit store at {where} (no such file)"
        if not path.is_file():
            return f"audit store {where} is not a file"
    try:
        probe = create_engine(url)
        try:
            has_records = inspect(probe).has_table("records")
        finally:
            probe.dispose()
    except Exception as exc:  # driver missing, not a database, unreachable server
        shown = shown_url(where) if "://" in where else where  # as given, its password masked
        return f"cannot open audit store {shown}: {first_line(exc)}"
    return None if has_records else f"{where} is not a kvguard audit store (no records table)"


def shown_url(url: str) -> str:
    """The store's URL as logs and messages show it: its password masked."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return url.split("://", 1)[0] + "://(unparsable URL)"


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
