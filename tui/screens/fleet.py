"""Screen 1, the fleet: one row a node (its health in a word, its pools against their context
lengths, lag, event rate, drops, agent and guard, when it last spoke, its role, engine, GPU
and epoch), and below, all there is on the selected node and the daemon's own counts.

Invariants: a pool that cannot hold its advertised context (page_size x (num_pages -
reserved_pages) < context_len) is red on its node's row and in the detail, whatever else the
node does; a node whose agent stream is closed, or whose engine's guard is gone, says so in
its STATE word; every age is counted from the daemon's clock (FleetState.now_ns), not this
terminal's.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Static

from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.tui.format import age, clock, count, epoch_text, pool_short, pool_tokens, size
from kvguard.tui.model import Dashboard
from kvguard.tui.screens.base import DashboardScreen
from kvguard.tui.widgets.table import RowTable

COLUMNS = ("NODE", "STATE", "POOLS", "LAG", "EV/S", "DROP", "AGENT", "GUARD", "SEEN", "SPOOL")
COLUMNS += ("ROLE", "ENGINE", "GPU", "EPOCH")
# The daemon's counters that say input was refused, or events could not be judged.
REFUSED = ("stream_", "rejected", "access_denied", "actions_refused")
UNJUDGED = {f"ledger_{name}" for name in ("missing", "remote_unjudged", "remote_unmapped", "orphan_wire")}
UNJUDGED |= {"ledger_gaps_given_up", "ledger_untenanted"}


def health(node: svc.NodeState, now_ns: int) -> Text:
    """The node in a word or two, the worst first: agent gone, engine gone, pool short of its
    context, dropping events, no engine yet, ok."""
    status = node.status if node.HasField("status") else None
    if not node.connected:
        gone = f" {age(now_ns - node.connected_ns)}" if node.connected_ns and now_ns else ""
        return Text(f"AGENT DOWN{gone}", style="bold red")
    if status is not None and status.guard == "gone":
        return Text("ENGINE GONE", style="bold red")
    if any(pool_short(p.report) for p in node.pools):
        return Text("POOL<CTX", style="bold red")
    if node.dropped:
        return Text("DROPPING", style="yellow")
    if status is not None and status.guard == "none":
        return Text("no engine", style="yellow")
    return Text("ok", style="green")


def pools_cell(node: svc.NodeState) -> Text:
    """Each pool as tokens/context, red where the pool cannot hold its context."""
    cell = Text()
    for i, p in enumerate(node.pools):
        if i:
            cell.append(" ")
        report = p.report
        ctx = count(report.context_len) if report.context_len else "?"
        short = pool_short(report)
        cell.append(
            f"{count(pool_tokens(report))}{'<' if short else '/'}{ctx}",
            style="bold red" if short else "green",
        )
    return cell or Text("-", style="dim")


def guard_cell(node: svc.NodeState) -> Text:
    if not node.HasField("status"):
        return Text("?", style="dim")
    guard = node.status.guard or "?"
    return Text(guard, style={"connected": "green", "gone": "bold red", "none": "yellow"}.get(guard, ""))


def last_word_ns(node: svc.NodeState) -> int:
    """When the daemon last heard from the node's agent (a batch or a status), its clock."""
    return max(node.received_ns, node.status_ns)


def gpu_cell(node: svc.NodeState) -> str:
    if not node.HasField("status"):
        return "?"
    status = node.status
    if status.gpus:
        names = {g.name.removeprefix("NVIDIA ") for g in status.gpus}
        return f"{len(status.gpus)}x{'/'.join(sorted(names))}"
    return "n/a" if status.gpu_unavailable else "none"


def node_row(node: svc.NodeState, now_ns: int, data: Dashboard) -> list[Text | str]:
    first = node.pools[0].report if node.pools else None
    roles = sorted({p.report.role for p in node.pools if p.report.role})
    engine = f"{first.engine} {first.engine_version}".strip() if first is not None else "-"
    word = last_word_ns(node)
    return [
        Text(node.node, style="bold"),
        health(node, now_ns),
        pools_cell(node),
        f"{node.lag_ms:.0f}ms" if node.lag_ms else "-",
        count(node.events_per_s),
        Text(str(node.dropped), style="yellow" if node.dropped else ""),
        Text("up", style="green") if node.connected else Text("down", style="bold red"),
        guard_cell(node),
        age(now_ns - word) if word and now_ns else "-",
        str(node.status.spooled) if node.HasField("status") else "?",
        "+".join(roles) or "-",
        engine or "-",
        gpu_cell(node),
        f"{epoch_text(node.epoch, data.tz)} r{node.restarts}",
    ]


