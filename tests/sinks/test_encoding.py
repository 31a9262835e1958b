"""The alert feed's encodings against their specs, on the alerts a real daemon raised from real
events (the 2026 incident, and a cross-tenant prefix share the policy denies): OCSF 1.6.0
Detection Finding (required attributes, enum values, as the schema's JSON has them), CEF (the
header and extension escapes), JSON lines (stable keys and types) and RFC 5424 syslog with
RFC 6587 octet counting (parsed by a strict regex of the RFC's ABNF)."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Iterator

import pytest
from daemon_helpers import INCIDENT

from kvguard.agents.upstream import AgentStream
from kvguard.cli.process import start_daemon
from kvguard.proto import pb
from kvguard.proto.builder import EventLog
from kvguard.proto.capture import read_capture
from kvguard.proto.channel import channel
from kvguard.proto.client import DaemonClient
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.sinks import cef, fields, jsonl, ocsf, syslog

BASE_NS = 1_767_258_000 * 10**9  # 2026-01-01 09:00:00 UTC


def fed_events() -> list[pb.Event]:
    """The incident (its clock moved to BASE_NS), then on c0 globex reading acme's live prefix."""
    events = [e for _, e in read_capture(INCIDENT) if isinstance(e, pb.Event)]
    for e in events:
        e.ts_ns = BASE_NS + e.ts_ns * 100_000
    clock = itertools.count(BASE_NS + 2 * 10**9, 3_000_000)
    log = EventLog(clock=lambda: next(clock))
    log.add("c0", "pool", pool=0, role="colocated", page_size=16, num_pages=64)
    log.add("c0", "admit", req="a11", tenant="acme", prompt_tokens=64, stage="prefill")
    log.add("c0", "alloc", req="a11", pool=0, pages=[1, 2, 3, 4])
    log.add("c0", "write", req="a11", pool=0, pages=[1, 2, 3, 4])
    log.add("c0", "admit", req="g12", tenant="globex", prompt_tokens=80, stage="prefill")
    log.add("c0", "share", req="g12", pool=0, pages=[1, 2], origin_req="a11")
    log.add("c0", "alloc", req="g12", pool=0, pages=[5, 6])
    log.add("c0", "write", req="g12", pool=0, pages=[5, 6])
    log.add("c0", "read", reads=[{"req": "g12", "pool": 0, "pages": [1, 2, 5, 6], "tokens": 64}])
    return events + log.events


def feed(address: str, events: list[pb.Event]) -> None:
    """Each node's run of events as a batch, acknowledged (durable) before the next."""
    ch = channel(address, None)
    streams: dict[str, AgentStream] = {}
    try:
        for node, run in itertools.groupby(events, key=lambda e: e.node):
            if node not in streams:
                streams[node] = AgentStream(ch, node, "kvguard-agent")
            batch = list(run)
            ack = streams[node].send(batch)
            assert ack.accepted == len(batch) and not ack.rejected, ack
    finally:
        for stream in streams.values():
            stream.close()
        ch.close()


@pytest.fixture(scope="module")
def alerts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[svc.Alert]]:
    daemon = start_daemon(str(tmp_path_factory.mktemp("sinks") / "audit.db"))
    try:
        feed(daemon.address, fed_events())
        client = DaemonClient(daemon.address)
        records = client.query(Filter(kind="finding"))
        client.close()
        yield [svc.Alert(cursor=r.id, finding=r.finding) for r in records]
    finally:
        daemon.stop()


def test_the_daemon_raised_alerts_of_every_kind_of_action(alerts: list[svc.Alert]) -> None:
    actions = {a.finding.action for a in alerts}
    assert {"kill", "block", "deny", "alert"} <= actions, actions
    assert all(a.finding.ts_ns >= BASE_NS for a in alerts)
    # g1 was ordered stopped (block, then kills) but finished on its decode node first: one
    # update of its first finding says its response reached the client.
    (update,) = [a for a in alerts if "outcome" in a.finding.details]
    first = next(a for a in alerts if a.finding.req == "g1")
    assert fields.update_of(update.finding) == first.cursor and update.cursor > first.cursor
    assert (
        fields.outcome(update.finding) == "reached_client" and "reached the client" in update.finding.message
    )


