"""Screen 4, a request's timeline across nodes: every audit record of the request
(AuditService.Query(req=...): its events on each node, with pages, transfer counts and
checksums, reads; the verdicts that name it, as offender or victim; the commands and operator
actions), in time order. Opened from an alert on its offender; `v` switches to the alert's
victim and back, `k` kills the request shown.

Invariant: records are ordered by their own time (an event's or finding's ts_ns; a command
after the record it followed in the log), ties by record id, so the order is the same on
every refresh; a daemon's error is said above whatever was read before it.
"""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.widgets import Static

from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.tui.format import clock, record_line, record_node, record_time
from kvguard.tui.model import Dashboard, Timeline
from kvguard.tui.screens.base import DashboardScreen

STYLES = {"event": "", "verdict": "bold red", "command": "bold magenta", "action": "bold cyan"}


def ordered(records: list[svc.AuditRecord]) -> list[tuple[int, svc.AuditRecord]]:
    """(time, record) in time order; a record without a time of its own takes the time of
    the record before it in the log."""
    timed = []
    last = 0
    for record in sorted(records, key=lambda r: r.id):
        last = record_time(record) or last
        timed.append((last, record))
    return sorted(timed, key=lambda pair: (pair[0], pair[1].id))


def summary(timeline: Timeline) -> Text:
    """What the request did, counted: where, pages, transfers, reads, verdicts, kills."""
    nodes: dict[str, int] = {}
    sent = received = reads = verdicts = commands = 0
    tenant = ""
    for record in timeline.records:
        kind = record.WhichOneof("body")
        if kind == "event":
            e = record.event
            nodes[e.node] = nodes.get(e.node, 0) + 1
            payload = e.WhichOneof("payload")
            if payload == "admit" and e.admit.req == timeline.req:
                tenant = e.admit.tenant
            sent += payload == "xfer_send"
            received += payload == "xfer_recv"
            reads += payload == "read"
        elif kind == "finding":
            verdicts += 1
            f = record.finding
            tenant = tenant or (f.tenant if f.req == timeline.req else f.victim_tenant)
        elif kind == "command":
            commands += 1
    t = Text()
    t.append(f"request {timeline.req}", style="bold")
    role = "offender" if timeline.req == timeline.offender else "victim"
    t.append(f" ({role}{', tenant ' + tenant if tenant else ''})")
    where = ", ".join(f"{n} {c}" for n, c in nodes.items())
    t.append(f": events on {where or 'no node'}; {sent} sent, {received} received, {reads} reads, ")
    t.append(f"{verdicts} verdicts", style="bold red" if verdicts else "")
    t.append(f", {commands} commands")
    return t


class TimelineScreen(DashboardScreen):
    TITLE = "4 Timeline"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("v", "switch_party", "Victim/offender"),
        Binding("k", "kill", "Kill req"),
        Binding("escape", "back", "Back"),
    ]
    DEFAULT_CSS = """
    TimelineScreen #timeline-heading { height: auto; max-height: 3; }
    TimelineScreen #timeline-scroll { height: 1fr; }
    """

    def body(self) -> ComposeResult:
        yield Static(id="timeline-heading")
        with VerticalScroll(id="timeline-scroll"):
            yield Static(id="timeline")

    def on_mount(self) -> None:
        self.query_one("#timeline-scroll").focus()
        super().on_mount()

    def update_view(self, data: Dashboard) -> None:
        heading = self.query_one("#timeline-heading", Static)
        body = self.query_one("#timeline", Static)
        timeline = data.timeline
        if timeline is None:
            heading.update("no request chosen: open an alert on the alerts screen (3) with enter")
            body.update("")
            return
        if not timeline.req:
            f = timeline.alert.finding if timeline.alert is not None else None
            what = f"{f.severity} {f.finding} on {f.node}: " if f is not None else ""
            heading.update(f"{what}this alert names no request (a node's finding): no timeline to trace")
            body.update(Text(f.message if f is not None else "", style="dim"))
            return
        head = summary(timeline)
        if timeline.alert is not None:
            f = timeline.alert.finding
            head.append(f"\nfrom alert #{timeline.alert.cursor}: {f.severity} {f.finding} on {f.node}")
            if timeline.victim:
                other = timeline.victim if timeline.req == timeline.offender else timeline.offender
                head.append(f"; v: {other}'s timeline")
        if timeline.error is not None:
            head.append(f"\n{timeline.error}", style="bold red")
        heading.update(head)
        if not timeline.loaded:
            body.update(Text("loading", style="dim"))
            return
        table = Table(box=None, expand=True, show_edge=False, pad_edge=False, padding=(0, 1))
        table.add_column("TIME", no_wrap=True)
        table.add_column("NODE", no_wrap=True)
        table.add_column("WHAT", no_wrap=True)
        table.add_column("DETAIL", ratio=1, overflow="fold")
        for ts_ns, record in ordered(timeline.records):
            style, what, detail = record_line(record, timeline.req)
            table.add_row(
                clock(ts_ns, data.tz) if ts_ns else "",
                record_node(record),
                Text(what, style=STYLES[style]),
                Text(detail, style="red" if style == "verdict" else ""),
            )
        body.update(table if timeline.records else Text("no records of this request", style="dim"))

    def action_switch_party(self) -> None:
        self.top.switch_timeline_party()

    def action_kill(self) -> None:
        timeline = self.data.timeline
        if timeline is None:
            self.notify("no request chosen", severity="warning")
            return
        self.top.ask_kill(timeline.req, timeline.tenant)

    def action_back(self) -> None:
        self.top.action_back()
