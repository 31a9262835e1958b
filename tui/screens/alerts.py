"""Screen 3, the alerts: the live feed (AlertService.Subscribe), newest first, under one filter
line (tui/filter_text.py: the same Filter as the feed and the audit queries); acknowledged
alerts are marked with who acknowledged them. From an alert: enter opens its request's
timeline, `a` acknowledges it, `k` kills its request, `x` quarantines its pages, `m` switches
its rule between monitor and enforce (each behind a confirmation).

Invariant: the list is the Dashboard's alerts that the filter takes; a line that cannot be
read as a filter changes nothing and says why (counted in the status of the filter line).
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import DataTable, Input, Static

from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.tui.filter_text import describe
from kvguard.tui.format import clock, ranges
from kvguard.tui.model import Dashboard
from kvguard.tui.screens.base import DashboardScreen
from kvguard.tui.widgets.table import RowTable

SEVERITY_STYLES = {"critical": "bold red", "high": "red", "medium": "yellow", "low": "cyan", "info": "dim"}
COLUMNS = ("", "TIME", "SEV", "FINDING", "NODE", "REQ", "TENANT", "VICTIM", "RULE")


def alert_row(alert: svc.Alert, data: Dashboard) -> list[Text | str]:
    f = alert.finding
    acked = alert.cursor in data.acks
    victim = f"{f.victim_req}/{f.victim_tenant}" if f.victim_req else f.victim_tenant
    return [
        Text("✓", style="green") if acked else Text("●", style="bold red"),
        clock(f.ts_ns, data.tz, ms=False),
        Text(f.severity or "-", style=SEVERITY_STYLES.get(f.severity, "")),
        f.finding,
        f.node,
        f.req or "-",
        f.tenant or "-",
        victim or "-",
        f.rule,
    ]


def alert_detail(alert: svc.Alert, data: Dashboard) -> Text:
    f = alert.finding
    t = Text()
    t.append(f"#{alert.cursor} {clock(f.ts_ns, data.tz)} ", style="bold")
    t.append(f"{f.severity} {f.finding} [{f.rule}] -> {f.action}", style=SEVERITY_STYLES.get(f.severity, ""))
    if f.pages:
        t.append(f"; pool {f.pool} pages {ranges(f.pages)}")
    elif f.HasField("pool"):
        t.append(f"; pool {f.pool}")
    by = data.acks.get(alert.cursor)
    if by is not None:
        t.append(f"; acknowledged by {by or '?'}", style="green")
    t.append(f"\n{f.message}")
    return t


class AlertsScreen(DashboardScreen):
    TITLE = "3 Alerts"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("slash", "filter", "Filter"),
        Binding("a", "acknowledge", "Ack"),
        Binding("k", "kill", "Kill req"),
        Binding("x", "quarantine", "Quarantine"),
        Binding("m", "rule_mode", "Rule mode"),
        Binding("escape", "escape", "Back", show=False),
    ]
    DEFAULT_CSS = """
    AlertsScreen #filter { height: 1; border: none; padding: 0 1; }
    AlertsScreen #filter-status { height: 1; color: $text-muted; }
    AlertsScreen #filter-status.error { color: $error; text-style: bold; }
    AlertsScreen #alerts { height: 1fr; }
    AlertsScreen #alert-detail { height: auto; max-height: 4; }
    """

    def body(self) -> ComposeResult:
        yield Input(
            value=self.data.filter_text,
            placeholder="/ filter: critical sev:high rule:stale_read tenant:acme node:d0 req:r1",
            id="filter",
        )
        yield Static(id="filter-status")
        yield RowTable(*COLUMNS, id="alerts")
        yield Static(id="alert-detail")

    def on_mount(self) -> None:
        self.query_one("#alerts", DataTable).focus()
        super().on_mount()

    def selected(self) -> svc.Alert | None:
        key = self.query_one("#alerts", RowTable).selected_key()
        return self.data.alerts.get(int(key)) if key is not None else None

    def update_view(self, data: Dashboard) -> None:
        status = self.query_one("#filter-status", Static)
        status.set_class(bool(data.filter_error), "error")
        if data.filter_error:
            status.update(Text(f" {data.filter_error} (filters refused: {data.filters_refused})"))
        else:
            shown = describe(data.query) or "everything"
            feed = f"; alert feed: {data.alert_error}" if data.alert_error else ""
            acks = f"; acknowledgements: {data.acks_error}" if data.acks_error else ""
            status.update(Text(f" showing {shown}{feed}{acks}"))
        rows = [(str(alert.cursor), alert_row(alert, data)) for alert in data.shown_alerts()]
        self.query_one("#alerts", RowTable).sync(rows, follow_first=True)
        self._show_detail()

    def _show_detail(self) -> None:
        detail = self.query_one("#alert-detail", Static)
        alert = self.selected()
        if alert is None:
            empty = "no alerts yet" if not self.data.alerts else "no alert matches the filter"
            detail.update(Text(empty, style="dim"))
        else:
            detail.update(alert_detail(alert, self.data))

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_detail()

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        alert = self.selected()
        if alert is not None:
            self.top.open_timeline(alert)

    def action_filter(self) -> None:
        self.query_one("#filter", Input).focus()

    def action_escape(self) -> None:
        """Out of the filter line, else back to the screen before."""
        if self.query_one("#filter", Input).has_focus:
            self.query_one("#alerts", DataTable).focus()
        else:
            self.top.action_back()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            self.top.set_filter_text(event.value)
            self.query_one("#alerts", DataTable).focus()

    def _alert_or_say(self) -> svc.Alert | None:
        alert = self.selected()
        if alert is None:
            self.notify("no alert selected", severity="warning")
        return alert

    def action_acknowledge(self) -> None:
        if (alert := self._alert_or_say()) is not None:
            self.top.ask_acknowledge(alert)

    def action_kill(self) -> None:
        if (alert := self._alert_or_say()) is not None:
            self.top.ask_kill(alert.finding.req, alert.finding.tenant)

    def action_quarantine(self) -> None:
        if (alert := self._alert_or_say()) is not None:
            self.top.ask_quarantine(alert.finding)

    def action_rule_mode(self) -> None:
        if (alert := self._alert_or_say()) is not None:
            self.top.ask_rule_mode(alert.finding.rule)
