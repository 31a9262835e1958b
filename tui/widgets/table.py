"""The dashboard's lists (nodes, alerts, rules): a DataTable of whole rows, brought up to date
in place from the daemon's answers, with the selection kept on the same row.

Invariants: `sync` leaves the table holding exactly the rows given, in their order, and the
cursor on the row of the same key as before when it is still there (else the first; with
`follow_first`, a cursor on the first row stays on the first); a row
whose cells did not change is not touched, so a refresh neither flickers nor scrolls; once
measured, every row is drawn at the columns' new widths (DataTable 8 keeps the rows drawn before
at the old ones: the header stays narrow until the next change); moving
the cursor scrolls the table up and down only, never sideways (a row wider than the view
would otherwise push it to the right, differently from refresh to refresh).
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual import events
from textual.geometry import Region
from textual.widgets import DataTable

Cell = Text | str


class RowTable(DataTable[Cell]):
    def __init__(self, *columns: str, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row")
        self.add_columns(*columns)

    @property
    def settled(self) -> bool:
        """Whether the table has measured what it was last given (DataTable measures its
        columns when it is next idle, and draws them narrow until then)."""
        return not (self._require_update_dimensions or self._updated_cells or self._new_rows)

    def selected_key(self) -> str | None:
        """The key of the row under the cursor (None: no rows)."""
        if not self.row_count:
            return None
        return str(self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value)

    def sync(self, rows: Sequence[tuple[str, Sequence[Cell]]], *, follow_first: bool = False) -> None:
        """Hold exactly `rows` ((key, cells) in order), changing only what changed;
        `follow_first`: a cursor on the first row stays on the first row (the newest, in a
        list that grows at the top), as `tail -f` follows the end."""
        keys = [key for key, _ in rows]
        if [str(k.value) for k in self.rows] == keys:
            columns = list(self.columns)
            for key, cells in rows:
                for column, cell in zip(columns, cells, strict=False):
                    if self.get_cell(key, column) != cell:
                        self.update_cell(key, column, cell, update_width=True)
            return
        chosen = None if follow_first and self.cursor_row == 0 else self.selected_key()
        self.clear()
        for key, cells in rows:
            self.add_row(*cells, key=key)
        if chosen in keys:
            self.move_cursor(row=keys.index(chosen), animate=False)

    async def _on_idle(self, event: events.Idle) -> None:
        """DataTable measures new rows and cells here, but keeps the rows and cells it drew
        before at the old widths (its caches are keyed without them): they are drawn again."""
        measuring = not self.settled
        await super()._on_idle(event)
        if measuring:
            self._clear_caches()
            self.refresh()

    def _scroll_cursor_into_view(self, animate: bool = False) -> None:
        """Up and down only, to the cursor's row (DataTable's own also scrolls sideways)."""
        if self.cursor_type != "row":
            super()._scroll_cursor_into_view(animate)
            return
        fixed = self._get_fixed_offset()
        _, y, _, height = self._get_row_region(self.cursor_row)
        region = Region(int(self.scroll_x), y, 1, height)
        self.scroll_to_region(region, animate=animate, spacing=fixed, force=True)