def node_detail(node: svc.NodeState, now_ns: int, data: Dashboard) -> Text:
    """All the fleet state says of one node, a line a subject."""
    tz = data.tz
    t = Text()
    t.append(f"{node.node}", style="bold")
    t.append(f"  epoch {epoch_text(node.epoch, tz)}, {node.restarts} restarts, last seq {node.last_seq}")
    if node.last_ts_ns:
        t.append(f" at {clock(node.last_ts_ns, tz)}")
    if node.daemon and data.fleet is not None and node.daemon != data.fleet.daemon:
        t.append(f"\njudged on the bus by daemon {node.daemon}: as it last said; its pool map is there")
    t.append("\nagent: ")
    if node.connected:
        t.append("stream open", style="green")
        if node.connected_ns and now_ns:
            t.append(f" {age(now_ns - node.connected_ns)}")
    else:
        t.append("stream closed", style="bold red")
        if node.connected_ns and now_ns:
            t.append(f" {age(now_ns - node.connected_ns)} ago")
    if node.received_ns and now_ns:
        t.append(f", last batch {age(now_ns - node.received_ns)} ago")
    t.append(f", lag {node.lag_ms:.1f} ms, {count(node.events_per_s)} ev/s, {node.dropped} dropped")
    if node.HasField("status"):
        s = node.status
        t.append(f", {s.spooled} spooled, agent {s.agent_version or '?'}")
        t.append("\nguard: ")
        t.append(s.guard or "?", style=guard_cell(node).style)
        if s.guard_since_ns and now_ns:
            t.append(f" for {age(now_ns - s.guard_since_ns)}")
        if s.guard_pid:
            t.append(f", engine pid {s.guard_pid}")
        t.append("\nGPU: ")
        if s.gpus:
            t.append(
                "; ".join(f"{g.index} {g.name} {size(g.memory_used)}/{size(g.memory_total)}" for g in s.gpus)
            )
            if s.driver:
                t.append(f", driver {s.driver}")
        else:
            t.append(f"unavailable: {s.gpu_unavailable}" if s.gpu_unavailable else "none")
    else:
        t.append("\nguard and GPU: no word from the agent yet", style="dim")
    for p in node.pools:
        r = p.report
        t.append(f"\npool {r.pool} {r.role or '?'} {r.engine} {r.engine_version}".rstrip() + ": ")
        tokens = pool_tokens(r)
        fits = f"{r.page_size} x ({r.num_pages} - {r.reserved_pages} reserved) = {tokens} tokens"
        if pool_short(r):
            t.append(f"{fits} < context {r.context_len}: CANNOT HOLD ITS CONTEXT", style="bold red")
        else:
            t.append(f"{fits} >= context {r.context_len or '?'}", style="green")
        t.append(f"; {p.pages_in_use}/{r.num_pages} pages in use")
        extra = ", ".join(x for x in (r.model, r.kv_dtype, f"tp{r.tp_size}" if r.tp_size else "") if x)
        if extra:
            t.append(f"; {extra}")
    return t


def daemon_detail(fleet: svc.FleetState) -> Text:
    t = Text()
    if fleet.daemon:  # on the bus: the counts are this daemon's cells'
        held = sum(1 for c in fleet.cells if c.daemon == fleet.daemon)
        others = len({c.daemon for c in fleet.cells if c.daemon and c.daemon != fleet.daemon})
        t.append(f"on the bus as daemon {fleet.daemon}: {held} of {len(fleet.cells)} cells, ")
        t.append(f"{others} other daemons\n")
    t.append(f"daemon: {fleet.requests} requests known, {fleet.events} events")
    if fleet.findings:
        t.append("; findings: " + ", ".join(f"{k} {n}" for k, n in sorted(fleet.findings.items())))
    refused = {k: n for k, n in fleet.counters.items() if n and (k.startswith(REFUSED) or k in UNJUDGED)}
    if refused:
        t.append("\nrefused or unjudged: " + ", ".join(f"{k} {n}" for k, n in sorted(refused.items())))
    room = fleet.store
    if fleet.HasField("store"):
        free = f"{size(room.free_bytes)} free" if room.free_known else "free space not visible"
        t.append(f"\nstore: {size(room.used_bytes)}, {free}")
        if room.refusing:
            t.append(f"; REFUSING EVENTS: {room.refusing}", style="bold red")
    return t


class FleetScreen(DashboardScreen):
    TITLE = "1 Fleet"
    BINDINGS: ClassVar[list[BindingType]] = [Binding("enter", "open_pool", "Pool map", show=True)]
    DEFAULT_CSS = """
    FleetScreen #nodes { height: auto; max-height: 60%; }
    FleetScreen #node-detail { height: 1fr; }
    """

    def body(self) -> ComposeResult:
        yield RowTable(*COLUMNS, id="nodes")
        with VerticalScroll(id="node-detail"):
            yield Static(id="detail")

    def selected_node(self) -> str | None:
        return self.query_one("#nodes", RowTable).selected_key()

    def update_view(self, data: Dashboard) -> None:
        table = self.query_one("#nodes", RowTable)
        detail = self.query_one("#detail", Static)
        fleet = data.fleet
        if fleet is None:
            why = data.unreachable or data.refused or "waiting for the daemon"
            detail.update(Text(f"no fleet state yet: {why}", style="dim"))
            return
        table.sync([(node.node, node_row(node, fleet.now_ns, data)) for node in fleet.nodes])
        self._show_detail(data)

    def _show_detail(self, data: Dashboard) -> None:
        detail = self.query_one("#detail", Static)
        fleet = data.fleet
        if fleet is None:
            return
        name = self.selected_node()
        node = data.node(name) if name else None
        text = Text()
        if node is not None:
            text.append_text(node_detail(node, fleet.now_ns, data))
            text.append("\n")
        elif not fleet.nodes:
            text.append("no nodes yet: no agent has spoken to this daemon\n", style="dim")
        text.append_text(daemon_detail(fleet))
        detail.update(text)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_detail(self.data)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_open_pool()

    def action_open_pool(self) -> None:
        name = self.selected_node()
        node = self.data.node(name) if name else None
        if node is not None and node.pools:
            self.top.open_pool(node.node, node.pools[0].report.pool)
