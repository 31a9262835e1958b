"""Screen 2, the pool map: the pages of one node's pool (FleetService.Pool), coloured by
tenant, with free, held (offload, transfer, prefix cache, abort), shared, quarantined and
reserved pages distinct, refreshed with the fleet; `[` and `]` step through every pool of the
fleet.

Invariant: the heading names the node, pool and the engine incarnation (epoch) the map is of;
a daemon that does not serve pool maps is said so in place of the map, and the screen goes on.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import Static

from kvguard.proto.client import Unsupported
from kvguard.tui.format import epoch_text
from kvguard.tui.model import Dashboard
from kvguard.tui.screens.base import DashboardScreen
from kvguard.tui.widgets.pool_map import PoolLegend, PoolMapView


class PoolScreen(DashboardScreen):
    TITLE = "2 Pool map"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("left_square_bracket", "step(-1)", "Prev pool"),
        Binding("right_square_bracket", "step(1)", "Next pool"),
    ]
    DEFAULT_CSS = """
    PoolScreen #pool-heading { height: 1; text-style: bold; }
    """

    def body(self) -> ComposeResult:
        yield Static(id="pool-heading")
        view = PoolMapView(id="pool-map")
        yield PoolLegend(view, id="pool-legend")  # above the map: the map takes what is left
        yield view

    def action_step(self, by: int) -> None:
        self.top.step_pool(by)

    def update_view(self, data: Dashboard) -> None:
        heading = self.query_one("#pool-heading", Static)
        view = self.query_one(PoolMapView)
        legend_box = self.query_one(PoolLegend)
        target = data.pool_target
        if target is None:
            heading.update("no pool chosen: pick a node on the fleet screen (1) and press enter")
            view.show(None)
            legend_box.refresh()
            return
        node, pool = target
        pool_map = data.pool_map
        if data.pool_error is not None and (pool_map is None or isinstance(data.pool_error, Unsupported)):
            heading.update(Text(f"{node} pool {pool}: {data.pool_error}", style="bold red"))
            view.show(None)
            legend_box.refresh()
            return
        if pool_map is None or (pool_map.node, pool_map.pool) != target:
            heading.update(f"{node} pool {pool}: loading")
            view.show(None)
            legend_box.refresh()
            return
        epoch = epoch_text(pool_map.epoch, data.tz)
        title = Text(f"{node} pool {pool} (engine epoch {epoch}): {len(pool_map.states)} pages")
        if data.pool_error is not None:
            title.append(f" (as of the last answer: {data.pool_error})", style="red")
        heading.update(title)
        view.show(pool_map)
        legend_box.refresh()
