"""Drop the tenant index: no query could use it. A tenant matches as offender or as victim
(`tenant = T OR victim_tenant = T`), and neither SQLite nor PostgreSQL serves that OR from an
index on one of its two columns (both plans checked with EXPLAIN: a scan; the exposure
report's kind = finding narrows it to the findings first), while every event paid for the
index on insert (measured in bench/RESULTS-history-2026-12-02.md).
Queries by request (records_req) and by kind and time (records_kind_ts) keep theirs.

Revision ID: 0005
Revises: 0004
"""

from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    op.drop_index("records_tenant", table_name="records")


def downgrade() -> None:
    op.create_index("records_tenant", "records", ["tenant"])