def new(alerts: list[svc.Alert]) -> list[svc.Alert]:
    """The alerts of findings (not the updates that say what became of one)."""
    return [a for a in alerts if not fields.update_of(a.finding)]


# ------------------------------------------------------------------------------------------ OCSF

# From ocsf-schema 1.6.0: the attributes events/base_event.json, events/findings/finding.json and
# the objects used mark "required", and the enums of dictionary.json and the class's overrides.
OCSF_REQUIRED = ("activity_id", "category_uid", "class_uid", "metadata", "severity_id", "time", "type_uid")
OCSF_REQUIRED += ("finding_info",)
OCSF_ENUMS = {
    "activity_id": {0: "Unknown", 1: "Create", 2: "Update", 3: "Close", 99: "Other"},
    "severity_id": {0: "Unknown", 1: "Informational", 2: "Low", 3: "Medium", 4: "High", 5: "Critical"}
    | {6: "Fatal", 99: "Other"},
    "status_id": {0: "Unknown", 1: "New", 2: "In Progress", 3: "Suppressed", 4: "Resolved", 5: "Archived"}
    | {6: "Deleted", 99: "Other"},
    "action_id": {0: "Unknown", 1: "Allowed", 2: "Denied", 3: "Observed", 4: "Modified", 99: "Other"},
    "disposition_id": {0: "Unknown", 1: "Allowed", 2: "Blocked", 3: "Quarantined", 4: "Isolated"}
    | {5: "Deleted", 6: "Dropped", 7: "Custom Action", 8: "Approved", 9: "Restored", 10: "Exonerated"}
    | {11: "Corrected", 12: "Partially Corrected", 13: "Uncorrected", 14: "Delayed", 15: "Detected"}
    | {16: "No Action", 17: "Logged", 18: "Tagged", 19: "Alert", 20: "Count", 21: "Reset", 22: "Captcha"}
    | {23: "Challenge", 24: "Access Revoked", 25: "Rejected", 26: "Unauthorized", 27: "Error", 99: "Other"},
}
OCSF_CAPTIONS = {"activity_id": "activity_name", "severity_id": "severity", "status_id": "status"}
OCSF_CAPTIONS |= {"action_id": "action", "disposition_id": "disposition"}
ANALYTIC_TYPES = {0: "Unknown", 1: "Rule", 2: "Behavioral", 3: "Statistical", 99: "Other"}


def test_ocsf_detection_findings_carry_every_required_attribute_with_values_of_their_enums(
    alerts: list[svc.Alert],
) -> None:
    for alert in alerts:
        event = json.loads(ocsf.line(alert))
        assert set(OCSF_REQUIRED) <= set(event), alert
        assert (event["class_uid"], event["category_uid"], event["class_name"]) == (
            2004,
            2,
            "Detection Finding",
        )
        update = fields.update_of(alert.finding)
        assert (
            event["type_uid"]
            == event["class_uid"] * 100 + event["activity_id"]
            == (200402 if update else 200401)
        )
        for enum, caption in OCSF_CAPTIONS.items():
            assert event[caption] == OCSF_ENUMS[enum][event[enum]], (enum, event)
        assert event["time"] == alert.finding.ts_ns // 1_000_000  # ms since the epoch
        meta = event["metadata"]
        assert meta["version"] == "1.6.0" and re.fullmatch(r"1\.\d+\.\d+", meta["version"])
        assert meta["product"] == {"name": "kvguard", "vendor_name": "kvguard", "version": fields.VERSION}
        info = event["finding_info"]
        assert info["uid"] == f"kvguard-{update or alert.cursor}" and info["types"] == [alert.finding.finding]
        assert info["analytic"]["name"] == alert.finding.rule
        assert ANALYTIC_TYPES[info["analytic"]["type_id"]] == info["analytic"]["type"] == "Rule"
        if alert.finding.node:
            assert event["resources"][0]["hostname"] == alert.finding.node
        if alert.finding.tenant:  # an actor has a user, and a user a name or uid
            assert event["actor"]["user"]["name"] == alert.finding.tenant
        assert event["unmapped"]["cursor"] == alert.cursor
        assert json.loads(ocsf.line(alert)) == event  # the same alert, the same finding (stable uid)


