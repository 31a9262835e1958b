"""Shared fixtures: an audit store URL for each backend the daemon supports.

`store_url` runs a test against SQLite (a file) and against a real PostgreSQL server (a
fresh database per test on the server named by KVGUARD_TEST_PG, which .ci/run installs and
starts). In CI a missing PostgreSQL server fails the tests instead of skipping them.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.exc import OperationalError

PG = os.environ.get("KVGUARD_TEST_PG", "postgresql+psycopg://kvguard:kvguard@127.0.0.1:5432/kvguard_test")


@pytest.fixture(params=["sqlite", "postgresql"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    if request.param == "sqlite":
        yield str(tmp_path / "audit.db")
        return
    admin = create_engine(PG, isolation_level="AUTOCOMMIT")
    name = f"kvguard_t_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as exc:
        admin.dispose()
        if os.environ.get("CI"):
            pytest.fail(f"no PostgreSQL server at {PG}: {exc}")
        pytest.skip(f"no PostgreSQL server at {PG} (set KVGUARD_TEST_PG): {exc.orig}")
    try:
        yield make_url(PG).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
