"""`kvguard certs`: a private CA and the certificates of a test or small cluster, made in one
command, each with what its holder may do under mutual TLS (proto/channel.py's roles):

  init DIR    a new CA (ca.pem, ca.key), the daemon's certificate for the names and addresses
              it is reached by, and any nodes', readers' and operators' certificates named;
  issue DIR   one more node, reader or operator certificate from DIR's CA;
  revoke DIR  certificates no longer valid: DIR/crl.pem, read by the daemon (cli/certs_crl.py);
  show PEM    what a certificate (or a CRL) says: its subject, names, role, issuer and validity.

A node's certificate names the node (CN and DNS SAN: the daemon takes a node's events only
from a certificate that names it); a reader's carries the URI SAN READER_URI, an operator's
OPERATOR_URI. Keys are ECDSA P-256, written 0600 and never over an existing file.

Invariant: nothing is written unless every name is valid and no file would be overwritten;
the CA's key stays in DIR, which should then go offline for anything beyond a test cluster.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvguard.cli.options import Subcommands, add_command, add_group, add_output_argument

NAME = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62})$")  # a node's, reader's or operator's name
KINDS = ("node", "reader", "operator")


class CertsError(ValueError):
    """A name, a directory or a file that cannot be used; the message says which and why."""


@dataclass(frozen=True)
class Wanted:
    kind: str  # daemon, node, reader, operator
    name: str
    hosts: tuple[str, ...] = ()  # the daemon's DNS names and IP addresses
    also: tuple[str, ...] = ()  # a node certificate's other nodes (one host's engines: --node a,b)

    @property
    def stem(self) -> str:
        if self.kind == "daemon":
            return "daemon"
        return f"{self.kind}-{'+'.join((self.name, *self.also))}"


def _checked_name(kind: str, name: str) -> str:
    if not NAME.match(name):
        raise CertsError(
            f"{kind} name {name!r}: use 1-63 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def _checked_host(host: str) -> str:
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if not host or not all(re.match(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?$", x) for x in labels):
        raise CertsError(f"daemon host {host!r}: not a DNS name or an IP address")
    return host


def _plan(directory: Path, wanted: list[Wanted], with_ca: bool, renew: bool = False) -> None:
    """Refuse before writing anything: a file that exists (unless `renew`: a rotation replaces
    it), a name given twice."""
    stems = ["ca"] if with_ca else []
    stems += [w.stem for w in wanted]
    twice = sorted({s for s in stems if stems.count(s) > 1})
    if twice:
        raise CertsError(f"named twice: {', '.join(twice)}")
    existing = [str(directory / f"{s}{ext}") for s in stems for ext in (".pem", ".key")]
    existing = [p for p in existing if os.path.exists(p)]
    if existing and not renew:
        raise CertsError(f"would overwrite {', '.join(existing)}: choose another directory or remove them")


def _write(path: Path, data: bytes, private: bool) -> None:
    """`data` as `path`, made whole beside it and renamed over it: a reader (a service at its
    restart) finds the old file or the new one, never a key without its certificate's bytes."""
    spare = path.with_name(f".{path.name}.new")
    with contextlib.suppress(FileNotFoundError):
        spare.unlink()
    fd = os.open(spare, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o644)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.replace(spare, path)


def _owner(owner: str) -> tuple[int, int]:
    """(uid, gid) of `owner` (USER or USER:GROUP); CertsError when the host has no such one."""
    import grp
    import pwd

    user, _, group = owner.partition(":")
    try:
        uid = pwd.getpwnam(user).pw_uid
        gid = grp.getgrnam(group).gr_gid if group else pwd.getpwnam(user).pw_gid
    except KeyError:
        raise CertsError(f"--owner {owner}: no such user or group on this host") from None
    return uid, gid


