"""Rules reloaded on SIGHUP by the real daemon: a changed rule judges the findings made after
the reload; rules that do not load leave the old ones in force, and the daemon's own critical
alert says so, stored and served to subscribers like any finding."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import time
from pathlib import Path

import grpc
from daemon_helpers import stale_reads, stored_findings

from kvguard.agents.upstream import AgentStream
from kvguard.cli.process import Service, start_daemon
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset import DEFAULT_RULES_DIR

# The general stale-read rule of the bundled rules (10-leaks.yaml), and the same at low.
STALE_READ_HIGH = "  finding: stale_read\n  severity: high\n"
STALE_READ_LOW = "  finding: stale_read\n  severity: low\n"


def rules_copy(tmp_path: Path) -> Path:
    rules = tmp_path / "rules"
    shutil.copytree(DEFAULT_RULES_DIR, rules)
    assert (rules / "10-leaks.yaml").read_text().count(STALE_READ_HIGH) == 1
    return rules


def lower_stale_read(rules: Path) -> None:
    leaks = rules / "10-leaks.yaml"
    leaks.write_text(leaks.read_text().replace(STALE_READ_HIGH, STALE_READ_LOW))


def reload_and_wait(daemon: Service, said: str, timeout: float = 30) -> str:
    """SIGHUP, then what the daemon writes on stderr until it says `said`."""
    daemon.proc.send_signal(signal.SIGHUP)
    return wait_for_said(daemon, said, timeout)


def wait_for_said(daemon: Service, said: str, timeout: float = 30) -> str:
    """What the daemon writes on stderr until it says `said` (read as it comes: what is left
    is read by Service.stop)."""
    assert daemon.proc.stderr is not None
    fd, text = daemon.proc.stderr.fileno(), b""
    deadline = time.monotonic() + timeout
    while said.encode() not in text:
        left = deadline - time.monotonic()
        assert left > 0, f"the daemon did not say {said!r}: {text.decode(errors='replace')}"
        if select.select([fd], [], [], left)[0]:
            chunk = os.read(fd, 65536)
            assert chunk, f"the daemon exited: {text.decode(errors='replace')}"
            text += chunk
    return text.decode()


def stale_read(stream: AgentStream, node: str, n: int) -> None:
    """The n-th stale read of `node` (its requests r0.. r{n-1}, one finding each)."""
    events = stale_reads(node, n)
    before = len(stale_reads(node, n - 1)) if n > 1 else 0
    ack = stream.send(events[before:])
    assert ack.accepted == len(events) - before


def test_a_reload_applies_the_changed_rule_to_findings_made_after_it(tmp_path: Path, store_url: str) -> None:
    rules = rules_copy(tmp_path)
    # Reloaded on SIGHUP only, so that the rules are not taken halfway through their edit.
    daemon = start_daemon(store_url, 0, "--rules", str(rules), "--mode", "monitor", "--reload-interval", "0")
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            stream = AgentStream(channel, "p1")
            stale_read(stream, "p1", 1)  # judged by the rules it started with
            lower_stale_read(rules)
            said = reload_and_wait(daemon, "rules reloaded")
            stale_read(stream, "p1", 2)  # judged by the reloaded ones
            stream.close()
            listed = svc_grpc.FleetServiceStub(channel).Rules(svc.RulesRequest(), timeout=30)
    finally:
        err = daemon.stop()
    assert f"rules reloaded from {rules}: " in said
    assert "0 added, 0 removed, 1 changed (stale_read)" in said
    assert "refused" not in said + err
    assert {r.id: r.severity for r in listed.rules}["stale_read"] == "low"  # as the daemon lists them
    found = [(f.req, f.rule, f.severity) for f in stored_findings(store_url)]
    assert found == [("p1-r0", "stale_read", "high"), ("p1-r1", "stale_read", "low")]


def test_rules_that_do_not_load_leave_the_old_ones_in_force_and_raise_a_critical_alert(
    tmp_path: Path, store_url: str
) -> None:
    rules = rules_copy(tmp_path)
    daemon = start_daemon(store_url, 0, "--rules", str(rules), "--mode", "monitor", "--reload-interval", "0")
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            alerts = svc_grpc.AlertServiceStub(channel)
            live = alerts.Subscribe(svc.AlertFilter(), timeout=60)
            stream = AgentStream(channel, "p2")
            stale_read(stream, "p2", 1)
            assert next(live).finding.req == "p2-r0"  # the subscription is live from here on
            lower_stale_read(rules)  # not taken: the set is loaded whole or not at all
            broken = rules / "50-broken.yaml"
            broken.write_text(
                "- rule: broken\n  description: d\n  finding: stale_read\n  severity: dire\n"
                "  action: alert\n  output: x\n"
            )
            said = reload_and_wait(daemon, "the previous settings stay in force")
            internal = next(live).finding
            stale_read(stream, "p2", 2)  # still judged by the old rules
            after = next(live).finding
            stream.close()
            live.cancel()
            # A subscriber that comes later reads it from the store.
            critical = svc.AlertFilter(severities=["critical"], findings=["internal"])
            later = alerts.Subscribe(critical, timeout=60)
            again = next(later).finding
            later.cancel()
    finally:
        err = daemon.stop()
    assert f"rules reload from {rules} refused" in said
    assert f"{broken}:4: " in said and "dire" in said  # the file, its line, the reason
    assert "kvguard_reload_failed" in said and "rules reloaded" not in said + err
    assert (internal.finding, internal.rule, internal.severity, internal.action) == (
        "internal",
        "kvguard_reload_failed",
        "critical",
        "alert",
    )
    assert f"rules reload from {rules} refused: {broken}:4: " in internal.message
    assert internal.message.endswith("the previous settings stay in force")
    assert internal.details["rules"] == str(rules) and f"{broken}:4: " in internal.details["errors"]
    assert (after.req, after.rule, after.severity) == ("p2-r1", "stale_read", "high")
    assert again == internal
    stored = stored_findings(store_url)
    assert [(f.finding, f.rule, f.severity) for f in stored] == [
        ("stale_read", "stale_read", "high"),
        ("internal", "kvguard_reload_failed", "critical"),
        ("stale_read", "stale_read", "high"),
    ]
    assert stored[1] == internal


def test_a_changed_configuration_is_taken_without_a_signal_and_a_bad_one_is_refused(
    tmp_path: Path, store_url: str
) -> None:
    rules = rules_copy(tmp_path)
    config = tmp_path / "kvguard.yaml"
    config.write_text(f"daemon:\n  rules: {rules}\n  mode: monitor\n")
    daemon = start_daemon(store_url, 0, "--config", str(config), "--reload-interval", "0.2")
    try:
        with grpc.insecure_channel(daemon.address) as channel:
            stream = AgentStream(channel, "p3")
            stale_read(stream, "p3", 1)
            # The rules and the log format changed together, in a drop-in: taken as a whole.
            lower_stale_read(rules)
            (tmp_path / "conf.d").mkdir()
            (tmp_path / "conf.d" / "50-logs.yaml").write_text("daemon:\n  log-format: json\n")
            said = wait_for_said(daemon, "rules reloaded from")
            stale_read(stream, "p3", 2)
            # A setting that cannot change while the daemon serves waits for the next start.
            config.write_text(f"daemon:\n  rules: {rules}\n  mode: monitor\n  clock-skew-ms: 50\n")
            later = wait_for_said(daemon, "taken at the next start")
            # A configuration that does not load changes nothing and raises the alert.
            config.write_text(f"daemon:\n  rules: {rules}\n  mdoe: enforce\n")
            refused = wait_for_said(daemon, "configuration reload refused")
            stale_read(stream, "p3", 3)  # still monitor, still the lowered rule
            stream.close()
    finally:
        err = daemon.stop()
    assert "0 added, 0 removed, 1 changed (stale_read)" in said
    (moved,) = [json.loads(line) for line in later.splitlines() if "next start" in line]  # JSON now
    assert moved["level"] == "warning" and moved["message"].endswith(": --clock-skew-ms")
    (record,) = [json.loads(line) for line in refused.splitlines() if "refused" in line]
    assert record["level"] == "error" and f"{config}: daemon: unknown option 'mdoe'" in record["message"]
    assert "did you mean 'mode'" in record["message"]
    found = [(f.req, f.rule, f.severity) for f in stored_findings(store_url)]
    assert found == [
        ("p3-r0", "stale_read", "high"),
        ("p3-r1", "stale_read", "low"),  # the rules changed with the log format
        ("", "kvguard_reload_failed", "critical"),
        ("p3-r2", "stale_read", "low"),  # the refused reload changed nothing
    ]
    assert "Traceback" not in err
