"""Alembic environment of the audit store: runs on the connection the store hands over
(`config.attributes["connection"]`), or on `sqlalchemy.url` when run by the alembic CLI."""

from alembic import context
from sqlalchemy import create_engine

connection = context.config.attributes.get("connection")
if connection is not None:
    context.configure(connection=connection)
    with context.begin_transaction():
        context.run_migrations()
else:
    engine = create_engine(context.config.get_main_option("sqlalchemy.url"))
    with engine.begin() as conn:
        context.configure(connection=conn)
        with context.begin_transaction():
            context.run_migrations()
