"""`kvguard certs`: the CA and certificates it makes work as the roles they say, on a real
daemon under mutual TLS (a node streams as itself only, a reader reads and may not act, an
operator acts under its name); its keys are private; it never overwrites; a bad name or a
missing CA is said, exit 2, nothing written."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import pytest
from daemon_helpers import stale_reads

from kvguard.agents.upstream import AgentStream, DaemonRefused
from kvguard.cli.process import start_daemon
from kvguard.proto.channel import Tls, channel
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc


def certs(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvguard", "certs", *args], capture_output=True, text=True, timeout=60
    )


def tls(pki: Path, stem: str) -> Tls:
    loaded = Tls.load(str(pki / "ca.pem"), str(pki / f"{stem}.pem"), str(pki / f"{stem}.key"))
    assert loaded is not None
    return loaded


def test_the_certificates_it_makes_hold_the_roles_they_say(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    made = certs("init", str(pki), "--node", "p0", "--reader", "siem", "--operator", "alice")
    assert made.returncode == 0, made.stderr
    stems = ["ca", "daemon", "node-p0", "reader-siem", "operator-alice"]
    assert [line.split()[0] for line in made.stdout.splitlines()[:5]] == [
        str(pki / f"{s}.pem") for s in stems
    ]
    made_files = sorted(p.name for p in pki.iterdir())
    assert made_files == sorted(
        [f"{s}{e}" for s in stems for e in (".pem", ".key")] + ["receipt.key", "receipt.pub"]
    )
    assert made.stdout.splitlines()[5].startswith(f"{pki / 'receipt.pub'} (the receipt key's public half")
    assert {oct(p.stat().st_mode & 0o777) for p in pki.glob("*.key")} == {"0o600"}  # the receipt key's too
    assert oct(pki.stat().st_mode & 0o777) == "0o700"
    shown = certs("show", str(pki / "operator-alice.pem"))
    assert "role     operator" in shown.stdout and "subject  CN=alice" in shown.stdout
    assert "issuer   CN=kvguard CA" in shown.stdout

    daemon = start_daemon(
        str(tmp_path / "audit.db"),
        0,
        *("--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "daemon.pem")),
        *("--tls-key", str(pki / "daemon.key")),
    )
    try:
        # The node's certificate streams p0's events (the daemon judges them: an alert) ...
        node = AgentStream(channel(daemon.address, tls(pki, "node-p0")), "p0")
        ack = node.send(stale_reads("p0", 1))
        node.close()
        assert ack.accepted > 0 and not ack.rejected
        # ... and not d0's: a node's certificate speaks for the node it names.
        # the hello is refused
        with pytest.raises(
            DaemonRefused, match=r"node 'd0' is not named by the client's certificate \(it names p0\)"
        ):
            AgentStream(channel(daemon.address, tls(pki, "node-p0")), "d0")
        # The reader sees the fleet, and may not act.
        with channel(daemon.address, tls(pki, "reader-siem")) as ch:
            state = svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10)
            assert [n.node for n in state.nodes] == ["p0"] and sum(state.findings.values()) > 0
            with pytest.raises(grpc.RpcError) as denied:
                svc_grpc.ControlServiceStub(ch).Act(
                    svc.Action(rule_mode=svc.RuleMode(rule="stale_read_cross_tenant", mode="monitor")),
                    timeout=10,
                )
            assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # The operator acts, under its certificate's name.
        with channel(daemon.address, tls(pki, "operator-alice")) as ch:
            done = svc_grpc.ControlServiceStub(ch).Act(
                svc.Action(rule_mode=svc.RuleMode(rule="stale_read_cross_tenant", mode="monitor")), timeout=10
            )
        assert done.action.by == "cn:alice"
        # One more node later, from the same CA: it streams as d1.
        assert certs("issue", str(pki), "--node", "d1").returncode == 0
        late = AgentStream(channel(daemon.address, tls(pki, "node-d1")), "d1")
        assert late.send(stale_reads("d1", 1)).accepted > 0
        late.close()
    finally:
        daemon.stop()


def test_it_overwrites_nothing_and_says_what_it_refuses(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    assert certs("init", str(pki)).returncode == 0
    before = {p.name: p.read_bytes() for p in pki.iterdir()}
    again = certs("init", str(pki), "--node", "p0")
    assert again.returncode == 2 and "would overwrite" in again.stderr and str(pki / "ca.pem") in again.stderr
    bad = certs("issue", str(pki), "--node", "p0", "--operator", "bad name")
    assert bad.returncode == 2
    assert bad.stderr == (
        "kvguard certs: operator name 'bad name': use 1-63 letters, digits, '.', '_' or '-', "
        "starting with a letter or digit\n"
    )
    twice = certs("issue", str(pki), "--node", "p0", "--node", "p0")
    assert twice.returncode == 2 and "named twice: node-p0" in twice.stderr
    host = certs("init", str(tmp_path / "other"), "--daemon-host", "bad_host!")
    assert host.returncode == 2 and "daemon host 'bad_host!': not a DNS name or an IP address" in host.stderr
    assert {p.name: p.read_bytes() for p in pki.iterdir()} == before  # nothing written
    assert not (tmp_path / "other").exists() or not any((tmp_path / "other").iterdir())
    missing = certs("issue", str(tmp_path / "nowhere"), "--node", "p0")
    assert missing.returncode == 2 and "ca.pem: no such file" in missing.stderr
    assert certs("show", str(pki / "ca.key")).stderr.startswith(f"kvguard certs: {pki / 'ca.key'}: not a PEM")


def test_show_reads_a_certificate_made_with_the_docs_openssl_recipe(tmp_path: Path) -> None:
    # docs/operator.md's reader certificate, made with OpenSSL against kvguard's CA: no
    # BasicConstraints extension (a plain `x509 -req`), so not a CA. It is shown, with its expiry.
    pki = tmp_path / "pki"
    assert certs("init", str(pki)).returncode == 0

    def run(line: str) -> None:
        subprocess.run(line.split(), cwd=pki, capture_output=True, text=True, timeout=60, check=True)

    key = "-newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout siem.key"
    run(f"openssl req -new {key} -subj /CN=siem -out siem.csr")
    (pki / "ext").write_text("subjectAltName=URI:urn:kvguard:role:reader\n")
    run("openssl x509 -req -in siem.csr -CA ca.pem -CAkey ca.key -days 365 -out siem.pem -extfile ext")
    shown = certs("show", str(pki / "siem.pem"))
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr
    assert "role     reader" in shown.stdout and "subject  CN=siem" in shown.stdout
    assert re.search(r"expires  in 36[45] day\(s\)\n", shown.stdout), shown.stdout
    daemon_cert = certs("show", str(pki / "daemon.pem")).stdout
    assert re.search(r"expires  in \d+ day\(s\)", daemon_cert) and "role     daemon" in daemon_cert


@pytest.mark.skipif(
    os.geteuid() != 0, reason="chown needs root"
)  # CI and this project's machines run as root
def test_init_as_root_gives_the_services_user_its_keys_and_not_the_cas(tmp_path: Path) -> None:
    # Keys written 0600 by root are unreadable to the user the units run as: --owner gives
    # that user the certificates and keys made (never the CA's key), and config check agrees.
    import pwd

    from kvguard.cli.config_usable import _readable_by

    nobody = pwd.getpwnam("nobody")
    base = Path(
        tempfile.mkdtemp(prefix="kvguard-certs-")
    )  # a directory every user may pass (pytest's is root's)
    base.chmod(0o755)
    pki = base / "pki"
    made = certs("init", str(pki), "--node", "p0", "--owner", "nobody")
    assert made.returncode == 0, made.stderr
    pki.chmod(0o755)
    for stem in ("daemon", "node-p0"):
        for suffix in (".pem", ".key"):
            assert (pki / f"{stem}{suffix}").stat().st_uid == nobody.pw_uid
        assert _readable_by(pki / f"{stem}.key", nobody)
    assert (pki / "ca.key").stat().st_uid == 0 and not _readable_by(pki / "ca.key", nobody)
    refused = certs("init", str(tmp_path / "other"), "--owner", "no-such-user")
    assert refused.returncode == 2 and "--owner no-such-user: no such user or group" in refused.stderr
    assert not (tmp_path / "other" / "ca.pem").exists()  # refused before anything was written
    shutil.rmtree(base)


def test_one_certificate_for_the_nodes_of_a_host_and_a_renewal_in_place(tmp_path: Path) -> None:
    from cryptography import x509

    pki = tmp_path / "pki"
    assert certs("init", str(pki), "--node", "gpu-3,gpu-4").returncode == 0
    host = x509.load_pem_x509_certificate((pki / "node-gpu-3+gpu-4.pem").read_bytes())
    names = host.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["gpu-3", "gpu-4"]
    twice = certs("issue", str(pki), "--node", "gpu-5,gpu-5")
    assert twice.returncode == 2 and "--node gpu-5,gpu-5: names a node twice" in twice.stderr
    # A rotation: without --renew nothing is replaced; with it, the daemon's and the host's
    # certificates are new (new serials), from the same CA.
    before = {
        stem: x509.load_pem_x509_certificate((pki / f"{stem}.pem").read_bytes())
        for stem in ("daemon", "node-gpu-3+gpu-4")
    }
    refused = certs("issue", str(pki), "--daemon-host", "localhost", "--daemon-host", "127.0.0.1")
    assert refused.returncode == 2 and "would overwrite" in refused.stderr
    renewed = certs(
        "issue",
        str(pki),
        "--daemon-host",
        "localhost",
        "--daemon-host",
        "127.0.0.1",
        "--node",
        "gpu-3,gpu-4",
        "--renew",
    )
    assert renewed.returncode == 0, renewed.stderr
    for stem, old in before.items():
        new = x509.load_pem_x509_certificate((pki / f"{stem}.pem").read_bytes())
        assert new.serial_number != old.serial_number and new.issuer == old.issuer
    assert not list(pki.glob(".*.new"))  # replaced whole, nothing left beside
    daemon = start_daemon(
        str(tmp_path / "audit.db"),
        0,
        *("--tls-ca", str(pki / "ca.pem"), "--tls-cert", str(pki / "daemon.pem")),
        *("--tls-key", str(pki / "daemon.key")),
    )
    try:
        # The host's certificate speaks for both of its nodes, and for no other.
        for node in ("gpu-3", "gpu-4"):
            stream = AgentStream(channel(daemon.address, tls(pki, "node-gpu-3+gpu-4")), node)
            assert stream.send(stale_reads(node, 1)).accepted > 0
            stream.close()
        with pytest.raises(DaemonRefused, match="it names gpu-3, gpu-4"):
            AgentStream(channel(daemon.address, tls(pki, "node-gpu-3+gpu-4")), "gpu-5")
    finally:
        daemon.stop()