class Authority:
    """A CA's certificate and key, and the certificates it signs."""

    def __init__(self, cert: Any, key: Any) -> None:
        self.cert, self.key = cert, key

    @classmethod
    def create(cls, directory: Path, cn: str, days: int) -> Authority:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        authority = cls(cert, key)
        authority._save(directory / "ca", cert, key)
        return authority

    @classmethod
    def load(cls, directory: Path) -> Authority:
        from cryptography import x509
        from cryptography.hazmat.primitives import serialization

        pem, key = directory / "ca.pem", directory / "ca.key"
        for path in (pem, key):
            if not path.exists():
                raise CertsError(f"{path}: no such file (make the CA with `kvguard certs init {directory}`)")
        try:
            cert = x509.load_pem_x509_certificate(pem.read_bytes())
            private = serialization.load_pem_private_key(key.read_bytes(), None)
        except (ValueError, TypeError) as exc:
            raise CertsError(f"{directory}: the CA's files cannot be read: {exc}") from None
        return cls(cert, private)

    def issue(self, directory: Path, wanted: Wanted, days: int) -> Path:
        """Sign `wanted`'s certificate; write <stem>.pem and <stem>.key; return the .pem."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        from kvguard.proto.channel import DAEMON_URI, OPERATOR_URI, READER_URI

        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        sans: list[x509.GeneralName] = []
        if wanted.kind == "daemon":
            # A server to its clients, and a client of the bus (its identity there, `bus config
            # --tls-ca`); its role URI keeps it from speaking for any node to a daemon.
            cn, usage = "kvguard-daemon", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            for host in wanted.hosts:
                try:
                    sans.append(x509.IPAddress(ipaddress.ip_address(host)))
                except ValueError:
                    sans.append(x509.DNSName(host))
            sans.append(x509.UniformResourceIdentifier(DAEMON_URI))
        else:
            cn, usage = wanted.name, [ExtendedKeyUsageOID.CLIENT_AUTH]
            if wanted.kind == "node":
                sans += [x509.DNSName(name) for name in (wanted.name, *wanted.also)]
            else:
                sans.append(
                    x509.UniformResourceIdentifier(READER_URI if wanted.kind == "reader" else OPERATOR_URI)
                )
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(min(now + datetime.timedelta(days=days), self.cert.not_valid_after_utc))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.cert.public_key()), critical=False
            )
            .sign(self.key, hashes.SHA256())
        )
        stem = directory / wanted.stem
        self._save(stem, cert, key)
        return stem.with_suffix(".pem")

    @staticmethod
    def _save(stem: Path, cert: Any, key: Any) -> None:
        from cryptography.hazmat.primitives import serialization

        _write(
            stem.with_suffix(".key"),
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            ),
            private=True,
        )
        _write(stem.with_suffix(".pem"), cert.public_bytes(serialization.Encoding.PEM), private=False)


def _wanted(args: argparse.Namespace) -> list[Wanted]:
    """What the --node, --reader and --operator options ask for; `--node a,b` is one
    certificate that speaks for nodes a and b (the engines of one host behind one agent)."""
    wanted = []
    for kind in KINDS:
        for given in getattr(args, kind) or []:
            names = [_checked_name(kind, n) for n in given.split(",")] if kind == "node" else [given]
            if len(set(names)) != len(names):
                raise CertsError(f"--node {given}: names a node twice")
            wanted.append(Wanted(kind, _checked_name(kind, names[0]), also=tuple(names[1:])))
    return wanted


def _expiry(start: datetime.datetime, end: datetime.datetime, now: datetime.datetime | None = None) -> str:
    """When the certificate stops working, from now: in N days, EXPIRED N days ago, or NOT YET
    VALID."""
    now = now or datetime.datetime.now(datetime.UTC)
    if now < start:
        return f"NOT YET VALID (from {start:%Y-%m-%d %H:%M} UTC)"
    days = (end - now).total_seconds() / 86400
    if days < 0:
        return f"EXPIRED {-days:.0f} day(s) ago"
    return f"in {days:.0f} day(s)" + (": renew it soon" if days < 30 else "")


def describe(pem: Path) -> list[tuple[str, str]]:
    """What a certificate says, as (field, value) lines."""
    from cryptography import x509

    from kvguard.proto.channel import DAEMON_URI, OPERATOR_URI, READER_URI

    try:
        data = pem.read_bytes()
    except FileNotFoundError:
        raise CertsError(f"{pem}: no such file") from None
    if b"-----BEGIN X509 CRL" in data:
        from kvguard.cli.certs_crl import describe_crl

        return describe_crl(data, pem)
    try:
        cert = x509.load_pem_x509_certificate(data)
    except ValueError as exc:
        raise CertsError(f"{pem}: not a PEM certificate ({exc})") from None
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        names = x509.SubjectAlternativeName([])
    uris = names.get_values_for_type(x509.UniformResourceIdentifier)
    try:
        is_ca = cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:  # openssl's plain `req -x509`/`x509 -req` may leave it out: not a CA
        is_ca = False
    role = (
        "CA"
        if is_ca
        else "operator"
        if OPERATOR_URI in uris
        else "reader"
        if READER_URI in uris
        else "daemon"
        if DAEMON_URI in uris
        else "node or daemon"  # a daemon's made before it carried DAEMON_URI
    )
    dns = names.get_values_for_type(x509.DNSName)
    ips = [str(ip) for ip in names.get_values_for_type(x509.IPAddress)]
    return [
        ("subject", cert.subject.rfc4514_string()),
        ("role", role),
        ("names", ", ".join([*dns, *ips, *uris]) or "-"),
        ("issuer", cert.issuer.rfc4514_string()),
        (
            "valid",
            f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} to {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC",
        ),
        ("expires", _expiry(cert.not_valid_before_utc, cert.not_valid_after_utc)),
        ("serial", f"{cert.serial_number:x}"),
    ]


RECEIPT_PUB = "receipt.pub"  # beside it receipt.key: the daemon's receipt-signing key (Ed25519)


def _receipt_key(directory: Path) -> Path:
    """The daemon's receipt key in `directory` (made if it is not there): its public half."""
    from kvguard.proto.receipt import new_key

    public = directory / RECEIPT_PUB
    if not public.with_suffix(".key").exists():
        new_key(public.with_suffix(".key"), public)
    return public


