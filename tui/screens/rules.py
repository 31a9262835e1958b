"""Screen 5, the rules as the daemon applies them (FleetService.Rules): each rule's finding,
severity, action and mode (enforce: its kill or quarantine is ordered; monitor: only
recorded), and who overrode it; `m` (or enter) switches a rule between monitor and enforce,
`d` gives it back the daemon's own mode, each behind a confirmation.

Invariant: the modes shown are the daemon's answer, never this screen's guess: after a
switch the row changes when the next answer says so; a daemon without the call says so.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.widgets import DataTable, Static

from kvguard.tui.model import Dashboard
from kvguard.tui.screens.base import DashboardScreen
from kvguard.tui.widgets.table import RowTable

COLUMNS = ("RULE", "FINDING", "SEVERITY", "ACTION", "MODE", "SET BY")


class RulesScreen(DashboardScreen):
    TITLE = "5 Rules"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("m", "toggle", "Monitor/enforce"),
        Binding("d", "default", "Daemon's mode"),
    ]
    DEFAULT_CSS = """
    RulesScreen #rules-heading { height: 1; }
    RulesScreen #rules { height: 1fr; }
    """

    def body(self) -> ComposeResult:
        yield Static(id="rules-heading")
        yield RowTable(*COLUMNS, id="rules")

    def selected(self) -> str | None:
        return self.query_one("#rules", RowTable).selected_key()

    def update_view(self, data: Dashboard) -> None:
        heading = self.query_one("#rules-heading", Static)
        table = self.query_one("#rules", RowTable)
        rules = data.rules
        if rules is None:
            why = data.rules_error or "loading"
            heading.update(Text(f"rules: {why}", style="bold red" if data.rules_error else "dim"))
            return
        stale = f" (as of the last answer: {data.rules_error})" if data.rules_error else ""
        heading.update(f"daemon mode {rules.mode}; {len(rules.rules)} rules{stale}")
        rows = []
        for rule in rules.rules:
            mode = Text(rule.mode, style="bold green" if rule.mode == "enforce" else "yellow")
            if rule.overridden:
                mode.append("*")
            rows.append((rule.id, [rule.id, rule.finding, rule.severity, rule.action, mode, rule.by or "-"]))
        table.sync(rows)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_toggle()

    def action_toggle(self) -> None:
        if (rule := self.selected()) is not None:
            self.top.ask_rule_mode(rule)

    def action_default(self) -> None:
        if (rule := self.selected()) is not None:
            self.top.ask_rule_mode(rule, to_default=True)
