"""How a ledger snapshot's body lies in the store: in parts of at most SNAPSHOT_PART bytes
(rows of `snapshot_parts`, numbered from 0), so that no SQL value holds a large ledger whole;
a snapshot stored before parts existed (`parts` 0) has its body whole in `snapshots.body`.

Invariant: a snapshot is read back whole or not at all: its parts are exactly 0..parts-1, each
within SNAPSHOT_PART, and what they make is then checked against the chain as one body
(store.py); a snapshot whose body is missing, empty or in pieces that do not fit is a reason
to replay the store, said in one line that names the snapshot.
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import select

from kvguard.daemon.store.schema import SNAPSHOTS_KEPT, RowError, checked, snapshot_parts, snapshots

SNAPSHOT_PART = 64 << 20  # bytes of a snapshot's body a row holds


def insert(conn: Any, through: int, body: bytes, digest: bytes, part_bytes: int = SNAPSHOT_PART) -> None:
    """Store a snapshot taken after record `through` (its body in parts of `part_bytes`), and
    keep only the newest SNAPSHOTS_KEPT (in the caller's transaction)."""
    view = memoryview(body)
    count = -(-len(view) // part_bytes)
    row = conn.execute(
        snapshots.insert().values(
            through_id=through, created_ns=time.time_ns(), body=b"", digest=digest, parts=count
        )
    )
    snapshot_id = row.inserted_primary_key[0]
    for part in range(count):  # one at a time: a list of every part would copy the body whole
        piece = bytes(view[part * part_bytes : (part + 1) * part_bytes])
        conn.execute(snapshot_parts.insert().values(snapshot_id=snapshot_id, part=part, body=piece))
    kept = select(snapshots.c.id).order_by(snapshots.c.id.desc()).limit(SNAPSHOTS_KEPT).scalar_subquery()
    conn.execute(snapshot_parts.delete().where(snapshot_parts.c.snapshot_id.not_in(kept)))
    conn.execute(snapshots.delete().where(snapshots.c.id.not_in(kept)))


def latest(conn: Any) -> tuple[int, bytes, bytes] | str:
    """(the record it was taken after, its body, its digest) of the newest snapshot, or why it
    cannot be read back ("no snapshot" if there is none)."""
    row = conn.execute(
        select(
            snapshots.c.id, snapshots.c.through_id, snapshots.c.body, snapshots.c.digest, snapshots.c.parts
        )
        .order_by(snapshots.c.id.desc())
        .limit(1)
    ).first()
    if row is None:
        return "no snapshot"
    snapshot_id, through, whole, digest, parts = row
    try:  # a row edited outside kvguard is named, not a traceback
        through, whole, digest = checked(
            "snapshots", "the newest snapshot", {"through_id": through, "body": whole, "digest": digest}
        ).values()
    except RowError as exc:
        return str(exc)
    name = f"the snapshot taken after record {through}"
    if not parts:
        if not whole:
            return f"{name} has an empty body"
        return int(through), bytes(whole), bytes(digest)
    pieces = []
    query = select(snapshot_parts.c.part, snapshot_parts.c.body).where(
        snapshot_parts.c.snapshot_id == snapshot_id
    )
    for part, piece in conn.execute(query.order_by(snapshot_parts.c.part)):
        try:  # a part edited outside kvguard (text where its bytes belong) is named, not a traceback
            part, piece = checked("snapshot_parts", f"{name}: a part", {"part": part, "body": piece}).values()
        except RowError as exc:
            return str(exc)
        if part != len(pieces) or part >= parts:
            return f"{name} has part {part} where part {len(pieces)} of {parts} belongs"
        if not piece or len(piece) > SNAPSHOT_PART:
            return f"{name}: its part {part} holds {len(piece)} bytes (1 to {SNAPSHOT_PART})"
        pieces.append(piece)
    if len(pieces) != parts:
        return f"{name} has {len(pieces)} of its {parts} parts"
    return int(through), b"".join(pieces), bytes(digest)
