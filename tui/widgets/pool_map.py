"""The pool map widget: a pool's pages as a dense grid of cells, one glyph and colour a cell,
packed to the widget's size (tui/pool_pack.py), with its legend: the scale (pages a cell), each
state's glyph and page count, and each tenant's colour and pages held.

Each row starts with the number of its first page; a row has a power of two of cells.

Invariants: each state has its own glyph, so the map reads without colour too (free `·`,
owned `█`, shared `▓`, offload `o`, transfer `t`, prefix_cache `p`, abort `a`, quarantined `X`,
reserved `#`, unknown `?`); the tenant colours are assigned by the tenant's name, so a tenant
keeps its colour from one refresh to the next; the map never draws more cells than it has room
for.
"""

from __future__ import annotations

import zlib

from rich.text import Text
from textual.widget import Widget

from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.pool_map import PAGE_STATES
from kvguard.tui.pool_pack import UNKNOWN, pack, pages_per_cell, state_counts, tenant_counts

GLYPHS: dict[str, str] = {
    "free": "·",
    "owned": "█",
    "shared": "▓",
    "offload": "o",
    "transfer": "t",
    "prefix_cache": "p",
    "abort": "a",
    "quarantined": "X",
    "reserved": "#",
    "unknown": "?",
}
# Fixed styles of the states that are nobody's or need no tenant to read.
STATE_STYLES: dict[str, str] = {
    "free": "grey39",
    "quarantined": "bold white on red",
    "reserved": "grey50",
    "unknown": "bold magenta",
}
# The tenants' colours: distinct from the fixed ones above (no red, no grey).
TENANT_COLOURS = (
    "dodger_blue1",
    "green3",
    "gold1",
    "medium_orchid",
    "dark_orange",
    "cyan2",
    "pale_violet_red1",
    "chartreuse3",
    "light_slate_blue",
    "khaki1",
)
HELD = ("offload", "transfer", "prefix_cache", "abort")
NAMES = (*PAGE_STATES, "unknown")


def tenant_colour(tenant: str) -> str:
    """The colour of a tenant, the same wherever and whenever it is drawn."""
    if not tenant:
        return "white"
    return TENANT_COLOURS[zlib.crc32(tenant.encode()) % len(TENANT_COLOURS)]


def cell_style(state: str, tenant: str) -> str:
    if state in STATE_STYLES:
        return STATE_STYLES[state]
    colour = tenant_colour(tenant)
    if state in HELD:  # held after its request: the tenant's colour, on a dark ground
        return f"bold {colour} on grey15"
    return colour


def legend(pool_map: svc.PoolMap, per_cell: int) -> Text:
    """The scale, the states with their glyphs and counts, the tenants with their colours."""
    t = Text()
    scale = "1 page" if per_cell == 1 else f"{per_cell} pages (the most telling shown)"
    t.append(f"1 cell = {scale}; {len(pool_map.states)} pages of {pool_map.page_size} tokens\n")
    for name, n in state_counts(pool_map.states).items():
        t.append(GLYPHS.get(name, "?"), style=STATE_STYLES.get(name, "bold"))
        t.append(f" {name} {n}  ")
    t.append("\n")
    for index, n in sorted(tenant_counts(pool_map.states, pool_map.tenant).items()):
        name = pool_map.tenants[index] if index < len(pool_map.tenants) else f"#{index}"
        t.append("█", style=tenant_colour(name))
        t.append(f" {name or '(none)'} {n}  ")
    return t


class PoolMapView(Widget):
    """The grid of one PoolMap, packed to this widget's width and height."""

    DEFAULT_CSS = """
    PoolMapView { height: 1fr; }
    """

    def __init__(self, id: str | None = None) -> None:
        super().__init__(id=id)
        self.pool_map: svc.PoolMap | None = None

    def show(self, pool_map: svc.PoolMap | None) -> None:
        self.pool_map = pool_map
        self.refresh()

    def layout(self) -> tuple[int, int]:
        """(gutter, cells a row) at the widget's size now."""
        pages = len(self.pool_map.states) if self.pool_map is not None else 0
        gutter = len(str(pages)) + 1  # each row's first page number
        return gutter, row_cells(self.size.width - gutter)

    def per_cell(self) -> int:
        """Pages a cell stands for at the widget's size now."""
        pages = len(self.pool_map.states) if self.pool_map is not None else 0
        return pages_per_cell(pages, self.layout()[1] * max(1, self.size.height))

    def render(self) -> Text:
        pool_map = self.pool_map
        if pool_map is None or self.size.width < 1 or self.size.height < 1:
            return Text("")
        if not pool_map.states:
            return Text("this pool has no pages", style="dim")
        gutter, cols = self.layout()
        packed = pack(pool_map.states, pool_map.tenant, cols * self.size.height)
        tenants = pool_map.tenants
        text = Text(no_wrap=True, overflow="crop")
        for start in range(0, packed.cells, cols):
            if start:
                text.append("\n")
            text.append(f"{start * packed.per_cell:>{gutter - 1}} ", style="grey50")
            for c in range(start, min(packed.cells, start + cols)):
                state = NAMES[min(int(packed.states[c]), UNKNOWN)]
                index = int(packed.tenants[c])
                tenant = tenants[index] if index < len(tenants) else ""
                text.append(GLYPHS.get(state, "?"), style=cell_style(state, tenant))
        return text


class PoolLegend(Widget):
    """The legend of a PoolMapView, at the scale the map has in the same frame."""

    DEFAULT_CSS = """
    PoolLegend { height: 4; }
    """

    def __init__(self, view: PoolMapView, id: str | None = None) -> None:
        super().__init__(id=id)
        self.view = view

    def render(self) -> Text:
        pool_map = self.view.pool_map
        if pool_map is None or not pool_map.states:
            return Text("")
        return legend(pool_map, self.view.per_cell())


def row_cells(room: int) -> int:
    """Cells a row of the map has in `room` columns: a power of two (rows then start at round
    page numbers), at least 1."""
    if room < 8:
        return max(1, room)
    return 1 << (room.bit_length() - 1)
