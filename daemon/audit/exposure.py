"""`kvguard audit exposure`: the blast radius of a leak for one tenant.

From the findings whose victim is the tenant and whose offender is another tenant: which
requests of which tenants read (or received, or overwrote) its KV, when, and what was done
about each (killed, denied, or went on). Invariant: built from finding bodies only, in
record order, so a store and a daemon give the same report.
"""

from __future__ import annotations

import difflib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, TextIO

from kvguard.daemon.audit.format import format_time, page_ranges
from kvguard.daemon.audit.source import Source
from kvguard.proto import pb
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc

# What the offender did to the victim's KV, by finding kind (the verb of the exposure report).
VERBS: dict[str, str] = {
    "stale_read": "read",
    "foreign_read": "read",
    "use_after_free": "read",
    "cross_tenant_share": "read",
    "early_release": "received",
    "transfer_mismatch": "received",
    "late_write": "overwrote",
    "double_free": "freed",
}
STOPPING_ACTIONS = frozenset({"deny", "block"})  # the request was refused, not terminated

# ---------------------------------------------------------------------------------------- exposure


@dataclass
class VictimPart:
    """What one offending request did to one victim request's pages on one node and pool."""

    victim_req: str
    node: str
    pool: int | None
    pages: set[int] = field(default_factory=set)
    findings: Counter[str] = field(default_factory=Counter)
    actions: set[str] = field(default_factory=set)
    first_ts_ns: int = 0
    last_ts_ns: int = 0
    record_ids: list[int] = field(default_factory=list)


