"""The dashboard's screens as an operator sees them, at 80x24 and at 160x48, compared with their
accepted SVGs (pytest-textual-snapshot; `--snapshot-update` writes them after a change that
was looked at). The data is a real daemon's, fed the fixed fleet (conftest: fixed ts_ns, the
daemon's clock, rates, ages and store size pinned by the client's test hook), so a screen is
the same on every run. The 160x48 SVGs of the fleet, pool map, alerts and timeline are also
docs/top-*.svg, for the README (test_the_docs_show_the_screens_as_they_are)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import DataTable

from kvguard.tui.app import TopApp
from kvguard.tui.widgets.table import RowTable

SIZES = {"80x24": (80, 24), "160x48": (160, 48)}
SNAPSHOTS = Path(__file__).parent / "__snapshots__" / "test_snapshots"
DOCS = Path(__file__).parents[2] / "docs"
Until = Callable[..., Awaitable[None]]


def loaded(app: TopApp) -> bool:
    """Every answer a screen draws from is in (the fleet, all 14 alerts: 9 findings and updates
    of them: g1's fate, the ends of its 3 runs of repeats, the acknowledgement of the drift;
    the acknowledgement), and the screen's lists have measured their columns."""
    answered = app.data.fleet is not None and len(app.data.alerts) == 14 and bool(app.data.acks)
    return answered and all(table.settled for table in app.screen.query(RowTable))


@pytest.mark.parametrize("size", SIZES)
def test_fleet(snap_compare, shared_fleet, until: Until, size: str) -> None:
    app = shared_fleet.app()

    async def ready(pilot: Pilot) -> None:
        await until(pilot, lambda: app.screen.query_one("#nodes", DataTable).row_count == 4 and loaded(app))

    assert snap_compare(app, terminal_size=SIZES[size], run_before=ready)


@pytest.mark.parametrize("size", SIZES)
def test_pool_map(snap_compare, shared_fleet, until: Until, size: str) -> None:
    app = shared_fleet.app(screen="pool", node="c0")

    async def ready(pilot: Pilot) -> None:
        await until(pilot, lambda: loaded(app) and app.data.pool_map is not None)

    assert snap_compare(app, terminal_size=SIZES[size], run_before=ready)


@pytest.mark.parametrize("size", SIZES)
def test_alerts(snap_compare, shared_fleet, until: Until, size: str) -> None:
    app = shared_fleet.app(screen="alerts")

    async def ready(pilot: Pilot) -> None:
        await until(pilot, lambda: app.screen.query_one("#alerts", DataTable).row_count == 14 and loaded(app))

    assert snap_compare(app, terminal_size=SIZES[size], run_before=ready)


@pytest.mark.parametrize("size", SIZES)
def test_timeline(snap_compare, shared_fleet, until: Until, size: str) -> None:
    """The leak: globex's g1, rejected at prefill, read acme's a1's KV at decode."""
    app = shared_fleet.app(screen="alerts")

    async def ready(pilot: Pilot) -> None:
        await until(pilot, lambda: loaded(app))
        await pilot.press("slash", *"stale_read", "enter")
        await until(pilot, lambda: app.screen.query_one("#alerts", DataTable).row_count == 2)
        await pilot.press("down", "enter")
        await until(pilot, lambda: app.data.timeline is not None and app.data.timeline.loaded)

    assert snap_compare(app, terminal_size=SIZES[size], run_before=ready)


@pytest.mark.parametrize("size", SIZES)
def test_help(snap_compare, shared_fleet, until: Until, size: str) -> None:
    app = shared_fleet.app()

    async def ready(pilot: Pilot) -> None:
        await until(pilot, lambda: loaded(app))
        await pilot.press("question_mark")

    assert snap_compare(app, terminal_size=SIZES[size], run_before=ready)


@pytest.mark.parametrize("screen", ["fleet", "pool_map", "alerts", "timeline"])
def test_the_docs_show_the_screens_as_they_are(screen: str) -> None:
    """docs/top-SCREEN.svg is the accepted 160x48 snapshot (copy it over after an update)."""
    snapshot = SNAPSHOTS / f"test_{screen}[160x48].svg"
    doc = DOCS / f"top-{screen.replace('_', '-')}.svg"
    assert doc.read_text() == snapshot.read_text(), f"cp '{snapshot}' {doc}"
