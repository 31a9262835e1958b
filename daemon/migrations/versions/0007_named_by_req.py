"""The index of named requests as one B-tree keyed by (req, record_id): a WITHOUT ROWID table
in SQLite, the primary key in PostgreSQL. Before, SQLite kept the rows twice, in the table (by
rowid) and in its index `named_req`: every row was two inserts, and every commit wrote the
table's last leaf besides the index leaves it touched. Queries read the index only (by
request, or all of it for `audit verify`), so the table's own order served nothing, and each
commit writes fewer WAL frames (bench/RESULTS-history-2026-12-02.md).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"


def upgrade() -> None:
    op.create_table(
        "named_by_req",
        sa.Column("req", sa.String(256), nullable=False),
        sa.Column("record_id", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("req", "record_id"),
        sqlite_with_rowid=False,
    )
    op.execute("INSERT INTO named_by_req (req, record_id) SELECT DISTINCT req, record_id FROM named")
    op.drop_table("named")
    op.rename_table("named_by_req", "named")


def downgrade() -> None:
    op.create_table(
        "named_by_id",
        sa.Column("record_id", sa.BigInteger(), nullable=False),
        sa.Column("req", sa.String(256), nullable=False),
    )
    op.execute("INSERT INTO named_by_id (record_id, req) SELECT record_id, req FROM named ORDER BY record_id")
    op.drop_table("named")
    op.rename_table("named_by_id", "named")
    op.create_index("named_req", "named", ["req", "record_id"])
