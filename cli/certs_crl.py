"""`kvguard certs revoke`: the CA's certificate revocation list (DIR/crl.pem), which the daemon
reads with --tls-crl at start and at every reload; and what a CRL says, for `certs show`.

Invariants: a revocation is never lost: the CRL written holds every serial of the one before
it (that one checked against the CA first: a CRL that is not the CA's stops the command) plus
those named, and its number goes up by one. A certificate is revoked only if this CA issued it.
The file is replaced whole (written beside it, then renamed), so a daemon reloading it reads
the old list or the new, never half.
"""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path
from typing import Any

from kvguard.cli.certs import Authority, CertsError

CRL_NAME = "crl.pem"
REASONS = ("unspecified", "key_compromise", "affiliation_changed", "superseded", "cessation_of_operation")


def revoke(directory: Path, pems: list[Path], serials: list[str], reason: str, days: int) -> list[str]:
    """Add the certificates `pems` and the hex `serials` to DIR's CRL (made if there is none);
    what was revoked, one line each."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization

    authority = Authority.load(directory)
    path = directory / CRL_NAME
    entries, number = _existing(path, authority)
    now = datetime.datetime.now(datetime.UTC)
    said = []
    for serial, what in [*_serials_of(pems, authority), *_parsed(serials)]:
        if serial in entries:
            said.append(f"{what}: already revoked {entries[serial].revocation_date_utc:%Y-%m-%d %H:%M} UTC")
            continue
        builder = x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(now)
        if reason != "unspecified":
            builder = builder.add_extension(x509.CRLReason(x509.ReasonFlags[reason]), critical=False)
        entries[serial] = builder.build()
        said.append(f"{what}: revoked ({reason})")
    crl = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(authority.cert.subject)
        .last_update(now - datetime.timedelta(minutes=5))
        .next_update(now + datetime.timedelta(days=days))
        .add_extension(x509.CRLNumber(number + 1), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.cert.public_key()), critical=False
        )
    )
    for entry in entries.values():
        crl = crl.add_revoked_certificate(entry)
    data = crl.sign(authority.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
    spare = path.with_name(f".{path.name}.new")
    spare.write_bytes(data)
    os.chmod(spare, 0o644)  # public: the daemon's user reads it
    os.replace(spare, path)
    return said


def _existing(path: Path, authority: Authority) -> tuple[dict[int, Any], int]:
    """The entries and number of the CRL at `path` (none, 0 if there is none yet)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    from kvguard.proto.crl import Crl, CrlError

    if not path.exists():
        return {}, 0
    ca_pem = authority.cert.public_bytes(serialization.Encoding.PEM)
    try:
        Crl.load(str(path), ca_pem)  # the CA's own, unaltered: else its list is not carried on
    except CrlError as exc:
        raise CertsError(f"{exc}; move it aside to start a new list") from None
    old = x509.load_pem_x509_crl(path.read_bytes())
    try:
        number = old.extensions.get_extension_for_class(x509.CRLNumber).value.crl_number
    except x509.ExtensionNotFound:
        number = 0
    return {entry.serial_number: entry for entry in old}, number


def _serials_of(pems: list[Path], authority: Authority) -> list[tuple[int, str]]:
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature

    found = []
    for pem in pems:
        try:
            cert = x509.load_pem_x509_certificate(pem.read_bytes())
        except FileNotFoundError:
            raise CertsError(f"{pem}: no such file") from None
        except ValueError as exc:
            raise CertsError(f"{pem}: not a PEM certificate ({exc})") from None
        try:
            cert.verify_directly_issued_by(authority.cert)
        except (ValueError, TypeError, InvalidSignature) as exc:
            raise CertsError(f"{pem}: not issued by this CA ({type(exc).__name__})") from None
        if cert.serial_number == authority.cert.serial_number:
            raise CertsError(
                f"{pem}: the CA itself: a CA is retired by a new one (`kvguard certs init`), not revoked"
            )
        found.append((cert.serial_number, f"{pem} (serial {cert.serial_number:x})"))
    return found


