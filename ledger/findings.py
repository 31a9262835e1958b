"""Findings: what the detectors report, and the vocabulary they use.

A detector fills in the facts (kind, who, whose data, which pages, which event); the
ruleset then gives the finding its severity, action, rule id, message and tags. A Finding
is immutable: the ruleset returns an evaluated copy, never edits the detector's record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvguard.proto import pb

KINDS: tuple[str, ...] = (
    "stale_read",
    "foreign_read",
    "use_after_free",
    "late_write",
    "double_free",
    "early_release",
    "transfer_mismatch",
    "rejected_progress",
    "config_drift",
    "cross_tenant_share",
    "anomaly",
)
SEVERITIES: tuple[str, ...] = ("critical", "high", "medium", "low", "info")
# kill: end the one offending request; +quarantine: keep its pages out of the pool;
# block: refuse admission; deny: refuse the prefix share; alert/log: report only.
ACTIONS: tuple[str, ...] = ("kill", "kill+quarantine", "alert+quarantine", "block", "deny", "alert", "log")
KILL_ACTIONS = frozenset({"kill", "kill+quarantine", "block"})  # the actions that end the request


@dataclass(frozen=True, slots=True)
class Finding:
    """One finding. Empty strings mean "does not apply"; `pool` is None when no pool does."""

    finding: str
    node: str = ""
    req: str = ""
    tenant: str = ""
    victim_req: str = ""
    victim_tenant: str = ""
    pool: int | None = None
    pages: tuple[int, ...] = ()
    seq: int = 0
    ts_ns: int = 0
    message: str = ""
    details: dict[str, str] = field(default_factory=dict)
    # Filled in by the ruleset.
    severity: str = ""
    action: str = ""
    rule: str = ""
    tags: tuple[str, ...] = ()

    def evaluated(
        self, *, severity: str, action: str, rule: str, message: str, tags: tuple[str, ...]
    ) -> Finding:
        # The constructor with every field named: dataclasses.replace costs 1.5x as much (it
        # looks the fields up each call), twice for every finding the daemon judges.
        return Finding(
            finding=self.finding,
            node=self.node,
            req=self.req,
            tenant=self.tenant,
            victim_req=self.victim_req,
            victim_tenant=self.victim_tenant,
            pool=self.pool,
            pages=self.pages,
            seq=self.seq,
            ts_ns=self.ts_ns,
            message=message,
            details=self.details,
            severity=severity,
            action=action,
            rule=rule,
            tags=tags,
        )

    def fields(self) -> dict[str, Any]:
        """The finding as plain values: the variables of rule conditions and templates."""
        return {
            "finding": self.finding,
            "severity": self.severity,
            "action": self.action,
            "rule": self.rule,
            "node": self.node,
            "req": self.req,
            "tenant": self.tenant,
            "victim_req": self.victim_req,
            "victim_tenant": self.victim_tenant,
            "pool": -1 if self.pool is None else self.pool,
            "pages": list(self.pages),
            "seq": self.seq,
            "ts_ns": self.ts_ns,
            "message": self.message,
            "details": dict(self.details),
            "tags": list(self.tags),
        }

    def to_json_dict(self) -> dict[str, Any]:
        """The JSON Lines form of `kvguard replay -o json`: fields that apply, proto names."""
        out: dict[str, Any] = {"finding": self.finding, "severity": self.severity, "action": self.action}
        out["rule"] = self.rule
        for name in ("node", "req", "tenant", "victim_req", "victim_tenant"):
            value = getattr(self, name)
            if value:
                out[name] = value
        if self.pool is not None:
            out["pool"] = self.pool
        if self.pages:
            out["pages"] = list(self.pages)
        if self.seq:
            out["seq"] = self.seq
        if self.ts_ns:
            out["ts_ns"] = self.ts_ns
        out["message"] = self.message
        if self.tags:
            out["tags"] = list(self.tags)
        if self.details:
            out["details"] = dict(self.details)
        return out

    @staticmethod
    def from_proto(msg: pb.Finding) -> Finding:
        """The inverse of to_proto (a stored or streamed finding back as facts and verdict)."""
        return Finding(
            finding=msg.finding,
            node=msg.node,
            req=msg.req,
            tenant=msg.tenant,
            victim_req=msg.victim_req,
            victim_tenant=msg.victim_tenant,
            pool=msg.pool if msg.HasField("pool") else None,
            pages=tuple(msg.pages),
            seq=msg.seq,
            ts_ns=msg.ts_ns,
            message=msg.message,
            details=dict(msg.details),
            severity=msg.severity,
            action=msg.action,
            rule=msg.rule,
            tags=tuple(msg.tags),
        )

    def to_proto(self) -> pb.Finding:
        msg = pb.Finding(
            finding=self.finding,
            severity=self.severity,
            action=self.action,
            rule=self.rule,
            node=self.node,
            req=self.req,
            tenant=self.tenant,
            victim_req=self.victim_req,
            victim_tenant=self.victim_tenant,
            pages=self.pages,
            seq=self.seq,
            message=self.message,
            ts_ns=self.ts_ns,
            tags=self.tags,
            details=self.details,
        )
        if self.pool is not None:
            msg.pool = self.pool
        return msg
