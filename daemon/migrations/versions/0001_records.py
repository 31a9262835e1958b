"""The append-only audit log: one hash-chained table of records (events, findings, commands).

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def upgrade() -> None:
    op.create_table(
        "records",
        sa.Column(
            "id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True, autoincrement=False
        ),
        sa.Column("kind", sa.String(16), nullable=False),
        sa.Column("node", sa.String(128), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("ts_ns", sa.BigInteger(), nullable=False),
        sa.Column("req", sa.String(256), nullable=False),
        sa.Column("tenant", sa.String(128), nullable=False),
        sa.Column("victim_tenant", sa.String(128), nullable=False),
        sa.Column("finding", sa.String(32), nullable=False),
        sa.Column("severity", sa.String(16), nullable=False),
        sa.Column("body", sa.LargeBinary(), nullable=False),
        sa.Column("prev_hash", sa.LargeBinary(32), nullable=False),
        sa.Column("hash", sa.LargeBinary(32), nullable=False),
    )
    # Redelivery is idempotent: an event is stored once per (node, seq).
    op.create_index(
        "records_event_node_seq",
        "records",
        ["node", "seq"],
        unique=True,
        sqlite_where=sa.text("kind = 'event'"),
        postgresql_where=sa.text("kind = 'event'"),
    )
    op.create_index("records_req", "records", ["req"])
    op.create_index("records_tenant", "records", ["tenant"])
    op.create_index("records_kind_ts", "records", ["kind", "ts_ns"])


def downgrade() -> None:
    op.drop_table("records")
