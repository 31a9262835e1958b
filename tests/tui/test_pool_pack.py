"""A pool map packed into the cells a terminal has: every page in exactly one cell, the least
pages a cell that fits, and a cell shows the most telling of its pages (a quarantined or held
page is never hidden behind free ones), coloured by that page's tenant."""

from __future__ import annotations

import numpy as np
import pytest

from kvguard.proto.pool_map import PAGE_STATE, PAGE_STATES
from kvguard.tui.pool_pack import UNKNOWN, pack, pages_per_cell, state_counts, tenant_counts

FREE, OWNED, SHARED = PAGE_STATE["free"], PAGE_STATE["owned"], PAGE_STATE["shared"]
OFFLOAD, QUARANTINED, RESERVED = PAGE_STATE["offload"], PAGE_STATE["quarantined"], PAGE_STATE["reserved"]


def test_a_pool_that_fits_is_one_page_a_cell() -> None:
    states = bytes([RESERVED, OWNED, OWNED, FREE, SHARED])
    packed = pack(states, [0, 1, 1, 0, 2], cells=80 * 20)
    assert packed.per_cell == 1 and packed.pages == 5 and packed.cells == 5
    assert packed.states.tolist() == list(states) and packed.tenants.tolist() == [0, 1, 1, 0, 2]


@pytest.mark.parametrize(
    ("pages", "cells", "per"), [(0, 10, 1), (10, 10, 1), (11, 10, 2), (100, 7, 15), (1, 1, 1)]
)
def test_pages_per_cell_is_the_least_that_fits(pages: int, cells: int, per: int) -> None:
    assert pages_per_cell(pages, cells) == per
    assert -(-pages // per) <= cells and (per == 1 or -(-pages // (per - 1)) > cells)


def test_a_map_needs_a_cell() -> None:
    with pytest.raises(ValueError, match="at least one cell"):
        pages_per_cell(10, 0)


def test_a_packed_cell_shows_its_most_telling_page_in_that_pages_tenant() -> None:
    # 10 pages into 4 cells: 3 a cell (pages 0-2, 3-5, 6-8, 9)
    states = bytes([FREE, OWNED, FREE, QUARANTINED, OWNED, OFFLOAD, RESERVED, FREE, FREE, SHARED])
    tenants = [0, 1, 0, 0, 2, 3, 0, 0, 0, 4]
    packed = pack(states, tenants, cells=4)
    assert packed.per_cell == 3 and packed.cells == 4
    assert packed.states.tolist() == [OWNED, QUARANTINED, RESERVED, SHARED]
    assert packed.tenants.tolist() == [1, 0, 0, 4]
    # held by an offload outranks a live owner: the page is still used after its request
    assert pack(bytes([OWNED, OFFLOAD]), [1, 2], cells=1).states.tolist() == [OFFLOAD]
    assert pack(bytes([OWNED, OFFLOAD]), [1, 2], cells=1).tenants.tolist() == [2]


def test_a_large_pool_is_packed_without_losing_a_quarantined_page() -> None:
    states = np.full(1_000_003, FREE, dtype=np.uint8)
    states[777_777] = QUARANTINED
    packed = pack(states.tobytes(), [], cells=80 * 18)
    assert packed.per_cell == 695 and packed.cells == 1439 <= 80 * 18
    assert packed.states.tolist().count(QUARANTINED) == 1
    assert packed.states[777_777 // 695] == QUARANTINED
    assert set(packed.tenants.tolist()) == {0}  # a daemon that sends no tenants: nobody's


def test_a_newer_daemons_state_is_unknown_and_outranks_all_but_quarantine() -> None:
    newer = len(PAGE_STATES) + 3
    packed = pack(bytes([FREE, newer, OWNED, OFFLOAD]), [0, 0, 1, 1], cells=2)
    assert packed.states.tolist() == [UNKNOWN, OFFLOAD]
    assert pack(bytes([newer, QUARANTINED]), [], cells=1).states.tolist() == [QUARANTINED]


def test_counts_for_the_legend() -> None:
    states = bytes([RESERVED, OWNED, OWNED, FREE, SHARED, OFFLOAD, QUARANTINED, 200])
    assert state_counts(states) == {
        "free": 1,
        "owned": 2,
        "shared": 1,
        "offload": 1,
        "quarantined": 1,
        "reserved": 1,
        "unknown": 1,
    }
    # free, reserved and quarantined pages are nobody's; held pages are still their tenant's
    assert tenant_counts(states, [0, 1, 1, 2, 2, 3, 1, 4]) == {1: 2, 2: 1, 3: 1, 4: 1}
