"""An alert as an OCSF Detection Finding (class 2004, category 2 Findings), schema 1.6.0,
with the Security Control profile (action and disposition: was the request stopped?).

Invariant: every attribute the schema requires of the class and of the objects used is
present with a value from its enum (checked against the schema's JSON in the tests); what
OCSF has no attribute for (victim, sequence, tags, details) goes under `unmapped`.
"""

from __future__ import annotations

import json
from typing import Any

from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.sinks import fields

SCHEMA_VERSION = "1.6.0"
CLASS_UID = 2004
CLASS_NAME = "Detection Finding"
CATEGORY_UID = 2
CATEGORY_NAME = "Findings"
ACTIVITY_CREATE = 1  # a new finding
ACTIVITY_UPDATE = 2  # what became of it (daemon/outcomes.py): the same finding, updated
STATUS_NEW = 1
STATUS_IN_PROGRESS = 2  # an operator acknowledged it
# observables' type_id (OCSF 1.6 dictionary): Hostname, User Name, Resource UID
HOSTNAME, USER_NAME, RESOURCE_UID = (1, "Hostname"), (4, "User Name"), (10, "Resource UID")

# OCSF severity_id: 1 Informational, 2 Low, 3 Medium, 4 High, 5 Critical (0 Unknown)
SEVERITY_IDS = {"info": (1, "Informational"), "low": (2, "Low"), "medium": (3, "Medium")}
SEVERITY_IDS |= {"high": (4, "High"), "critical": (5, "Critical")}
UNKNOWN = (0, "Unknown")
# (action_id, action), (disposition_id, disposition) of the Security Control profile
STOPPED = ((2, "Denied"), (2, "Blocked"))
REPORTED = ((1, "Allowed"), (17, "Logged"))
WENT_THROUGH = ((1, "Allowed"), (1, "Allowed"))  # stopped too late, or not at all: it reached the client
ORDERED = ((99, "Other"), (0, "Unknown"))  # a stop ordered: whether it came in time, its update says
ANALYTIC_RULE = 1  # analytic.type_id: Rule


def _action(f: pb.Finding) -> tuple[tuple[int, str], tuple[int, str]]:
    outcome = fields.outcome(f)
    if fields.blocked(f):
        return STOPPED
    if outcome == "ordered":
        return ORDERED
    if outcome in ("reached_client", "aborted"):
        return WENT_THROUGH
    if f.action:
        return REPORTED  # alert, log, alert+quarantine: the request went on
    return UNKNOWN, UNKNOWN


def event(alert: svc.Alert) -> dict[str, Any]:
    """The Detection Finding (a JSON object) that `alert` is."""
    f = alert.finding
    severity_id, severity = SEVERITY_IDS.get(f.severity, UNKNOWN)
    (action_id, action), (disposition_id, disposition) = _action(f)
    activity, activity_name = (
        (ACTIVITY_UPDATE, "Update") if fields.update_of(f) else (ACTIVITY_CREATE, "Create")
    )
    title = f"{f.finding} on {f.node}" if f.node else f.finding
    owner = {"owner": _tenant(f.victim_tenant)} if f.victim_tenant else {}
    resources: list[dict[str, Any]] = []
    if f.node or f.HasField("pool"):  # a finding about kvguard itself has none
        resource: dict[str, Any] = {"type": "kv_cache_pool", "role_id": 3, "role": "Affected", **owner}
        if f.node:
            resource |= {"hostname": f.node, "name": f.node}
        if f.HasField("pool"):
            resource |= {"uid": f"{f.node}/pool/{f.pool}", "data": {"pool": f.pool, "pages": list(f.pages)}}
        resources.append(resource)
    if f.victim_req:
        resources.append(
            {"type": "inference_request", "uid": f.victim_req, "role_id": 3, "role": "Affected", **owner}
        )
    acknowledged = "acknowledged_by" in f.details
    out: dict[str, Any] = {
        "class_uid": CLASS_UID,
        "class_name": CLASS_NAME,
        "category_uid": CATEGORY_UID,
        "category_name": CATEGORY_NAME,
        "activity_id": activity,
        "activity_name": activity_name,
        "type_uid": CLASS_UID * 100 + activity,
        "type_name": f"{CLASS_NAME}: {activity_name}",
        "time": fields.time_ns(alert) // 1_000_000,
        "severity_id": severity_id,
        "severity": severity,
        "status_id": STATUS_IN_PROGRESS if acknowledged else STATUS_NEW,
        "status": "In Progress" if acknowledged else "New",
        "is_alert": True,
        "message": f.message or title,
        "action_id": action_id,
        "action": action,
        "disposition_id": disposition_id,
        "disposition": disposition,
        "metadata": {
            "version": SCHEMA_VERSION,
            "product": {"name": fields.PRODUCT, "vendor_name": fields.VENDOR, "version": fields.VERSION},
            "profiles": ["security_control"],
            "uid": fields.uid(alert),
        },
        "finding_info": {
            "uid": fields.uid(alert),
            "title": title,
            "desc": f.message or title,
            "types": [f.finding],
            "analytic": {
                "name": f.rule or f.finding,
                "uid": f.rule or f.finding,
                "type_id": ANALYTIC_RULE,
                "type": "Rule",
            },
        },
        "observables": _observables(f),
        "unmapped": {
            "cursor": alert.cursor,
            "kvguard_action": f.action,
            "kvguard_outcome": fields.outcome(f),
            "req": f.req,
            "victim_req": f.victim_req,
            "victim_tenant": f.victim_tenant,
            "seq": f.seq,
            "ts_ns": f.ts_ns,
            "tags": list(f.tags),
            "details": dict(sorted(f.details.items())),
        },
    }
    count, first_ns, last_ns = fields.occurrences(f)
    if count:  # a run's summary (daemon/repeats.py): the findings it stands for, first to last
        out |= {"count": count, "start_time": first_ns // 1_000_000, "end_time": last_ns // 1_000_000}
    if resources:
        out["resources"] = resources
    if acknowledged:
        if f.details.get("acknowledged_ns", "").isdigit():
            out["finding_info"]["modified_time"] = int(f.details["acknowledged_ns"]) // 1_000_000
        reason = f.details.get("acknowledged_reason", "")
        out["status_detail"] = f"acknowledged by {f.details['acknowledged_by']}" + (
            f": {reason}" if reason else ""
        )
    if f.tenant or f.req:
        actor: dict[str, Any] = {"user": _tenant(f.tenant)} if f.tenant else {}
        if f.req:
            actor["session"] = {"uid": f.req}
        out["actor"] = actor
    return out


def _tenant(name: str) -> dict[str, Any]:
    return {"name": name, "uid": name, "type_id": 99, "type": "Tenant"}


def _observables(f: pb.Finding) -> list[dict[str, Any]]:
    """The finding's nodes, tenants and requests, each with where it is in the event."""
    found = [
        ("resources[].hostname", HOSTNAME, f.node),
        ("actor.user.name", USER_NAME, f.tenant),
        ("actor.session.uid", RESOURCE_UID, f.req),
        ("resources[].owner.name", USER_NAME, f.victim_tenant),
        ("resources[].uid", RESOURCE_UID, f.victim_req),
    ]
    return [
        {"name": name, "type_id": type_id, "type": type_name, "value": value}
        for name, (type_id, type_name), value in found
        if value
    ]


def line(alert: svc.Alert) -> str:
    """The finding as one line of JSON."""
    return json.dumps(event(alert), ensure_ascii=False, separators=(",", ":"))


body = event  # what an HTTP POST carries: the OCSF event itself