def cmd_certs(args: argparse.Namespace) -> int:
    """Exit 0 with the files made (or the certificate shown), 2 on a name, file or CA unusable."""
    try:
        if args.certs_command == "show":
            shown = describe(Path(args.pem))
            if args.output == "json":  # a CRL's serials are a list; every other field is one value
                import json

                fields: dict[str, Any] = {k: v for k, v in shown if k != "serial" or "since" not in v}
                if any(k == "serial" and "since" in v for k, v in shown):
                    fields["revoked"] = [v for k, v in shown if k == "serial"]
                print(json.dumps(fields, indent=2))
                return 0
            for field, value in shown:
                print(f"{field:8} {value}")
            return 0
        directory = Path(args.dir)
        wanted = _wanted(args)
        owner = _owner(args.owner) if args.owner else None  # before anything is written
        if args.certs_command == "init":
            hosts = tuple(_checked_host(h) for h in (args.daemon_host or ["localhost", "127.0.0.1"]))
            wanted.insert(0, Wanted("daemon", "daemon", hosts))
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)  # the CA key lives here
            _plan(directory, wanted, with_ca=True)
            authority = Authority.create(directory, args.ca_name, args.ca_days)
            made = [directory / "ca.pem"]
        else:
            if args.daemon_host:  # the daemon's own, again (a rotation, or new names)
                hosts = tuple(_checked_host(h) for h in args.daemon_host)
                wanted.insert(0, Wanted("daemon", "daemon", hosts))
            if not wanted and not getattr(args, "receipt_key", False):
                raise CertsError(
                    "name at least one --node, --reader, --operator or --daemon-host, or --receipt-key"
                )
            authority = Authority.load(directory)
            _plan(directory, wanted, with_ca=False, renew=args.renew)
            made = []
        made += [authority.issue(directory, w, args.days) for w in wanted]
        if args.certs_command == "init" or getattr(args, "receipt_key", False):
            made.append(_receipt_key(directory))
        if owner is not None:  # the service's user reads its certificate and key (the CA's key stays root's)
            for pem in [pem for pem in made if pem.name != "ca.pem"]:
                os.chown(pem, *owner)
                os.chown(pem.with_suffix(".key"), *owner)
    except CertsError as exc:
        print(f"kvguard certs: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvguard certs: {exc.filename or args.dir}: {exc.strerror}", file=sys.stderr)
        return 2
    for pem in made:
        if pem.name == RECEIPT_PUB:
            print(
                f"{pem} (the receipt key's public half; the daemon's --receipt-key {pem.with_suffix('.key')})"
            )
            continue
        print(
            f"{pem} ({pem.with_suffix('.key').name} beside it)" if pem.name != "ca.pem" else f"{pem} (the CA)"
        )
    ca = directory / "ca.pem"
    print(f"\nuse: --tls-ca {ca} --tls-cert {directory}/STEM.pem --tls-key {directory}/STEM.key")
    return 0


