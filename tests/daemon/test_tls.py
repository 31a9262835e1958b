"""Mutual TLS on the daemon's doors, for real: certificates of a throwaway operator CA, the
daemon and the node agent as processes, gRPC over TLS on loopback. Only clients with a
certificate of the CA get in, and a stream speaks only for a node its certificate names."""

from __future__ import annotations

import datetime
import ipaddress
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

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


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _issue(
    directory: Path,
    stem: str,
    cn: str,
    issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
    sans: list[x509.GeneralName] = (),  # type: ignore[assignment]
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A certificate (a CA's when `issuer` is None) written as <stem>.pem and <stem>.key."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(cn))
        .issuer_name(issuer[0].subject if issuer else _name(cn))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
    cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
    (directory / f"{stem}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (directory / f"{stem}.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("pki")
    ca = _issue(d, "ca", "kvguard test CA", None)
    loopback = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    _issue(d, "daemon", "kvguard-daemon", ca, loopback)
    _issue(d, "node-p0", "p0", ca, [x509.DNSName("p0"), x509.DNSName("p0-spare")])
    _issue(d, "node-d0", "d0", ca)
    _issue(d, "replayer", "forensics", ca, [x509.DNSName(n) for n in ("p0", "d0", "c0")])
    rogue_ca = _issue(d, "rogue-ca", "someone else's CA", None)
    _issue(d, "rogue-p0", "p0", rogue_ca)
    return d


def tls_args(pki: Path, who: str, ca: str = "ca") -> list[str]:
    ca_pem, cert, key = (str(pki / name) for name in (f"{ca}.pem", f"{who}.pem", f"{who}.key"))
    return ["--tls-ca", ca_pem, "--tls-cert", cert, "--tls-key", key]


def client(pki: Path, who: str, ca: str = "ca") -> Tls:
    tls = Tls.load(*(str(pki / name) for name in (f"{ca}.pem", f"{who}.pem", f"{who}.key")))
    assert tls is not None
    return tls


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
        counters = svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest()).counters
    assert counters["stream_identity"] == 2
    assert Store(daemon.store).count("event") == 3


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
    wanted = ["--daemon", daemon.address, "--kind", "finding", "-o", "json", *tls_args(pki, "node-p0")]
    query = subprocess.run(
        [*kvguard, "audit", "query", *wanted],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert query.returncode == 0, query.stderr
    stale = [json.loads(line) for line in query.stdout.splitlines() if '"stale_read"' in line]
    assert {r["finding"]["victim_req"] for r in stale} == {"a1", "a2"}
    plain = subprocess.run(
        [*kvguard, "audit", "query", "--daemon", daemon.address], capture_output=True, text=True, timeout=60
    )
    assert plain.returncode == 2 and "UNAVAILABLE" in plain.stderr
