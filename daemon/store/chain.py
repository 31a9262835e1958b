"""The audit store's hash chain and its keys: each record's hash covers its id, every column
and the previous record's hash (SHA-256, or HMAC-SHA256 under an audit key once the store is
sealed); snapshots are bound to the chain at the record they were taken after; a seal is
tagged with its key.

Invariant: only the holder of an audit key can make (or recompute) a sealed record's hash, a
snapshot's digest in a sealed store, or a seal's tag; a key file anyone but its owner may read
or write is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from collections.abc import Sequence
from typing import Any

GENESIS = bytes(32)
MIN_KEY_BYTES = 32
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


def chain(prev: bytes, record_id: int, columns: Sequence[Any], body: bytes, key: bytes | None) -> bytes:
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
    return digest(data, key)


def digest(data: bytes, key: bytes | None) -> bytes:
    """SHA-256 of `data`, or under an audit key HMAC-SHA256 (which only the key's holder can make)."""
    return hashlib.sha256(data).digest() if key is None else hmac.digest(key, data, "sha256")


def snapshot_digest(after: bytes, body: bytes, key: bytes | None) -> bytes:
    """What binds a snapshot to the record it was taken after: the digest of that record's
    hash and the body (under the audit key in a sealed store)."""
    return digest(after + body, key)


def seal_tag(key: bytes, from_id: int) -> bytes:
    return digest(b"kvguard audit seal from %d" % from_id, key)


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
