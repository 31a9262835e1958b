"""A throwaway operator CA and its certificates, for the mutual TLS tests: the daemon's, nodes'
(named by CN and DNS SANs), readers' (the URI SAN of proto/channel.py's READER_URI), operators'
(OPERATOR_URI), and a rogue CA's; `tls_args` and `client` hand them to a command or a channel."""

from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from kvguard.proto.channel import DAEMON_URI, OPERATOR_URI, READER_URI, Tls

READER = x509.UniformResourceIdentifier(READER_URI)
OPERATOR = x509.UniformResourceIdentifier(OPERATOR_URI)
DAEMON = x509.UniformResourceIdentifier(DAEMON_URI)


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def issue(
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


def make_pki(d: Path) -> Path:
    """The CA `ca` and, signed by it: `daemon` (for localhost), nodes `node-p0` (p0, p0-spare)
    and `node-d0`, `replayer` (a node certificate naming p0, d0 and c0, as a forensics
    operator's would), readers `siem` and `reader-p0` (which also names p0), operators
    `operator` (CN alice) and `operator-p0` (CN bob, which also names p0), another daemon's
    `daemon-p0` (its role URI, and p0 among its names); and `rogue-p0`, signed by `rogue-ca`."""
    ca = issue(d, "ca", "kvguard test CA", None)
    loopback = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    issue(d, "daemon", "kvguard-daemon", ca, loopback)
    issue(d, "node-p0", "p0", ca, [x509.DNSName("p0"), x509.DNSName("p0-spare")])
    issue(d, "node-d0", "d0", ca)
    issue(d, "replayer", "forensics", ca, [x509.DNSName(n) for n in ("p0", "d0", "c0")])
    issue(d, "siem", "siem", ca, [READER])
    issue(d, "reader-p0", "p0", ca, [READER, x509.DNSName("p0")])
    issue(d, "operator", "alice", ca, [OPERATOR])
    issue(d, "operator-p0", "bob", ca, [OPERATOR, x509.DNSName("p0")])
    issue(d, "daemon-p0", "kvguard-daemon", ca, [DAEMON, x509.DNSName("p0")])
    rogue_ca = issue(d, "rogue-ca", "someone else's CA", None)
    issue(d, "rogue-p0", "p0", rogue_ca)
    return d


def tls_args(pki: Path, who: str, ca: str = "ca") -> list[str]:
    ca_pem, cert, key = (str(pki / name) for name in (f"{ca}.pem", f"{who}.pem", f"{who}.key"))
    return ["--tls-ca", ca_pem, "--tls-cert", cert, "--tls-key", key]


def client(pki: Path, who: str, ca: str = "ca") -> Tls:
    tls = Tls.load(*(str(pki / name) for name in (f"{ca}.pem", f"{who}.pem", f"{who}.key")))
    assert tls is not None
    return tls
