"""Findings: what the detectors report, the vocabulary they use, and the reporter that makes
them (`Findings`); and BadEvent, the ledger's answer to an event it cannot apply.

A detector fills in the facts (kind, who, whose data, which pages, which event); the
ruleset then gives the finding its severity, action, rule id, message and tags. A Finding
is immutable: the ruleset returns an evaluated copy, never edits the detector's record.
`Findings` is the only writer of what was reported: each fact once (de-duplication), every
finding stamped with the event being applied.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvguard.proto import pb, vocabulary

NOBODY = 0  # request index 0 is "no request": never a grantee, writer or holder


class BadEvent(ValueError):
    """An event that cannot be applied (the ledger's other answer). `kind` is a short counter
    name, the text says why."""

    def __init__(self, reason: str, kind: str = "malformed") -> None:
        super().__init__(reason)
        self.kind = kind


# The contract's vocabulary (proto/vocabulary.py), shared with the clients that filter findings.
KINDS: tuple[str, ...] = vocabulary.FINDING_KINDS
SEVERITIES: tuple[str, ...] = vocabulary.SEVERITIES
ACTIONS: tuple[str, ...] = vocabulary.ACTIONS
KILL_ACTIONS: frozenset[str] = vocabulary.KILL_ACTIONS


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
        # The constructor with every field named: dataclasses.replace costs more (it
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


class Findings:
    """The findings of the event being applied (`at()` starts an event: its node, sequence
    number and time stamp every finding it raises; `found` collects them) and the facts
    reported already: with `dedupe`, a fact (kind, node, offender, victim, key) is reported
    once while the requests it names are known (`forget()` drops theirs); repeats are counted
    in the ledger's stats (`suppressed`, and each finding by kind in `findings`). Requests
    are named through `name_of`, which the ledger gives."""

    def __init__(self, dedupe: bool, name_of: Callable[[int], tuple[str, str]], stats: Any) -> None:
        self.dedupe = dedupe
        self.reported: set[tuple[Any, ...]] = set()
        self.stats = stats
        self.found: list[Finding] = []
        self.node = ""
        self.seq = 0
        self.ts = 0
        self._name_of = name_of  # request index -> (its name, its tenant)

    def at(self, node: str, seq: int, ts: int) -> None:
        """An event of `node` begins: the context of the findings it raises."""
        self.node, self.seq, self.ts = node, seq, ts
        self.found = []

    def name(self, idx: int) -> str:
        return self._name_of(idx)[0] if idx > NOBODY else ""

    def report(
        self,
        kind: str,
        message: str,
        *,
        req: Any = None,
        victim: int = NOBODY,
        pool: int | None = None,
        pages: np.ndarray | None = None,
        details: dict[str, Any] | None = None,
        key: tuple[Any, ...] | None = None,
        node: str | None = None,
    ) -> None:
        """Record a finding of request `req` (a Request, or None). `key` identifies the fact
        for de-duplication: a fact already reported (the same stale pages read again at the
        next decode step) is counted, not repeated. `node`: the node it is about, when not the
        event's (a probe's stream speaks about its engine's node)."""
        about = self.node if node is None else node
        if self.dedupe:
            fact = (kind, about, req.idx if req else 0, victim, *(key or ()))
            if fact in self.reported:
                self.stats.suppressed += 1
                return
            self.reported.add(fact)
        self.stats.findings[kind] += 1
        victim_req, victim_tenant = self._name_of(victim) if victim > NOBODY else ("", "")
        self.found.append(
            Finding(
                finding=kind,
                node=about,
                req=req.id if req else "",
                tenant=req.tenant if req else "",
                victim_req=victim_req,
                victim_tenant=victim_tenant,
                pool=pool,
                pages=tuple(pages.tolist()) if pages is not None else (),
                seq=self.seq,
                ts_ns=self.ts,
                message=message,
                details={k: str(v) for k, v in (details or {}).items()},
            )
        )

    def by_victim(
        self,
        kind: str,
        req: Any,
        pool: Any,
        pages: np.ndarray,
        victims: np.ndarray,
        text: Callable[[int], str],
        details: dict[str, Any] | None = None,
    ) -> None:
        """One finding per distinct victim among `pages` (victims[i] is pages[i]'s), of `pool`
        (a Pool)."""
        distinct = sorted(set(victims.tolist()))  # usually one: cheaper than np.unique
        if len(distinct) == 1:
            groups: Any = [pages]
        else:  # one sort, not a scan of every page per victim (a page each: quadratic)
            order = np.argsort(victims, kind="stable")
            groups = np.split(pages[order], np.flatnonzero(np.diff(victims[order])) + 1)
        for victim, sel in zip(distinct, groups, strict=True):
            self.report(
                kind,
                text(victim) + f" (pool {pool.pool} on {pool.node}, {len(sel)} page(s))",
                req=req,
                victim=victim,
                pool=pool.pool,
                pages=sel,
                details=details,
                key=(pool.pool,),
            )

    def progress(self, r: Any, what: str) -> None:
        """A request that must only drain (rejected, aborted, killed) made progress."""
        self.report(
            "rejected_progress",
            f"request {r.id} was {r.state}{f' ({r.reason})' if r.reason else ''} but made progress: {what}",
            req=r,
            details={"state": r.state, "event": what.split()[0]},
            key=(what.split()[0],),
        )

    def forget(self, gone: set[int]) -> None:
        """Requests forgotten (their indices reused): no old fact may silence a new finding."""
        self.reported = {f for f in self.reported if f[2] not in gone and f[3] not in gone}
