"""The audit store: events, findings and commands in one append-only hash chain.

- store.py: `Store` (append, snapshots, seals, the WAL's upkeep), the one writer of a store;
- rows.py: the rows appended (`Record`; a batch's runs from its heads, `rows_of`);
- chain.py: the hash chain, snapshot digests, seals and audit keys;
- snapshot_rows.py: a ledger snapshot's body, stored in parts;
- reads.py: rebuild reads, filtered queries (proto/filter.py), the chain's proof (`verify`);
- schema.py: the tables, their migrations (daemon/migrations) and `store_url`.
"""

from kvguard.daemon.store.chain import GENESIS, AuditKeyError, new_audit_key, read_audit_key
from kvguard.daemon.store.rows import RUN_MAX, RUN_SPAN_NS, EventRun, Record, named_of, rows_of, run_rows
from kvguard.daemon.store.schema import (
    RowError,
    first_line,
    migrate,
    migrations,
    missing_store,
    shown_url,
    store_url,
)
from kvguard.daemon.store.store import Store, StoreError

__all__ = [
    "GENESIS",
    "RUN_MAX",
    "RUN_SPAN_NS",
    "AuditKeyError",
    "EventRun",
    "Record",
    "RowError",
    "Store",
    "StoreError",
    "first_line",
    "migrate",
    "migrations",
    "missing_store",
    "named_of",
    "new_audit_key",
    "read_audit_key",
    "rows_of",
    "run_rows",
    "shown_url",
    "store_url",
]
