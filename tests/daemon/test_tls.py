"""Mutual TLS on the daemon's doors, for real: certificates of a throwaway operator CA, the
daemon and the node agent as processes, gRPC over TLS on loopback. Only clients with a
certificate of the CA get in, and a stream speaks only for a node its certificate names
(what each role may call: test_roles.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from certificates import client, make_pki, tls_args

from kvguard.agents.guard import AgentSink, Guard
from kvguard.agents.upstream import AgentStream, DaemonRefused
from kvguard.cli.process import Service, start_agent, start_daemon
from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.proto.capture import read_capture
from kvguard.proto.channel import Tls, TlsError, channel
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def daemon(pki: Path, tmp_path: Path) -> Iterator[Service]:
    d = start_daemon(str(tmp_path / "audit.db"), 0, *tls_args(pki, "daemon"))
    yield d
    d.stop()


def pool_event(node: str, seq: int = 1) -> pb.Event:
    return pb.Event(node=node, seq=seq, pool=pb.PoolReport(pool=0, role="decode", page_size=16, num_pages=8))


def test_a_node_speaks_for_the_names_in_its_certificate_only(pki: Path, daemon: Service) -> None:
    with channel(daemon.address, client(pki, "node-p0")) as ch:
        for name in ("p0", "p0-spare", "p0/ebpf"):  # p0/ebpf: p0's witness, under p0's name
            stream = AgentStream(ch, name)
            assert stream.send([pool_event(name)]).accepted == 1
            stream.close()
        for name in ("d0", "d0/ebpf"):
            refused = (
                rf"identity: node '{name}' is not named by the client's certificate \(it names p0, p0-spare\)"
            )
            with pytest.raises(DaemonRefused, match=refused):
                AgentStream(ch, name)
        # p0's probes are the documented ones, nothing else under p0's name, nor a way out of it
        for name, why in (
            ("p0/anything", "after '/' comes a probe of the node, one of ebpf, shim"),
            ("p0/../d0", "after '/' comes a probe of the node, one of ebpf, shim"),
            ("p0/ebpf/x", "after '/' comes a probe of the node, one of ebpf, shim"),
            ("../d0", "does not start with a node's name"),
            ("/ebpf", "does not start with a node's name"),
        ):
            with pytest.raises(DaemonRefused, match=re.escape(f"identity: node name {name!r}") + ".*" + why):
                AgentStream(ch, name)
        stream = AgentStream(ch, "p0/shim")  # the engine's CUDA shim, the other probe
        assert stream.send([pool_event("p0/shim")]).accepted == 1
        stream.close()
    with channel(daemon.address, client(pki, "siem")) as ch:  # the fleet state is for readers
        counters = svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest()).counters
    assert counters["stream_identity"] == 7
    assert Store(daemon.store).count("event") == 4
    assert {
        n.node
        for n in svc_grpc.FleetServiceStub(channel(daemon.address, client(pki, "siem")))
        .State(svc.FleetRequest())
        .nodes
    } == {"p0", "p0-spare", "p0/ebpf", "p0/shim"}


def test_clients_without_a_certificate_of_the_ca_are_turned_away(pki: Path, daemon: Service) -> None:
    for ch in (
        grpc.insecure_channel(daemon.address),  # plaintext
        channel(daemon.address, client(pki, "rogue-p0", ca="ca")),  # a certificate the CA did not sign
    ):
        with ch, pytest.raises(grpc.RpcError) as err:
            svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    # ... and a daemon whose certificate this client's CA did not sign is not trusted either.
    with channel(daemon.address, client(pki, "node-p0", ca="rogue-ca")) as ch, pytest.raises(grpc.RpcError):
        svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10)
    assert Store(daemon.store).count("event") == 0


def test_the_node_agent_forwards_over_mutual_tls(pki: Path, daemon: Service, tmp_path: Path) -> None:
    sock = tmp_path / "agent.sock"
    agent = start_agent(str(sock), daemon.address, str(tmp_path / "spool"), *tls_args(pki, "node-d0"))
    try:
        sink = AgentSink(sock, "d0")
        guard = Guard("d0", mode="monitor", sink=sink)
        guard.pool(0, "decode", page_size=16, num_pages=8, context_len=64)
        guard.alloc("r1", 0, [1, 2])
        guard.free("r1", 0, [1, 2])
        assert sink.flush()
        deadline = time.monotonic() + 20
        while Store(daemon.store).count("event") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        s = Store(daemon.store)
        assert [pb.Event.FromString(b).WhichOneof("payload") for _, _, b in s.rows(kind="event")] == [
            "pool",
            "alloc",
            "free",
        ]
        s.close()
        sink.close()
    finally:
        agent.stop()


def test_incomplete_tls_options_say_what_is_missing(pki: Path, tmp_path: Path) -> None:
    with pytest.raises(TlsError, match="missing --tls-key"):
        Tls.load(str(pki / "ca.pem"), str(pki / "daemon.pem"), None)
    with pytest.raises(TlsError, match=r"--tls-cert .*nope.pem: No such file"):
        Tls.load(str(pki / "ca.pem"), str(tmp_path / "nope.pem"), str(pki / "daemon.key"))
    needs = "mutual TLS needs --tls-ca, --tls-cert and --tls-key; missing --tls-ca, --tls-key"
    with pytest.raises(RuntimeError, match=needs):
        start_daemon(str(tmp_path / "audit.db"), 0, "--tls-cert", str(pki / "daemon.pem"), quiet=False)


def test_replay_and_audit_queries_reach_a_tls_daemon(pki: Path, daemon: Service) -> None:
    capture = DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl"
    events = [e for _, e in read_capture(capture.read_text().splitlines())]
    # A certificate that names the capture's nodes (p0, d0), as a forensics operator's would.
    kvguard = [sys.executable, "-m", "kvguard"]
    replay = subprocess.run(
        [*kvguard, "replay", str(capture), "--to", daemon.address, *tls_args(pki, "replayer")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert replay.returncode == 0, replay.stderr
    assert (
        f"sent {len(events)} events from {capture} to {daemon.address}: {len(events)} stored" in replay.stderr
    )
    wanted = ["--daemon", daemon.address, "--kind", "finding", "-o", "json"]
    query = subprocess.run(
        [*kvguard, "audit", "query", *wanted, *tls_args(pki, "siem")],  # a reader's certificate
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert query.returncode == 0, query.stderr
    stale = [json.loads(line) for line in query.stdout.splitlines() if '"stale_read"' in line]
    # (the end of their run of repeats, an update, names both in its details)
    assert {r["finding"]["victim_req"] for r in stale if "update_of" not in r["finding"]["details"]} == {
        "a1",
        "a2",
    }
    as_node = subprocess.run(
        [*kvguard, "audit", "query", *wanted, *tls_args(pki, "node-p0")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert as_node.returncode == 2 and as_node.stdout == ""
    assert (
        f"kvguard audit query: the daemon at {daemon.address}: PERMISSION_DENIED: "
        "/kvguard.v1.AuditService/Query takes a reader's certificate" in as_node.stderr
    )
    plain = subprocess.run(
        [*kvguard, "audit", "query", "--daemon", daemon.address], capture_output=True, text=True, timeout=60
    )
    assert plain.returncode == 2 and "UNAVAILABLE" in plain.stderr


def test_replay_to_skips_the_nodes_the_daemon_refuses_and_sends_the_rest(pki: Path, daemon: Service) -> None:
    # p0's certificate speaks for p0 (and p0-spare) only: d0's lines are refused, each said with
    # the daemon's reason, and every p0 line after them still goes, as a local replay would.
    from kvguard.proto.builder import EventLog

    log = EventLog()
    for i in range(3):
        for node in ("p0", "d0"):
            log.add(node, "pool", pool=i, role="decode", page_size=16, num_pages=8)
    capture = Path(daemon.store).parent / "two-nodes.jsonl"
    capture.write_text(log.to_jsonl())
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", "replay", str(capture), "--to", daemon.address,
         *tls_args(pki, "node-p0")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr
    said = done.stdout + done.stderr
    assert said.count("node 'd0' refused: identity: node 'd0' is not named by the client's certificate") == 3
    assert "3 refused" in said and "Traceback" not in said
    assert Store(daemon.store).count("event") == 3  # p0's three, d0's none


def test_an_agent_refuses_a_guard_its_certificate_does_not_name_and_retries_nothing(
    pki: Path, daemon: Service, tmp_path: Path
) -> None:
    # The agent holds d0's certificate: a guard of p0 would have its events refused by the
    # daemon forever. It is told so at its hello, counted, and nothing is spooled or retried.
    sock = tmp_path / "agent.sock"
    spool = tmp_path / "spool"
    agent = start_agent(str(sock), daemon.address, str(spool), *tls_args(pki, "node-d0"))
    try:
        sink = AgentSink(sock, "p0")
        deadline = time.monotonic() + 20
        while not sink.refused and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sink.refused == "identity: node 'p0' is not named by this agent's certificate (it names d0)"
        assert not sink.connected.is_set() and sink.refusals >= 1
        sink.close()
        time.sleep(1.0)  # time enough for a retry loop to show itself
    finally:
        said = agent.stop()
    assert "retrying" not in said and "unavailable" not in said
    assert not list(spool.glob("*p0*"))
    assert Store(daemon.store).count("event") == 0