@dataclass
class Offender:
    """One request of another tenant that reached the victim tenant's KV."""

    tenant: str
    req: str
    parts: dict[tuple[str, str, int | None], VictimPart] = field(default_factory=dict)
    kill_commands: int = 0
    kill_events: list[str] = field(default_factory=list)  # who killed it locally (guard@node)
    first_kill_record: int = 0  # the record id of the first kill command or kill event
    late_kills: list[str] = field(default_factory=list)  # kills that reached its node after it finished
    fate: str = ""  # what the daemon learned became of it (daemon/outcomes.py), "" if nothing
    fate_record: int = 0  # the record that says it
    learned_ns: int = 0  # when the daemon learned it (its wall clock)

    @property
    def findings(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for part in self.parts.values():
            total.update(part.findings)
        return total

    @property
    def actions(self) -> list[str]:
        return sorted({a for part in self.parts.values() for a in part.actions})

    @property
    def first_ts_ns(self) -> int:
        return min(p.first_ts_ns for p in self.parts.values())

    @property
    def last_ts_ns(self) -> int:
        return max(p.last_ts_ns for p in self.parts.values())

    @property
    def outcome(self) -> str:
        """killed (a kill took effect: its guard's, or one ordered that reached it in time);
        reached_client (it finished before any kill took effect: the daemon's update says so,
        or its guard recorded the kill as late); ordered (a kill ordered, and nothing says
        whether it took effect); stopped (denied or blocked); unchecked."""
        if self.fate in ("stopped", "killed"):
            return "killed"
        if self.fate in ("reached_client", "aborted") or (self.late_kills and not self.kill_events):
            return "reached_client"
        if self.kill_events:
            return "killed"
        if self.kill_commands:
            return "ordered"
        if STOPPING_ACTIONS & set(self.actions):
            return "stopped"
        return "unchecked"

    def add(self, record_id: int, f: pb.Finding) -> None:
        pool = f.pool if f.HasField("pool") else None
        key = (f.victim_req, f.node, pool)
        part = self.parts.get(key)
        if part is None:
            part = self.parts[key] = VictimPart(f.victim_req, f.node, pool, first_ts_ns=f.ts_ns)
        part.pages.update(f.pages)
        part.findings[f.finding] += 1
        if f.action:
            part.actions.add(f.action)
        part.first_ts_ns = min(part.first_ts_ns, f.ts_ns)
        part.last_ts_ns = max(part.last_ts_ns, f.ts_ns)
        part.record_ids.append(record_id)

    def to_json_dict(self, victim_tenant: str) -> dict[str, Any]:
        return {
            "type": "exposure",
            "tenant": victim_tenant,
            "offender_tenant": self.tenant,
            "req": self.req,
            "findings": dict(sorted(self.findings.items())),
            "actions": self.actions,
            "first_ts_ns": self.first_ts_ns,
            "last_ts_ns": self.last_ts_ns,
            "kill_commands": self.kill_commands,
            "kill_events": self.kill_events,
            "first_kill_record": self.first_kill_record,
            "late_kills": self.late_kills,
            "fate": self.fate,
            "fate_record": self.fate_record,
            "learned_ns": self.learned_ns,
            "outcome": self.outcome,
            "victims": [
                {
                    "victim_req": p.victim_req,
                    "node": p.node,
                    **({"pool": p.pool} if p.pool is not None else {}),
                    "pages": sorted(p.pages),
                    "findings": dict(sorted(p.findings.items())),
                    "actions": sorted(p.actions),
                    "first_ts_ns": p.first_ts_ns,
                    "last_ts_ns": p.last_ts_ns,
                    "record_ids": p.record_ids,
                }
                for p in self.parts.values()
            ],
        }


@dataclass
class Exposure:
    """The exposure of one tenant: offending requests grouped by tenant, in order of first finding."""

    tenant: str
    since_ns: int = 0
    until_ns: int = 0
    offenders: dict[tuple[str, str], Offender] = field(default_factory=dict)
    findings_seen: int = 0
    # The tenant's requests whose clean receipt a later one superseded (a finding came after
    # it): (request, the clean receipt's record, the current one's record, its findings).
    withdrawn: list[tuple[str, int, int, list[str]]] = field(default_factory=list)

    def add(self, record_id: int, f: pb.Finding) -> None:
        self.findings_seen += 1
        if f.victim_tenant != self.tenant or f.tenant == self.tenant:
            return
        key = (f.tenant, f.req)
        offender = self.offenders.get(key)
        if offender is None:
            offender = self.offenders[key] = Offender(f.tenant, f.req)
        if f.details.get("update_of"):  # an update: the offender's records say it (exposure_of)
            return
        if f.details.get("outcome") and not offender.fate:  # judged once its fate was known
            offender.fate, offender.fate_record = f.details["outcome"], record_id
        offender.add(record_id, f)

    def by_tenant(self) -> dict[str, list[Offender]]:
        groups: dict[str, list[Offender]] = defaultdict(list)
        for offender in self.offenders.values():
            groups[offender.tenant].append(offender)
        return dict(groups)

    def verbs(self) -> str:
        kinds = {k for o in self.offenders.values() for k in o.findings}
        verbs = list(dict.fromkeys(VERBS.get(k, "touched") for k in sorted(kinds, key=_verb_rank)))
        if len(verbs) <= 1:
            return verbs[0] if verbs else "read"
        return ", ".join(verbs[:-1]) + " or " + verbs[-1]

    def window(self) -> str:
        if self.since_ns and self.until_ns:
            return f" between {format_time(self.since_ns)} and {format_time(self.until_ns)}"
        if self.since_ns:
            return f" since {format_time(self.since_ns)}"
        if self.until_ns:
            return f" until {format_time(self.until_ns)}"
        return ""

    def summary(self) -> str:
        t = self.tenant
        if not self.offenders:
            return f"{t}: no request of another tenant reached {t}'s KV{self.window()} (0 exposures)."
        groups = self.by_tenant()
        n = len(self.offenders)
        outcomes = Counter(o.outcome for o in self.offenders.values())
        tenants = ", ".join(g or "unknown tenant" for g in groups)
        text = (
            f"{t}: {n} request{'s' if n != 1 else ''} of {len(groups)} other tenant"
            f"{'s' if len(groups) != 1 else ''} ({tenants}) {self.verbs()} {t}'s KV{self.window()}; "
            f"{outcomes['killed']} {'was' if outcomes['killed'] == 1 else 'were'} killed, "
        )
        if outcomes["reached_client"]:
            n = outcomes["reached_client"]
            text += (
                f"{n} {'was' if n == 1 else 'were'} answered before any kill took effect "
                "(the data reached the client), "
            )
        if outcomes["ordered"]:
            n = outcomes["ordered"]
            text += f"{n} {'was' if n == 1 else 'were'} ordered killed with no word that it took effect, "
        if outcomes["stopped"]:
            text += (
                f"{outcomes['stopped']} {'was' if outcomes['stopped'] == 1 else 'were'} denied or blocked, "
            )
        return text + f"{outcomes['unchecked']} went unchecked."

    def summary_json(self) -> dict[str, Any]:
        outcomes = Counter(o.outcome for o in self.offenders.values())
        return {
            "type": "summary",
            "tenant": self.tenant,
            "since_ns": self.since_ns,
            "until_ns": self.until_ns,
            "requests": len(self.offenders),
            "tenants": list(self.by_tenant()),
            "killed": outcomes["killed"],
            "reached_client": outcomes["reached_client"],
            "ordered": outcomes["ordered"],
            "stopped": outcomes["stopped"],
            "unchecked": outcomes["unchecked"],
            "receipts_withdrawn": [
                {"req": req, "clean_receipt": old, "current_receipt": new, "findings": found}
                for req, old, new, found in self.withdrawn
            ],
            "text": self.summary(),
        }


def _verb_rank(kind: str) -> tuple[int, str]:
    order = ["read", "received", "overwrote", "freed"]
    verb = VERBS.get(kind, "touched")
    return (order.index(verb) if verb in order else len(order), kind)


def unknown_tenant(source: Source, tenant: str) -> str:
    """Why `tenant` cannot be reported on: "" if the log names it (an admission, a finding as
    offender or victim), else that it is unknown, with the known names nearest to it (a
    misspelt tenant must not get a clean report)."""
    if next(iter(source.records(Filter(tenant=tenant, limit=1))), None) is not None:
        return ""
    known = source.tenants()
    near = difflib.get_close_matches(tenant, known, n=3, cutoff=0.6)
    hint = (
        f"; nearest known: {', '.join(near)}"
        if near
        else f"; it names {len(known)} tenant{'s' if len(known) != 1 else ''}"
        + (f", e.g. {', '.join(known[:3])}" if known else "")
    )
    return f"tenant {tenant!r} is unknown: no admission or finding in this audit log names it{hint}"


def exposure_of(source: Source, tenant: str, since_ns: int = 0, until_ns: int = 0) -> Exposure:
    """The findings where `tenant` is the victim and another tenant the offender, grouped, with
    whether each offending request was killed (a daemon kill command or a guard's kill event)."""
    report = Exposure(tenant, since_ns, until_ns)
    for item in source.records(Filter(kind="finding", tenant=tenant, since_ns=since_ns, until_ns=until_ns)):
        if isinstance(item.body, pb.Finding):
            report.add(item.id, item.body)
    for offender in report.offenders.values():
        if not offender.req:
            continue
        for item in source.records(Filter(req=offender.req)):
            body = item.body
            if isinstance(body, svc.Command) and body.WhichOneof("body") == "kill":
                if body.kill.req != offender.req:
                    continue
                offender.kill_commands += 1
            elif isinstance(body, pb.Finding) and body.req == offender.req and body.details.get("outcome"):
                # the daemon's update of one of its findings: what became of the request
                offender.fate, offender.fate_record = body.details["outcome"], item.id
                learned = body.details.get("learned_ns", "")
                offender.learned_ns = int(learned) if learned.isdigit() else 0
                continue
            elif isinstance(body, pb.Event) and body.WhichOneof("payload") == "kill" and body.kill.req:
                if body.kill.late:  # it had finished: this kill stopped nothing
                    offender.late_kills.append(body.kill.by or body.node)
                    continue
                offender.kill_events.append(body.kill.by or body.node)
            else:
                continue
            offender.first_kill_record = offender.first_kill_record or item.id
    report.withdrawn = withdrawn_receipts(source, tenant, since_ns, until_ns)
    return report


def withdrawn_receipts(
    source: Source, tenant: str, since_ns: int = 0, until_ns: int = 0
) -> list[tuple[str, int, int, list[str]]]:
    """The tenant's requests whose clean receipt a later receipt superseded with findings."""
    kept: dict[str, list[tuple[int, svc.Receipt]]] = defaultdict(list)
    for item in source.records(Filter(kind="receipt", tenant=tenant, since_ns=since_ns, until_ns=until_ns)):
        if isinstance(item.body, svc.SignedReceipt):
            r = svc.Receipt.FromString(item.body.receipt)
            if r.tenant == tenant:
                kept[r.req].append((item.id, r))
    out = []
    for req, receipts in kept.items():
        current_id, current = receipts[-1]
        clean = [rid for rid, r in receipts[:-1] if r.verdict == "clean"]
        if clean and current.verdict != "clean":
            out.append((req, clean[-1], current_id, sorted({f.finding for f in current.findings})))
    return out


def format_exposure(report: Exposure, out: TextIO) -> None:
    t = report.tenant
    if report.offenders:
        n = len(report.offenders)
        out.write(
            f"exposure of {t}{report.window()}: {n} request{'s' if n != 1 else ''} of other tenants "
            f"reached {t}'s KV\n"
        )
    for group, offenders in report.by_tenant().items():
        out.write(
            f"\n{group or 'unknown tenant'} ({len(offenders)} request{'s' if len(offenders) != 1 else ''})\n"
        )
        for o in offenders:
            if o.outcome == "killed":
                how = []
                if o.kill_commands:
                    how.append(f"{o.kill_commands} kill command{'s' if o.kill_commands != 1 else ''} sent")
                if o.kill_events:
                    how.append("killed by " + ", ".join(dict.fromkeys(o.kill_events)))
                outcome = "killed (" + "; ".join(how) + f"; the first at record {o.first_kill_record})"
            elif o.outcome == "reached_client":
                ordered = (
                    f"{o.kill_commands} kill command{'s' if o.kill_commands != 1 else ''} sent"
                    if o.kill_commands
                    else "no kill ordered"
                )
                learned = f", kvguard learned it at {format_time(o.learned_ns)}" if o.learned_ns else ""
                late = (
                    f"; kills that arrived after it finished: {', '.join(dict.fromkeys(o.late_kills))}"
                    if o.late_kills
                    else ""
                )
                said = f" (record {o.fate_record})" if o.fate_record else ""
                outcome = "REACHED THE CLIENT: answered before any kill took effect"
                outcome += f"{said}{learned}; {ordered}{late}"
            elif o.outcome == "ordered":
                s = "s" if o.kill_commands != 1 else ""
                outcome = (
                    f"KILL ORDERED, NOT CONFIRMED ({o.kill_commands} kill command{s} sent, the first at "
                    f"record {o.first_kill_record}; no record that it took effect)"
                )
            elif o.outcome == "stopped":
                outcome = (
                    "stopped (" + ", ".join(a for a in o.actions if a in STOPPING_ACTIONS) + "), not killed"
                )
            else:
                outcome = "UNCHECKED: no kill, no denial"
            span = format_time(o.first_ts_ns)
            if o.last_ts_ns != o.first_ts_ns:
                span += f" to {format_time(o.last_ts_ns)}"
            out.write(f"  {o.req or '?'}: {outcome}; action {', '.join(o.actions) or '-'}; at {span}\n")
            rows = []
            for p in o.parts.values():
                when = format_time(p.first_ts_ns)
                if p.last_ts_ns != p.first_ts_ns:
                    when += f" to {format_time(p.last_ts_ns)}"
                rows.append(
                    (
                        f"victim {p.victim_req or '?'}",
                        f"node {p.node or '?'}",
                        f"pool {p.pool}" if p.pool is not None else "pool -",
                        f"pages {page_ranges(sorted(p.pages)) or '-'}",
                        ", ".join(f"{k} x{c}" if c > 1 else k for k, c in sorted(p.findings.items())),
                        f"action {', '.join(sorted(p.actions)) or '-'}",
                        f"at {when}",
                        "records " + ",".join(map(str, p.record_ids)),
                    )
                )
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            for r in rows:
                out.write(
                    "    " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() + "\n"
                )
    if report.offenders:
        out.write("\n")
    if report.withdrawn:
        out.write(f"clean receipts of {t}'s requests withdrawn (a later finding superseded them):\n")
        for req, old, new, found in report.withdrawn:
            out.write(f"    {req}: receipt {old} (clean) superseded by receipt {new} ({', '.join(found)})\n")
        out.write("\n")
    out.write(report.summary() + "\n")
