"""One filter (`Filter`) for everything that reads findings and records: the live alert stream
(AlertFilter), the audit queries (AuditQuery) and the dashboard. Empty fields match
everything; a tenant or a request matches as the offender or as the victim.

Invariant: a Filter means the same wherever it is applied: `matches()` on a finding as it is
published live, and the audit store's query (daemon/store), agree on every finding; the two
wire messages are its two spellings (`of`, `alert_filter`, `audit_query`), field for field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvguard.proto.kvguard.v1 import services_pb2 as svc

RECORD_KINDS = ("event", "finding", "command", "refused", "action", "receipt")


@dataclass(frozen=True, slots=True)
class Filter:
    kind: str = ""  # records: one of RECORD_KINDS ("": all); alerts are findings
    findings: frozenset[str] = field(default_factory=frozenset)  # finding kinds
    severities: frozenset[str] = field(default_factory=frozenset)
    tenant: str = ""  # as offender or victim
    req: str = ""  # as offender or victim (and, of records, any request an event names)
    node: str = ""
    since_ns: int = 0  # ts_ns from (inclusive)
    until_ns: int = 0  # ts_ns up to (inclusive)
    after: int = 0  # record id (an alert's cursor): only what comes after it
    limit: int = 0  # records at most (0: all)

    @staticmethod
    def of(msg: svc.AlertFilter | svc.AuditQuery) -> Filter:
        """The filter a wire message spells (AuditQuery's single `finding` joins `findings`)."""
        kinds = set(msg.findings)
        if isinstance(msg, svc.AuditQuery) and msg.finding:
            kinds.add(msg.finding)
        return Filter(
            kind=msg.kind if isinstance(msg, svc.AuditQuery) else "",
            findings=frozenset(kinds),
            severities=frozenset(msg.severities),
            tenant=msg.tenant,
            req=msg.req,
            node=msg.node,
            since_ns=msg.since_ns,
            until_ns=msg.until_ns,
            after=msg.after,
            limit=msg.limit if isinstance(msg, svc.AuditQuery) else 0,
        )

    def _fields(self) -> dict[str, Any]:
        return {
            "findings": sorted(self.findings),
            "severities": sorted(self.severities),
            "tenant": self.tenant,
            "req": self.req,
            "node": self.node,
            "since_ns": self.since_ns,
            "until_ns": self.until_ns,
            "after": self.after,
        }

    def alert_filter(self) -> svc.AlertFilter:
        return svc.AlertFilter(**self._fields())

    def audit_query(self) -> svc.AuditQuery:
        return svc.AuditQuery(kind=self.kind, limit=self.limit, **self._fields())

    def matches(self, finding: Any) -> bool:
        """Whether a finding (the ledger's Finding or a kvguard.v1.Finding: the same fields)
        passes; `after` and `limit` are the reader's to apply, by record."""
        return (
            (not self.findings or finding.finding in self.findings)
            and (not self.severities or finding.severity in self.severities)
            and (not self.tenant or self.tenant in (finding.tenant, finding.victim_tenant))
            and (not self.req or self.req in (finding.req, finding.victim_req))
            and (not self.node or self.node == finding.node)
            and (not self.since_ns or finding.ts_ns >= self.since_ns)
            and (not self.until_ns or finding.ts_ns <= self.until_ns)
        )
