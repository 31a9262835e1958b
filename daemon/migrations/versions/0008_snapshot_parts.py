"""Ledger snapshots in parts: a large ledger's snapshot is more than one SQL value may hold
(SQLite's driver refuses a BLOB longer than INT_MAX; PostgreSQL's bytea ends at 1 GB), so its
body is stored as rows of `snapshot_parts`, at most daemon/store/store.py's SNAPSHOT_PART bytes
each, and `snapshots.parts` says how many (0: the whole body is in `snapshots.body`, as every
snapshot before this revision).

Revision ID: 0008
Revises: 0007
"""

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"


def upgrade() -> None:
    op.add_column("snapshots", sa.Column("parts", sa.Integer(), nullable=False, server_default="0"))
    op.create_table(
        "snapshot_parts",
        sa.Column("snapshot_id", sa.BigInteger(), nullable=False),
        sa.Column("part", sa.Integer(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.PrimaryKeyConstraint("snapshot_id", "part"),
    )


def downgrade() -> None:
    op.drop_table("snapshot_parts")
    with op.batch_alter_table("snapshots") as batch:
        batch.drop_column("parts")
