"""Revocation, for real: `kvguard certs revoke` writes the CA's CRL, a daemon process run with
--tls-crl refuses every call of a certificate it names (whatever its role, with the reason),
a reload that brings a new CRL cuts the revoked certificate's open streams at once and leaves
the others alone, and a CRL that is not the CA's is refused at start and at reload (the one in
force stays). openssl, reading the same files, agrees on what is revoked."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from certificates import client, make_pki, tls_args
from grpc_health.v1 import health_pb2, health_pb2_grpc
from log_lines import said as said_lines
from prometheus_client.parser import text_string_to_metric_families

from kvguard.agents.upstream import AgentStream
from kvguard.cli.process import Service, start_daemon
from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.proto.channel import channel
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc


def certs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvguard", "certs", *args], capture_output=True, text=True)


def rogue_crl(pki: Path, tmp_path: Path) -> Path:
    """A directory holding another CA (the test PKI's rogue one) and a CRL it signed."""
    rogue = tmp_path / "rogue"
    rogue.mkdir()
    shutil.copy(pki / "rogue-ca.pem", rogue / "ca.pem")
    shutil.copy(pki / "rogue-ca.key", rogue / "ca.key")
    assert certs("revoke", str(rogue), "--serial", "02").returncode == 0
    return rogue


def serial_of(pem: Path) -> str:
    from cryptography import x509

    return f"{x509.load_pem_x509_certificate(pem.read_bytes()).serial_number:x}"


@pytest.fixture
def pki(tmp_path: Path) -> Path:
    (tmp_path / "pki").mkdir()
    d = make_pki(tmp_path / "pki")
    done = certs("revoke", str(d), "--serial", "01")  # a list that revokes no certificate of ours yet
    assert done.returncode == 0, done.stderr
    return d


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def refused_revoked(port: int) -> float:
    """kvguard_daemon_refused_total{reason="access_denied_revoked"}, scraped."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvguard_daemon_refused_total" and sample.labels == {
                "reason": "access_denied_revoked"
            }:
                return sample.value
    return 0.0


@pytest.fixture
def daemon(pki: Path, tmp_path: Path) -> Iterator[Service]:
    port = free_port()
    d = start_daemon(
        str(tmp_path / "audit.db"),
        0,
        *tls_args(pki, "daemon"),
        "--tls-crl",
        str(pki / "crl.pem"),
        "--reload-interval",
        "0.2",
        "--metrics-listen",
        f"127.0.0.1:{port}",
    )
    d.metrics_port = port  # type: ignore[attr-defined]
    yield d
    d.stop()


def denied(call: Callable[[], Any]) -> str:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, refused.value
    return str(refused.value.details())


def state(pki: Path, daemon: Service) -> svc.FleetState:
    with channel(daemon.address, client(pki, "operator")) as ch:
        return svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10)


def health(ch: grpc.Channel) -> Any:
    return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)


def wait_for(check: Callable[[], bool], timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def test_a_revoked_certificate_opens_nothing_and_the_others_are_untouched(pki: Path, daemon: Service) -> None:
    assert certs("revoke", str(pki), str(pki / "siem.pem"), "--reason", "key_compromise").returncode == 0
    wait_for(lambda: state(pki, daemon).counters["reloads"] >= 1)  # the reload the new file brought
    why = f"certificate siem (serial {serial_of(pki / 'siem.pem')}) was revoked"
    with channel(daemon.address, client(pki, "siem")) as ch:
        said = {
            "query": denied(lambda: list(svc_grpc.AuditServiceStub(ch).Query(svc.AuditQuery(), timeout=10))),
            "state": denied(lambda: svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10)),
            "health": denied(lambda: health(ch)),  # open to every role, not to a revoked certificate
        }
    for reason in said.values():
        assert reason.startswith(why) and reason.endswith(f"UTC (key_compromise) by {pki / 'crl.pem'}")
    with channel(daemon.address, client(pki, "reader-p0")) as ch:  # another reader: reads as before
        assert health(ch).status == health_pb2.HealthCheckResponse.SERVING
        list(svc_grpc.AuditServiceStub(ch).Query(svc.AuditQuery(), timeout=10))
    assert state(pki, daemon).counters["access_denied_revoked"] == 3
    assert refused_revoked(daemon.metrics_port) == 3  # type: ignore[attr-defined]
    err = said_lines(daemon.stop())
    assert sum(line.startswith("kvguard daemon: refused ") and why in line for line in err) == 3


def test_a_reload_cuts_the_revoked_certificates_open_streams_at_once(pki: Path, daemon: Service) -> None:
    siem = channel(daemon.address, client(pki, "siem"))
    alerts = svc_grpc.AlertServiceStub(siem).Subscribe(
        svc.AlertFilter(), timeout=30
    )  # open, nothing to send yet
    node_ch = channel(daemon.address, client(pki, "node-d0"))
    victim = channel(daemon.address, client(pki, "node-p0"))
    pool = pb.PoolReport(pool=0, role="decode", page_size=16, num_pages=8)
    d0, p0 = AgentStream(node_ch, "d0"), AgentStream(victim, "p0")
    assert d0.send([pb.Event(node="d0", seq=1, pool=pool)]).accepted == 1
    assert p0.send([pb.Event(node="p0", seq=1, pool=pool)]).accepted == 1

    done = certs("revoke", str(pki), str(pki / "siem.pem"), str(pki / "node-p0.pem"))
    assert done.returncode == 0, done.stderr
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as cut:
        next(alerts)  # ends when the reload cuts it: it has had nothing to send
    assert cut.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert str(cut.value.details()).startswith(
        f"certificate siem (serial {serial_of(pki / 'siem.pem')}) was revoked"
    )
    assert time.monotonic() - started < 15
    with pytest.raises(grpc.RpcError) as cut_node:
        p0.send([pb.Event(node="p0", seq=2, pool=pool)])
    assert cut_node.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.CANCELLED)
    # d0's certificate is not revoked: its stream goes on as if nothing happened
    assert d0.send([pb.Event(node="d0", seq=2, pool=pool)]).accepted == 1
    d0.close()
    for ch in (siem, node_ch, victim):
        ch.close()
    assert Store(daemon.store).count("event") == 3  # p0's event after the cut was not taken
    err = said_lines(daemon.stop())
    cut_lines = [line for line in err if line.startswith("kvguard daemon: cut ")]
    assert len(cut_lines) == 2 and all("was revoked" in line for line in cut_lines)


def test_a_crl_that_is_not_the_cas_is_refused_at_start_and_at_reload(pki: Path, tmp_path: Path) -> None:
    rogue = rogue_crl(pki, tmp_path)
    with pytest.raises(RuntimeError) as refused:
        start_daemon(str(tmp_path / "a.db"), 0, *tls_args(pki, "daemon"), "--tls-crl", str(rogue / "crl.pem"))
    assert (
        f"CRL {rogue / 'crl.pem'}: issued by CN=someone else's CA, not by the CA (CN=kvguard test CA)"
        in str(refused.value)
    )

    assert certs("revoke", str(pki), str(pki / "siem.pem")).returncode == 0
    live = tmp_path / "live-crl.pem"
    shutil.copy(pki / "crl.pem", live)
    d = start_daemon(
        str(tmp_path / "b.db"),
        0,
        *tls_args(pki, "daemon"),
        "--tls-crl",
        str(live),
        "--reload-interval",
        "0.2",
    )
    try:
        shutil.copy(rogue / "crl.pem", live)  # someone else's list, which would let siem back in
        wait_for(lambda: state(pki, d).counters["reloads_refused"] >= 1)
        with channel(d.address, client(pki, "siem")) as ch:  # the list in force is still the CA's
            assert "was revoked" in denied(lambda: health(ch))
        with channel(d.address, client(pki, "operator")) as ch:
            records = list(svc_grpc.AuditServiceStub(ch).Query(svc.AuditQuery(kind="finding"), timeout=10))
        assert [r.finding.rule for r in records] == ["kvguard_reload_failed"]
        assert "not by the CA" in records[0].finding.message
    finally:
        d.stop()


def test_certs_revoke_keeps_every_earlier_revocation_and_openssl_agrees(pki: Path) -> None:
    first = certs("revoke", str(pki), str(pki / "node-p0.pem"), "--reason", "superseded")
    again = certs("revoke", str(pki), str(pki / "node-d0.pem"), str(pki / "node-p0.pem"), "--serial", "0a:bc")
    assert first.returncode == 0 and again.returncode == 0, again.stderr
    assert "already revoked" in again.stdout
    shown = certs("show", str(pki / "crl.pem")).stdout
    assert "revokes  4 certificate(s)" in shown  # 01 (the fixture's), p0, d0, abc
    assert f"serial   {serial_of(pki / 'node-p0.pem')} since" in shown and "(superseded)" in shown
    for name, verdict in (
        ("node-p0", "certificate revoked"),
        ("node-d0", "certificate revoked"),
        ("siem", "OK"),
    ):
        files = ["-CAfile", str(pki / "ca.pem"), "-CRLfile", str(pki / "crl.pem"), str(pki / f"{name}.pem")]
        checked = subprocess.run(["openssl", "verify", "-crl_check", *files], capture_output=True, text=True)
        assert verdict in checked.stdout + checked.stderr, (name, checked)
    number = subprocess.run(
        ["openssl", "crl", "-in", str(pki / "crl.pem"), "-noout", "-crlnumber"],
        capture_output=True,
        text=True,
    ).stdout
    assert number.strip() == "crlNumber=0x03"  # the fixture's list, then two more


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["rogue-p0.pem"], "rogue-p0.pem: not issued by this CA"),
        (["ca.pem"], "ca.pem: the CA itself"),
        (["--serial", "xyz"], "--serial xyz: not a hexadecimal serial number"),
    ],
)
def test_certs_revoke_refuses_what_it_cannot_revoke_and_writes_nothing(
    pki: Path, args: list[str], reason: str
) -> None:
    before = (pki / "crl.pem").read_bytes()
    done = certs("revoke", str(pki), *[str(pki / a) if a.endswith(".pem") else a for a in args])
    assert done.returncode == 2 and reason in done.stderr and "Traceback" not in done.stderr
    assert (pki / "crl.pem").read_bytes() == before


def test_certs_revoke_with_nothing_named_signs_the_list_again_with_a_later_next_update(pki: Path) -> None:
    from cryptography import x509

    before = x509.load_pem_x509_crl((pki / "crl.pem").read_bytes())
    done = certs("revoke", str(pki), "--days", "90")
    assert done.returncode == 0 and "nothing new" in done.stdout
    after = x509.load_pem_x509_crl((pki / "crl.pem").read_bytes())
    assert [e.serial_number for e in after] == [e.serial_number for e in before] == [1]
    assert after.next_update_utc > before.next_update_utc


def test_config_check_finds_a_crl_that_is_not_the_cas(pki: Path, tmp_path: Path) -> None:
    rogue = rogue_crl(pki, tmp_path)
    config = tmp_path / "kvguard.yaml"
    files = {"tls-ca": pki / "ca.pem", "tls-cert": pki / "daemon.pem", "tls-key": pki / "daemon.key"}
    lines = [f"  {k}: {v}" for k, v in files.items()]
    config.write_text("daemon:\n" + "\n".join([*lines, f"  tls-crl: {rogue / 'crl.pem'}"]) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", "config", "check", "--config", str(config)],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0
    assert (
        f"daemon: tls-crl: {rogue / 'crl.pem'}: issued by CN=someone else's CA" in done.stdout + done.stderr
    )
    config.write_text("daemon:\n" + "\n".join([*lines, f"  tls-crl: {pki / 'crl.pem'}"]) + "\n")
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", "config", "check", "--config", str(config)],
        capture_output=True,
        text=True,
    )
    assert "tls-crl: " + str(pki / "crl.pem") + ": issued by" not in done.stdout + done.stderr
    assert "signature" not in done.stdout + done.stderr
