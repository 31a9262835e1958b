"""The index of named requests is kept behind the chain: the writer no longer inserts a
record's names in the commit that appends it (with requests named at random, as engines
name them, each name is a B-tree leaf of its own: 34 of a commit's 46 WAL frames on the
ingest benchmark's groups, on the path of every ack and alert) but merges them in sorted
batches while it has nothing to commit (~20 frames a commit's worth, written without waiting
for the disk). `named_until` holds where the index stands: the
records before its id have all their names in `named`; from it on, none do yet, and queries
by request read those records' bodies instead. Every record existing here is indexed
already (0006 on), so it starts past the last one.

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"


def upgrade() -> None:
    op.create_table("named_until", sa.Column("record_id", sa.BigInteger(), nullable=False))
    # A run's later ids are inside it, so one past the last record's first id covers it.
    op.execute("INSERT INTO named_until (record_id) SELECT COALESCE(MAX(id), 0) + 1 FROM records")


def downgrade() -> None:
    # Below 0008 every record's names are in the index: derive those it had not merged yet.
    from kvguard.daemon.store import named_of

    conn = op.get_bind()
    until = conn.execute(sa.text("SELECT record_id FROM named_until")).scalar_one()
    found = conn.execute(
        sa.text("SELECT id, kind, body FROM records WHERE id >= :until ORDER BY id"), {"until": until}
    )
    rows = [{"record_id": i, "req": req} for i, kind, body in found for req in named_of(kind, bytes(body))]
    if rows:
        conn.execute(sa.text("INSERT INTO named (record_id, req) VALUES (:record_id, :req)"), rows)
    op.drop_table("named_until")
