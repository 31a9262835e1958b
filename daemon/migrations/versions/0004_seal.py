"""The audit key's seal: from record `from_id` on, each record's hash is an HMAC-SHA256 under a
key kept outside the database, so that whoever can write the database but does not hold the
key cannot rewrite the chain unnoticed (a plain SHA-256 chain can be recomputed wholesale).
`tag` = HMAC(key, "kvguard audit seal from <from_id>") tells a wrong key from a rewrite. At
most one row.

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    op.create_table(
        "seal",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("from_id", sa.BigInteger(), nullable=False),  # the first sealed record
        sa.Column("tag", sa.LargeBinary(32), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("seal")