def add_parser(sub: Subcommands) -> None:
    """Add `certs init|issue|show` to the `kvguard` subcommands."""
    verbs = add_group(
        sub,
        "certs",
        "make a private CA and the cluster's mutual-TLS certificates",
        "Make a private CA and the daemon's, nodes', readers' and operators' certificates "
        "(for a test or small cluster).",
        "kvguard certs init /etc/kvguard/pki --daemon-host kvg.example --node p0 --operator alice",
    )

    def named(q: argparse.ArgumentParser) -> None:
        q.add_argument("dir", help="the directory of the CA and its certificates")
        q.add_argument(
            "--node",
            action="append",
            metavar="NAME[,NAME...]",
            help="a node's certificate (repeatable); a,b: one certificate for nodes a and b (one host)",
        )
        q.add_argument("--reader", action="append", metavar="NAME", help="a reader's: audit, alerts, fleet")
        q.add_argument(
            "--operator", action="append", metavar="NAME", help="an operator's: also act (kill ...)"
        )
        q.add_argument("--days", type=int, default=397, help="each certificate's validity (default 397)")
        q.add_argument(
            "--owner",
            metavar="USER[:GROUP]",
            help="give the certificates and keys it makes (not the CA's) to this user, as root: "
            "the services' units run as kvguard",
        )
        q.set_defaults(func=cmd_certs)

    init = add_command(
        verbs,
        "init",
        "a new CA, the daemon's certificate and any named",
        "Make a new CA in DIR, the daemon's certificate for the names it is reached by, its receipt "
        "key (receipt.key, receipt.pub), and any certificate named.",
        "kvguard certs init pki --daemon-host 10.0.0.5 --node p0 --node d0 --reader siem --operator alice",
    )
    named(init)
    init.add_argument(
        "--daemon-host",
        action="append",
        metavar="HOST",
        help="a DNS name or IP address clients reach the daemon by "
        "(repeatable; default localhost, 127.0.0.1)",
    )
    init.add_argument("--ca-name", default="kvguard CA", help="the CA's common name")
    init.add_argument("--ca-days", type=int, default=3650, help="the CA's validity (default 3650)")
    issue = add_command(
        verbs,
        "issue",
        "more certificates from DIR's CA, or new ones in place of those that expire",
        "Sign more node, reader or operator certificates, or the daemon's again, with the CA made by "
        "`certs init DIR`; --renew replaces those that exist (the services take them at restart).",
        "kvguard certs issue pki --node d1 --node gpu-3,gpu-4 --renew",
    )
    named(issue)
    issue.add_argument(
        "--daemon-host",
        action="append",
        metavar="HOST",
        help="issue the daemon's certificate again, for these names (repeatable)",
    )
    issue.add_argument(
        "--receipt-key",
        action="store_true",
        help="make the daemon's receipt-signing key (receipt.key, receipt.pub) if DIR has none",
    )
    issue.add_argument(
        "--renew",
        action="store_true",
        help="replace certificates that exist (a rotation) instead of refusing",
    )
    show = add_command(
        verbs,
        "show",
        "what a certificate or a CRL says",
        "Show a certificate's subject, names, role, issuer and validity, or the serials a CRL revokes.",
        "kvguard certs show pki/operator-alice.pem",
    )
    show.add_argument("pem", help="a certificate or a certificate revocation list (PEM)")
    add_output_argument(show, help="output format (json: one object of the fields shown)")
    show.set_defaults(func=cmd_certs)
    from kvguard.cli.certs_crl import add_revoke

    add_revoke(verbs, add_command)
