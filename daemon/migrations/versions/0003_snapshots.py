"""Ledger snapshots, so that a restart loads the latest one and replays only the events after
it. Not part of the hash chain (they are derived from it, and may be deleted): each is bound
to the record it was taken after by `digest` = SHA-256(that record's hash, body).

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    op.create_table(
        "snapshots",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("through_id", sa.BigInteger(), nullable=False),  # the last record it includes
        sa.Column("created_ns", sa.BigInteger(), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("digest", sa.LargeBinary(32), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("snapshots")