OBSERVABLE_TYPES = {1: "Hostname", 4: "User Name", 10: "Resource UID"}  # OCSF 1.6 dictionary


def test_ocsf_maps_the_victim_the_offender_and_their_observables() -> None:
    leak = svc.Alert(
        cursor=7,
        finding=pb.Finding(
            finding="stale_read",
            severity="critical",
            action="kill",
            rule="stale_read_cross_tenant",
            node="d0",
            req="g1",
            tenant="globex",
            victim_req="a1",
            victim_tenant="acme",
            pool=0,
            pages=[1, 2],
            ts_ns=BASE_NS,
        ),
    )
    event = ocsf.event(leak)
    pool, request = event["resources"]
    acme = {"name": "acme", "uid": "acme", "type_id": 99, "type": "Tenant"}
    assert (pool["uid"], pool["owner"]) == ("d0/pool/0", acme)
    assert request == {
        "type": "inference_request",
        "uid": "a1",
        "role_id": 3,
        "role": "Affected",
        "owner": acme,
    }
    assert (event["actor"]["user"]["name"], event["actor"]["session"]["uid"]) == ("globex", "g1")
    observed = {(o["name"], o["value"]) for o in event["observables"]}
    assert observed == {
        ("resources[].hostname", "d0"),
        ("actor.user.name", "globex"),
        ("actor.session.uid", "g1"),
        ("resources[].owner.name", "acme"),
        ("resources[].uid", "a1"),
    }
    assert all(OBSERVABLE_TYPES[o["type_id"]] == o["type"] for o in event["observables"])
    # A finding about kvguard itself (a refused reload) affects no pool: no empty resource.
    internal = svc.Alert(
        cursor=8,
        finding=pb.Finding(
            finding="internal", severity="critical", rule="kvguard_reload_failed", ts_ns=BASE_NS
        ),
    )
    assert "resources" not in ocsf.event(internal) and ocsf.event(internal)["observables"] == []


def test_ocsf_says_whether_the_request_was_stopped_or_only_reported(alerts: list[svc.Alert]) -> None:
    # An order to stop a request is not a stop: its disposition is unknown until the update
    # says what became of it (here: it reached the client, so Allowed).
    by_action = {a.finding.action: json.loads(ocsf.line(a)) for a in new(alerts)}
    for stopped in ("kill", "block", "deny"):
        assert (by_action[stopped]["action"], by_action[stopped]["disposition"]) == ("Other", "Unknown")
        assert by_action[stopped]["unmapped"]["kvguard_outcome"] == "ordered"
    assert (by_action["alert"]["action_id"], by_action["alert"]["disposition_id"]) == (1, 17)  # Logged
    (update,) = [json.loads(ocsf.line(a)) for a in alerts if "outcome" in a.finding.details]
    assert (update["activity_name"], update["action"], update["disposition"]) == (
        "Update",
        "Allowed",
        "Allowed",
    )
    assert update["unmapped"]["kvguard_outcome"] == "reached_client"
    stopped_in_time = svc.Alert(
        cursor=9,
        finding=pb.Finding(
            finding="stale_read", action="kill", details={"outcome": "stopped", "update_of": "4"}
        ),
    )
    assert (json.loads(ocsf.line(stopped_in_time))["disposition"]) == "Blocked"
    share = by_action["deny"]
    assert share["severity_id"] == 4 and share["finding_info"]["types"] == ["cross_tenant_share"]
    assert share["actor"]["user"]["name"] == "globex" and share["unmapped"]["victim_tenant"] == "acme"


# ------------------------------------------------------------------------------------------- CEF


