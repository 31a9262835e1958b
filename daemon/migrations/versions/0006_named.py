"""The requests a record names beyond its `req` column, indexed: the other entries of a read
launch (a decode step attends to a whole batch) and a finding's victim. Without it, the
timeline of one request (`kvguard audit request`) scanned every event of the store for the
launches that list it after another request. Derived from the records' bodies (outside the
hash chain, like the snapshots); `audit verify` checks it against them. Existing records are
indexed here.

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    from kvguard.daemon.store import named_of  # what the writer indexes, the same way

    table = op.create_table(
        "named",
        sa.Column("record_id", sa.BigInteger(), nullable=False),
        sa.Column("req", sa.String(256), nullable=False),
    )
    op.create_index("named_req", "named", ["req", "record_id"])
    conn = op.get_bind()
    found = conn.execute(
        sa.text("SELECT id, kind, body FROM records WHERE kind IN ('event', 'finding') ORDER BY id")
    )
    rows: list[dict[str, object]] = []
    for record_id, kind, body in found:
        rows += [{"record_id": record_id, "req": req} for req in named_of(kind, bytes(body))]
        if len(rows) >= 10_000:
            conn.execute(table.insert(), rows)
            rows = []
    if rows:
        conn.execute(table.insert(), rows)


def downgrade() -> None:
    op.drop_table("named")
