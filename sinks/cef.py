"""An alert as an ArcSight CEF line: `CEF:0|kvguard|kvguard|VERSION|signatureId|name|severity|ext`.

Invariant: no field can break the line's structure: `\\` and `|` are escaped in header fields,
`\\`, `=` and line breaks in extension values, per the CEF spec (header fields carry no line
break: one becomes a space); extension keys are fixed names of the spec's dictionary.
"""

from __future__ import annotations

from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.sinks import fields

# CEF severity 0-10 (0-3 low, 4-6 medium, 7-8 high, 9-10 very high)
SEVERITIES = {"critical": 10, "high": 8, "medium": 5, "low": 3, "info": 1}
UNKNOWN_SEVERITY = 0


def header_field(text: str) -> str:
    """A header field: backslash and pipe escaped, line breaks made spaces."""
    text = text.replace("\\", "\\\\").replace("|", "\\|")
    return text.replace("\r\n", " ").replace("\r", " ").replace("\n", " ")


def extension_value(text: str) -> str:
    """An extension value: backslash, equals sign and line breaks escaped."""
    text = text.replace("\\", "\\\\").replace("=", "\\=")
    return text.replace("\r\n", "\\n").replace("\n", "\\n").replace("\r", "\\r")


def extensions(alert: svc.Alert) -> list[tuple[str, str]]:
    """The extension's key=value pairs, in a fixed order, empty ones left out."""
    f = alert.finding
    count, first_ns, last_ns = fields.occurrences(f)
    pairs = [
        ("rt", str(fields.time_ns(alert) // 1_000_000)),
        ("cnt", str(count) if count else ""),  # a run's summary: the findings it stands for
        ("start", str(first_ns // 1_000_000) if count else ""),
        ("end", str(last_ns // 1_000_000) if count else ""),
        ("externalId", fields.uid(alert)),
        ("cat", f.finding),
        ("act", f.action),
        ("outcome", fields.outcome(f)),
        ("dvchost", f.node),
        ("suser", f.tenant),
        ("duser", f.victim_tenant),
        ("cs1Label", "rule"),
        ("cs1", f.rule),
        ("cs2Label", "req"),
        ("cs2", f.req),
        ("cs3Label", "victim_req"),
        ("cs3", f.victim_req),
        ("cs4Label", "pages"),
        ("cs4", ",".join(map(str, f.pages))),
        ("cn1Label", "pool"),
        ("cn1", str(f.pool) if f.HasField("pool") else ""),
        ("cn2Label", "cursor"),
        ("cn2", str(alert.cursor)),
        ("cn3Label", "seq"),
        ("cn3", str(f.seq)),
        ("msg", f.message),
    ]
    present = {key for key, value in pairs if value and not key.endswith("Label")}
    # a label goes with its value (cs1Label with cs1), or not at all
    return [(k, v) for k, v in pairs if v and (not k.endswith("Label") or k[: -len("Label")] in present)]


def line(alert: svc.Alert) -> str:
    """The CEF line (no line break at its end)."""
    f = alert.finding
    name = f"{f.finding} on {f.node}" if f.node else f.finding
    header = [
        "CEF:0",
        header_field(fields.VENDOR),
        header_field(fields.PRODUCT),
        header_field(fields.VERSION),
        header_field(f.rule or f.finding),
        header_field(name),
        str(SEVERITIES.get(f.severity, UNKNOWN_SEVERITY)),
    ]
    ext = " ".join(f"{key}={extension_value(value)}" for key, value in extensions(alert))
    return "|".join(header) + "|" + ext


def body(alert: svc.Alert) -> dict[str, str]:
    """What an HTTP POST carries: the line, in the one JSON field a collector maps."""
    return {"cef": line(alert)}