def parse_cef(line: str) -> tuple[list[str], dict[str, str]]:
    """A strict reading of a CEF line: eight fields split at unescaped pipes (the header's
    escapes undone), then key=value pairs split at unescaped equals signs."""
    header, rest, i, field = [], "", 0, ""
    while len(header) < 7:
        c = line[i]
        if c == "\\":
            assert line[i + 1] in "\\|", f"a bad header escape at {i}: {line!r}"
            field, i = field + line[i + 1], i + 2
        elif c == "|":
            header.append(field)
            field, i = "", i + 1
        else:
            field, i = field + c, i + 1
    rest = line[i:]
    assert "\n" not in rest and "\r" not in rest
    starts = [m for m in re.finditer(r"(?:^| )([A-Za-z0-9]+)=", rest) if not _escaped(rest, m.end() - 1)]
    ext = {}
    for m, nxt in zip(starts, [*starts[1:], None], strict=True):
        raw = rest[m.end() : nxt.start() if nxt else len(rest)]
        assert not re.search(r"(?<!\\)(?:\\\\)*=", raw), f"an unescaped = in {raw!r}"
        ext[m.group(1)] = re.sub(r"\\(.)", lambda e: {"n": "\n", "r": "\r"}.get(e.group(1), e.group(1)), raw)
    return header, ext


def _escaped(text: str, at: int) -> bool:
    backslashes = len(text[:at]) - len(text[:at].rstrip("\\"))
    return backslashes % 2 == 1