def _parsed(serials: list[str]) -> list[tuple[int, str]]:
    found = []
    for text in serials:
        try:
            serial = int(text.replace(":", ""), 16)
        except ValueError:
            raise CertsError(f"--serial {text}: not a hexadecimal serial number") from None
        if serial <= 0:
            raise CertsError(f"--serial {text}: a serial number is positive")
        found.append((serial, f"serial {serial:x}"))
    return found


def describe_crl(data: bytes, path: Path) -> list[tuple[str, str]]:
    """What a CRL says, as (field, value) lines."""
    from cryptography import x509

    try:
        crl = x509.load_pem_x509_crl(data) if b"-----BEGIN" in data else x509.load_der_x509_crl(data)
    except ValueError as exc:
        raise CertsError(f"{path}: not a certificate revocation list ({exc})") from None
    now = datetime.datetime.now(datetime.UTC)
    nxt = crl.next_update_utc
    stale = " (PAST IT: write a new one with `kvguard certs revoke`)" if nxt is not None and now > nxt else ""
    lines = [
        ("kind", "certificate revocation list"),
        ("issuer", crl.issuer.rfc4514_string()),
        ("updated", f"{crl.last_update_utc:%Y-%m-%d %H:%M} UTC"),
        ("next", (f"{nxt:%Y-%m-%d %H:%M} UTC" if nxt is not None else "-") + stale),
        ("revokes", f"{len(list(crl))} certificate(s)"),
    ]
    for entry in crl:
        try:
            why = entry.extensions.get_extension_for_class(x509.CRLReason).value.reason.name
        except x509.ExtensionNotFound:
            why = "unspecified"
        lines.append(
            (
                "serial",
                f"{entry.serial_number:x} since {entry.revocation_date_utc:%Y-%m-%d %H:%M} UTC ({why})",
            )
        )
    return lines


def cmd_revoke(args: argparse.Namespace) -> int:
    """Exit 0 with what was revoked, 2 on a file, serial or CA unusable."""
    import sys

    directory = Path(args.dir)
    try:
        said = revoke(directory, [Path(p) for p in args.pem], args.serial or [], args.reason, args.days)
    except CertsError as exc:
        print(f"kvguard certs: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kvguard certs: {exc.filename or args.dir}: {exc.strerror}", file=sys.stderr)
        return 2
    for line in said or ["nothing new: the list is signed again, with a new next update"]:
        print(line)
    print(
        f"\nwritten: {directory / CRL_NAME}; a daemon run with --tls-crl {directory / CRL_NAME} takes it "
        "at its next reload (by itself within --reload-interval, or `systemctl reload kvguard-daemon`)"
    )
    return 0


def add_revoke(verbs: Any, add_command: Any) -> None:
    """Add `certs revoke` to the `certs` verbs."""
    p = add_command(
        verbs,
        "revoke",
        "revoke certificates: DIR/crl.pem, which the daemon reads (--tls-crl)",
        "Add certificates to DIR's certificate revocation list (crl.pem, signed by DIR's CA). A daemon run "
        "with --tls-crl refuses them every call from its next reload on, and cuts their open streams. "
        "Certificates come right after DIR, options after them.",
        "kvguard certs revoke /etc/kvguard/pki /etc/kvguard/pki/node-p3.pem --reason key_compromise",
    )
    p.add_argument("dir", help="the directory of the CA (and of crl.pem)")
    p.add_argument(
        "pem",
        nargs="*",
        help="a certificate to revoke (PEM); none: sign the list again (before its next update)",
    )
    p.add_argument(
        "--serial",
        action="append",
        metavar="HEX",
        help="revoke by serial number, for a certificate not at hand",
    )
    p.add_argument("--reason", choices=REASONS, default="unspecified", help="the reason the CRL gives")
    p.add_argument(
        "--days",
        type=int,
        default=30,
        help="until the list's next update: write it again before then (default 30)",
    )
    p.set_defaults(func=cmd_revoke)
