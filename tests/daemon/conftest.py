"""The daemon's test files' fixture: a daemon process on each store backend (`daemon`); the
helpers they share are in tests/support/daemon_helpers.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvguard.cli.process import Service, start_daemon


@pytest.fixture
def daemon(store_url: str) -> Iterator[Service]:
    d = start_daemon(store_url)
    yield d
    d.stop()
