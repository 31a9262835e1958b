"""Drop the unique (node, seq) index of events: the ledger already refuses a repeated (node, seq)
before anything is stored (it is rebuilt from the store, so it knows every stored event), and
this index was the store's costliest: interleaved nodes spread its inserts over the B-tree
(bench/RESULTS-history-2026-12-02.md has the measurement). A query by node selects about 1/N
of all events, which a scan serves as well as an index did.

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    op.drop_index("records_event_node_seq", table_name="records")


def downgrade() -> None:
    op.create_index(
        "records_event_node_seq",
        "records",
        ["node", "seq"],
        unique=True,
        sqlite_where=sa.text("kind = 'event'"),
        postgresql_where=sa.text("kind = 'event'"),
    )