def test_cef_lines_of_the_daemons_alerts_read_back_field_for_field(alerts: list[svc.Alert]) -> None:
    for alert in alerts:
        header, ext = parse_cef(cef.line(alert))
        f = alert.finding
        name, severity = f"{f.finding} on {f.node}", str(cef.SEVERITIES[f.severity])
        assert header == ["CEF:0", "kvguard", "kvguard", fields.VERSION, f.rule, name, severity]
        update = fields.update_of(f)
        assert ext["cn2"] == str(alert.cursor) and ext["externalId"] == f"kvguard-{update or alert.cursor}"
        assert ext["msg"] == f.message and ext["cat"] == f.finding and ext["act"] == f.action
        assert ext["rt"] == str(f.ts_ns // 1_000_000)
        outcome = f.details.get("outcome") or ("allowed" if f.action == "alert" else "ordered")
        assert ext["outcome"] == outcome
        # the end of a run of repeats counts the findings it stands for (daemon/repeats.py)
        repeats = f.details.get("repeats")
        assert ext.get("cnt") == (str(1 + int(repeats)) if repeats else None)


@pytest.mark.parametrize(
    ("rule", "message", "header_rule", "ext_msg"),
    [
        ("a|b", "plain", r"a\|b", "plain"),
        ("back\\slash", "x=y", r"back\\slash", r"x\=y"),
        ("line\nbreak", "two\nlines\r\n", "line break", r"two\nlines\n"),
        ("|\\|", "a\\=b|c", r"\|\\\|", r"a\\\=b|c"),
    ],
)
def test_cef_escapes_pipes_and_backslashes_in_the_header_and_equals_and_line_breaks_in_values(
    rule: str, message: str, header_rule: str, ext_msg: str
) -> None:
    alert = svc.Alert(
        cursor=9, finding=pb.Finding(finding="anomaly", severity="low", rule=rule, message=message)
    )
    line = cef.line(alert)
    assert f"|{header_rule}|anomaly|3|" in line
    assert line.endswith(f" msg={ext_msg}") and "\n" not in line
    header, ext = parse_cef(line)
    assert header[4] == rule.replace("\n", " ") and ext["msg"] == message.replace("\r\n", "\n")


def test_cef_severity_runs_from_0_to_10() -> None:
    got = {
        s: cef.line(svc.Alert(finding=pb.Finding(finding="x", severity=s))).split("|")[6]
        for s in cef.SEVERITIES
    }
    assert got == {"critical": "10", "high": "8", "medium": "5", "low": "3", "info": "1"}
    assert cef.line(svc.Alert(finding=pb.Finding(finding="x", severity="bogus"))).split("|")[6] == "0"


# ------------------------------------------------------------------------------------ JSON lines


def test_json_lines_have_the_same_keys_in_the_same_order_and_integers_as_numbers(
    alerts: list[svc.Alert],
) -> None:
    lines = [jsonl.line(a) for a in alerts]
    assert all("\n" not in line for line in lines)
    records = [json.loads(line) for line in lines]
    assert len({tuple(r) for r in records}) == 1
    for alert, r in zip(alerts, records, strict=True):
        assert (
            r["cursor"] == alert.cursor
            and r["ts_ns"] == alert.finding.ts_ns
            and r["seq"] == alert.finding.seq
        )
        assert r["pool"] == (alert.finding.pool if alert.finding.HasField("pool") else None)
        assert r["pages"] == list(alert.finding.pages) and all(isinstance(p, int) for p in r["pages"])
        assert r["blocked"] is False  # none was stopped: an order is not a stop, and g1 reached its client
        assert r["outcome"] == fields.outcome(alert.finding)
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{9}Z", r["time"])


# ----------------------------------------------------------------------------- RFC 5424 syslog

# RFC 5424's SYSLOG-MSG with NILVALUE structured data (the ABNF of section 6, strictly).
RFC5424 = re.compile(
    rb"<(?P<pri>\d{1,3})>1 "
    rb"(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{1,6}(?:Z|[+-]\d\d:\d\d)) "
    rb"(?P<host>[\x21-\x7e]{1,255}) (?P<app>[\x21-\x7e]{1,48}) (?P<procid>[\x21-\x7e]{1,128}) "
    rb"(?P<msgid>[\x21-\x7e]{1,32}) (?P<sd>-|(?:\[[^\]]*\])+)(?: (?P<msg>.*))?",
    re.DOTALL,
)


def test_syslog_messages_follow_rfc_5424_and_octet_counting_rfc_6587(alerts: list[svc.Alert]) -> None:
    for alert in alerts:
        msg = syslog.message(
            alert, cef.line(alert), facility=syslog.FACILITIES["local4"], hostname="h", procid=42
        )
        m = RFC5424.fullmatch(msg)
        assert m, msg
        assert int(m["pri"]) == 20 * 8 + syslog.SEVERITIES[alert.finding.severity]
        assert m["ts"].decode() == jsonl.record(alert)["time"][:26] + "Z"  # microseconds
        assert (m["host"], m["app"], m["procid"], m["msgid"]) == (
            b"h",
            b"kvguard",
            b"42",
            alert.finding.finding.encode(),
        )
        assert m["msg"].decode() == cef.line(alert)
        framed = syslog.octet_counted(msg)
        length, _, rest = framed.partition(b" ")
        assert int(length) == len(rest) and rest == msg


def test_syslog_header_fields_are_printable_ascii_whatever_the_alert_holds() -> None:
    alert = svc.Alert(
        cursor=1, finding=pb.Finding(finding="a kind with spaces ünd more than thirty-two chars")
    )
    msg = syslog.message(alert, "m", hostname="host name\u00e9", procid=1)
    m = RFC5424.fullmatch(msg)
    assert (
        m and m["host"] == b"host_name_" and len(m["msgid"]) == 32 and m["msgid"].startswith(b"a_kind_with")
    )
    assert RFC5424.fullmatch(syslog.message(alert, "m", hostname="", procid=1))["host"] == b"-"


def test_a_drop_notice_encodes_as_an_alert_of_its_own() -> None:
    notice = fields.dropped_notice("file:///x", 5, 10, 14)
    assert fields.uid(notice) == "kvguard-dropped-10-14"
    event = json.loads(ocsf.line(notice))
    assert (
        event["finding_info"]["uid"] == "kvguard-dropped-10-14" and "5 alert(s) dropped" in event["message"]
    )
    assert parse_cef(cef.line(notice))[1]["cat"] == "alerts_dropped"
