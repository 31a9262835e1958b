"""Roles under mutual TLS, for real: a daemon process with TLS and certificates of a throwaway
CA (tests/support/certificates.py). A node's certificate streams the events of the nodes it
names and reads nothing; a reader's (URI SAN urn:kvguard:role:reader) reads the audit log, the
alerts and the fleet state, and opens no agent stream, even if it names a node too, and takes
no action; an operator's (urn:kvguard:role:operator) reads as a reader does and acts
(ControlService), its actions recorded under its certificate's common name. Each refusal is
PERMISSION_DENIED with its reason, counted and logged by the daemon."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from certificates import client, make_pki, tls_args
from grpc_health.v1 import health_pb2, health_pb2_grpc
from log_lines import said as said_lines

from kvguard.agents.upstream import AgentStream
from kvguard.cli.process import Service, start_daemon
from kvguard.cli.send import send_capture
from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.proto.channel import channel
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR

INCIDENT = DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl"
NODE_MAY = "may only stream the events of the nodes it names"
READER_MAY = "may read the audit log, the alerts and the fleet state, but neither act nor speak for a node"
OPERATOR_MAY = "may read the audit log, the alerts and the fleet state and act, but not speak for a node"
TAKES_A_READER = (
    "takes a reader's certificate (URI SAN urn:kvguard:role:reader) "
    "or an operator's certificate (URI SAN urn:kvguard:role:operator)"
)
TAKES_AN_OPERATOR = "takes an operator's certificate (URI SAN urn:kvguard:role:operator)"


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def daemon(pki: Path, tmp_path: Path) -> Iterator[Service]:
    d = start_daemon(str(tmp_path / "audit.db"), 0, *tls_args(pki, "daemon"))
    yield d
    d.stop()


def denied(call: Callable[[], Any]) -> str:
    """What the daemon said refusing `call` with PERMISSION_DENIED."""
    with pytest.raises(grpc.RpcError) as refused:
        call()
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
    return str(refused.value.details())


def serving(ch: grpc.Channel) -> bool:
    check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
    return bool(check.status == health_pb2.HealthCheckResponse.SERVING)


def denials(pki: Path, daemon: Service) -> dict[str, int]:
    with channel(daemon.address, client(pki, "siem")) as ch:
        counters = svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10).counters
    return {role: counters[f"access_denied_{role}"] for role in ("node", "reader", "operator")}


def test_a_reader_reads_the_audit_log_alerts_and_fleet_but_speaks_for_no_node(
    pki: Path, daemon: Service
) -> None:
    sent = send_capture(INCIDENT.read_text().splitlines(), daemon.address, tls=client(pki, "replayer"))
    assert sent.accepted == sent.events == 39
    with channel(daemon.address, client(pki, "siem")) as ch:
        records = svc_grpc.AuditServiceStub(ch).Query(svc.AuditQuery(kind="finding"), timeout=10)
        leaks = {
            r.finding.victim_req
            for r in records
            if r.finding.finding == "stale_read" and "update_of" not in r.finding.details
        }
        assert leaks == {"a1", "a2"}
        alerts = svc_grpc.AlertServiceStub(ch).Subscribe(svc.AlertFilter(findings=["stale_read"]), timeout=10)
        # a1's read is the alert; a2's repeats it, and the end of the run names both
        first, end = next(alerts), next(alerts)
        assert (first.finding.victim_req, end.finding.details["victim_reqs"]) == ("a1", "a1,a2")
        alerts.cancel()
        state = svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10)
        assert {n.node for n in state.nodes} == {"p0", "d0"}
        assert serving(ch)
    for reader in ("siem", "reader-p0"):  # reader-p0 also names p0: a reader's all the same
        with channel(daemon.address, client(pki, reader)) as ch:
            said = denied(lambda ch=ch: AgentStream(ch, "p0"))  # type: ignore[misc]
        who = "siem" if reader == "siem" else "p0"
        assert said == (
            "/kvguard.v1.AgentService/Stream takes a node's certificate (no role URI); "
            f"this one ({who}) is a reader's, which {READER_MAY}"
        )
    assert Store(daemon.store).count("event") == 39
    assert denials(pki, daemon) == {"node": 0, "reader": 2, "operator": 0}


def test_a_node_streams_its_own_events_and_reads_nothing(pki: Path, daemon: Service) -> None:
    with channel(daemon.address, client(pki, "node-p0")) as ch:
        stream = AgentStream(ch, "p0")
        pool = pb.PoolReport(pool=0, role="decode", page_size=16, num_pages=8)
        ack = stream.send([pb.Event(node="p0", seq=1, pool=pool), pb.Event(node="d0", seq=2, pool=pool)])
        stream.close()
        assert ack.accepted == 1 and len(ack.rejected) == 1 and "d0" in ack.rejected[0].reason
        said = {
            "/kvguard.v1.AuditService/Query": denied(
                lambda: list(svc_grpc.AuditServiceStub(ch).Query(svc.AuditQuery(), timeout=10))
            ),
            "/kvguard.v1.AlertService/Subscribe": denied(
                lambda: next(svc_grpc.AlertServiceStub(ch).Subscribe(svc.AlertFilter(), timeout=10))
            ),
            "/kvguard.v1.FleetService/State": denied(
                lambda: svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10)
            ),
        }
        assert serving(ch)  # health checking is open to every certificate of the CA
    for method, reason in said.items():
        assert reason == f"{method} {TAKES_A_READER}; this one (p0) is a node's, which {NODE_MAY}"
    s = Store(daemon.store)
    assert [pb.Event.FromString(body).node for _, _, body in s.rows(kind="event")] == ["p0"]
    s.close()
    assert denials(pki, daemon) == {"node": 3, "reader": 0, "operator": 0}
    logged = [line for line in said_lines(daemon.stop()) if " refused " in line]
    assert len(logged) == 3
    for line, (method, reason) in zip(logged, said.items(), strict=True):
        assert line.startswith("kvguard daemon: refused ipv4:127.0.0.1:") and line.endswith(f": {reason}")
        assert method in line


def test_a_daemons_certificate_speaks_for_no_node_and_reads_nothing(pki: Path, daemon: Service) -> None:
    """A daemon's own certificate is its identity on the bus (a client there); to a daemon it
    opens nothing, whatever node it names."""
    with channel(daemon.address, client(pki, "daemon-p0")) as ch:
        assert serving(ch)
        said = denied(lambda: AgentStream(ch, "p0"))
        read = denied(lambda: svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10))
    assert said == (
        "/kvguard.v1.AgentService/Stream takes a node's certificate (no role URI); this one "
        "(kvguard-daemon) is a daemon's, which is a client of the bus only, never of a daemon"
    )
    assert read.startswith("/kvguard.v1.FleetService/State takes a reader's certificate")
    assert Store(daemon.store).count("event") == 0


def test_the_commands_take_the_same_tls_options_in_either_role(pki: Path, daemon: Service) -> None:
    def kvguard(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "kvguard", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=60)

    fleet = ["fleet", "--daemon", daemon.address, "-o", "json"]
    assert kvguard(*fleet, *tls_args(pki, "siem")).returncode == 0
    as_node = kvguard(*fleet, *tls_args(pki, "node-d0"))
    assert as_node.returncode == 2
    assert as_node.stderr.strip() == (
        f"kvguard fleet: daemon {daemon.address}: not allowed: /kvguard.v1.FleetService/State "
        f"{TAKES_A_READER}; this one (d0) is a node's, which {NODE_MAY}"
    )
    replay = kvguard("replay", str(INCIDENT), "--to", daemon.address, *tls_args(pki, "siem"))
    assert replay.returncode == 2
    assert f"kvguard replay: the daemon at {daemon.address} refused: /kvguard.v1.AgentService/Stream" in (
        replay.stderr
    )
    assert Store(daemon.store).count("event") == 0


def test_only_an_operator_acts_and_its_action_names_its_certificate(pki: Path, daemon: Service) -> None:
    rule_mode = svc.Action(rule_mode=svc.RuleMode(rule="stale_read", mode="monitor"), reason="noisy")
    claimed = [("kvguard-user", "mallory")]  # under mutual TLS the certificate says who, not the client
    said = {}
    for who in ("siem", "node-p0"):
        with channel(daemon.address, client(pki, who)) as ch:
            stub = svc_grpc.ControlServiceStub(ch)
            said[who] = denied(lambda stub=stub: stub.Act(rule_mode, metadata=claimed, timeout=10))  # type: ignore[misc]
    assert said == {
        "siem": f"/kvguard.v1.ControlService/Act {TAKES_AN_OPERATOR}; this one (siem) is a reader's, "
        f"which {READER_MAY}",
        "node-p0": f"/kvguard.v1.ControlService/Act {TAKES_AN_OPERATOR}; this one (p0) is a node's, "
        f"which {NODE_MAY}",
    }
    assert Store(daemon.store).count("action") == 0
    for operator in ("operator", "operator-p0"):  # operator-p0 also names p0: an operator's all the same
        with channel(daemon.address, client(pki, operator)) as ch:
            done = svc_grpc.ControlServiceStub(ch).Act(rule_mode, metadata=claimed, timeout=10)
            assert serving(ch)
            state = svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10)  # and it reads
            said[operator] = denied(lambda ch=ch: AgentStream(ch, "p0"))  # type: ignore[misc]
        assert done.action.by == f"cn:{'alice' if operator == 'operator' else 'bob'}"
        assert state.mode == "enforce"
    assert said["operator-p0"] == (
        "/kvguard.v1.AgentService/Stream takes a node's certificate (no role URI); "
        f"this one (bob) is an operator's, which {OPERATOR_MAY}"
    )
    s = Store(daemon.store)
    actions = [svc.Action.FromString(body) for _, _, body in s.rows(kind="action")]
    s.close()
    assert [(a.by, a.rule_mode.rule, a.reason) for a in actions] == [
        ("cn:alice", "stale_read", "noisy"),
        ("cn:bob", "stale_read", "noisy"),
    ]
    assert denials(pki, daemon) == {"node": 1, "reader": 1, "operator": 2}
