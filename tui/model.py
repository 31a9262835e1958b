"""What the dashboard knows of the daemon, as last heard: the fleet, the alerts of the current
filter, which alerts were acknowledged and by whom, the rules, the pool map and timeline
being looked at, and, for each, why it could not be had (unreachable, or not served by this
daemon). The app's poller and alert feed write it on the UI's loop; screens only read it.

Invariants: a source that failed keeps its last good answer beside the error (the screen
says both: stale data is marked, never passed off as current); `alerts` holds at most
MAX_ALERTS, the newest, in cursor order, all of one filter generation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import tzinfo

from kvguard.proto.client import DaemonError
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.tui.filter_text import AlertQuery

MAX_ALERTS = 2000


@dataclass
class Timeline:
    """A request's records across nodes (AuditService.Query(req=...)), opened from an alert:
    the offender's, or the victim's."""

    req: str
    alert: svc.Alert | None = None  # the alert it was opened from
    records: list[svc.AuditRecord] = field(default_factory=list)
    last_id: int = 0  # the newest record read: the next query takes only what came after it
    error: DaemonError | None = None
    loaded: bool = False

    @property
    def offender(self) -> str:
        return self.alert.finding.req if self.alert is not None else self.req

    @property
    def victim(self) -> str:
        return self.alert.finding.victim_req if self.alert is not None else ""

    @property
    def tenant(self) -> str:
        """The request's tenant, as its admission says (or its alert, before that is read)."""
        for record in self.records:
            if record.WhichOneof("body") == "event" and record.event.admit.req == self.req:
                return record.event.admit.tenant
        if self.alert is not None and self.req == self.alert.finding.req:
            return self.alert.finding.tenant
        return ""


@dataclass
class Dashboard:
    address: str
    tz: tzinfo | None = None  # the time zone times are shown in (None: local)
    fleet: svc.FleetState | None = None
    unreachable: DaemonError | None = None  # why the daemon could not be reached (None: it was)
    refused: DaemonError | None = None  # why it refused the fleet state (e.g. this certificate's role)
    retry_in_s: float = 0.0
    polls: int = 0  # fleet answers so far
    reconnects: int = 0  # times the daemon came back after being unreachable

    query: AlertQuery = field(default_factory=AlertQuery)
    filter_text: str = ""
    filter_error: str = ""
    filters_refused: int = 0
    alert_generation: int = 0
    alerts: dict[int, svc.Alert] = field(default_factory=dict)  # by cursor, oldest first
    alert_error: DaemonError | None = None

    acks: dict[int, str] = field(default_factory=dict)  # acknowledged alert cursor -> by whom
    actions_after: int = 0  # the last action record read
    acks_error: DaemonError | None = None

    rules: svc.RulesState | None = None
    rules_error: DaemonError | None = None

    pool_target: tuple[str, int] | None = None  # (node, pool) the pool map shows
    pool_map: svc.PoolMap | None = None
    pool_error: DaemonError | None = None

    timeline: Timeline | None = None
    last_result: str = ""  # the last action's outcome, in the daemon's words or the error's
    last_result_ok: bool = True

    def add_alerts(self, generation: int, alerts: list[svc.Alert]) -> bool:
        """Take alerts of the feed's `generation` (a newer one replaces what is held); True if
        anything changed."""
        changed = False
        if generation != self.alert_generation:
            self.alerts.clear()
            self.alert_generation = generation
            changed = True
        for alert in alerts:
            self.alerts[alert.cursor] = alert
            changed = True
        while len(self.alerts) > MAX_ALERTS:
            del self.alerts[next(iter(self.alerts))]
        return changed

    def shown_alerts(self) -> list[svc.Alert]:
        """The alerts the filter line takes, newest first."""
        return [a for a in reversed(self.alerts.values()) if self.query.takes(a.finding)]

    def take_actions(self, records: list[svc.AuditRecord]) -> None:
        """Action records (kind `action`), in id order: acknowledgements noted."""
        for record in records:
            self.actions_after = max(self.actions_after, record.id)
            if record.WhichOneof("body") == "action" and record.action.HasField("acknowledge"):
                self.acks[record.action.acknowledge.cursor] = record.action.by

    def node(self, name: str) -> svc.NodeState | None:
        if self.fleet is None:
            return None
        return next((n for n in self.fleet.nodes if n.node == name), None)

    def pool_targets(self) -> list[tuple[str, int]]:
        """Every (node, pool) the fleet reports, in the fleet's order."""
        if self.fleet is None:
            return []
        return [(n.node, p.report.pool) for n in self.fleet.nodes for p in n.pools]

    def rule(self, rule_id: str) -> svc.RuleState | None:
        if self.rules is None:
            return None
        return next((r for r in self.rules.rules if r.id == rule_id), None)
