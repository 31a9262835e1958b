"""An alert as one line of JSON with stable field names (the same keys on every line, in the
same order; integers as numbers, absent values as "" or null or []).

Invariant: a key, once written here, keeps its name and type (SIEM parsers are built on them).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.sinks import fields


def record(alert: svc.Alert) -> dict[str, Any]:
    """The alert's fields, as the JSON line names them."""
    f = alert.finding
    ts_ns = fields.time_ns(alert)
    return {
        "uid": fields.uid(alert),
        "cursor": alert.cursor,
        "time": datetime.fromtimestamp(ts_ns // 1_000_000_000, UTC).strftime("%Y-%m-%dT%H:%M:%S")
        + f".{ts_ns % 1_000_000_000:09d}Z",
        "ts_ns": ts_ns,
        "finding": f.finding,
        "severity": f.severity,
        "action": f.action,
        "blocked": fields.blocked(f),
        "outcome": fields.outcome(f),
        "rule": f.rule,
        "node": f.node,
        "req": f.req,
        "tenant": f.tenant,
        "victim_req": f.victim_req,
        "victim_tenant": f.victim_tenant,
        "pool": f.pool if f.HasField("pool") else None,
        "pages": list(f.pages),
        "seq": f.seq,
        "message": f.message,
        "tags": list(f.tags),
        "details": dict(sorted(f.details.items())),
        "product": fields.PRODUCT,
        "version": fields.VERSION,
    }


def line(alert: svc.Alert) -> str:
    return json.dumps(record(alert), ensure_ascii=False, separators=(",", ":"))


body = record  # what an HTTP POST carries: the same object
