"""Certificate revocation: the CRL (`kvguard certs revoke` writes it) that says which of the
CA's certificates no longer open anything, read by the daemon at start and at each reload.

Invariants: a CRL is used only if the CA it is checked against signed it (a CRL from another
CA, or altered, is a CrlError naming the file and the reason, and changes nothing); a
certificate is revoked when its serial is in it and its issuer is the CRL's. A CRL past its
next update is still used (the serials it names stay revoked) and said to be stale, as a
revocation list too old to trust as complete, never as a reason to open the door to all.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE = 4096  # client certificates whose serial is kept, parsed once


class CrlError(ValueError):
    """A CRL that cannot be used: unreadable, not a CRL, or not signed by the CA."""


@dataclass(frozen=True)
class Revoked:
    serial: int
    when: datetime.datetime
    reason: str  # the CRL entry's reason code ("key_compromise"), or "" when it gives none


@dataclass(frozen=True)
class Crl:
    """The serials one CA's CRL revokes."""

    path: str
    issuer: str
    revoked: dict[int, Revoked]
    this_update: datetime.datetime
    next_update: datetime.datetime | None

    @staticmethod
    def load(path: str, ca_pem: bytes) -> Crl:
        """The CRL at `path` (PEM or DER), checked against the CA `ca_pem`."""
        from cryptography import x509

        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise CrlError(f"CRL {path}: {exc.strerror}") from None
        try:
            crl = x509.load_pem_x509_crl(data) if b"-----BEGIN" in data else x509.load_der_x509_crl(data)
        except ValueError as exc:
            raise CrlError(f"CRL {path}: not a certificate revocation list ({exc})") from None
        try:
            ca = x509.load_pem_x509_certificate(ca_pem)
        except ValueError as exc:
            raise CrlError(f"CRL {path}: the CA it is checked against cannot be read ({exc})") from None
        if crl.issuer != ca.subject:
            raise CrlError(
                f"CRL {path}: issued by {crl.issuer.rfc4514_string()}, not by the CA "
                f"({ca.subject.rfc4514_string()})"
            )
        try:
            signed = crl.is_signature_valid(ca.public_key())  # type: ignore[arg-type]
        except TypeError:
            signed = False
        if not signed:
            raise CrlError(f"CRL {path}: its signature is not the CA's (altered, or another CA's key)")
        revoked = {entry.serial_number: _entry(entry) for entry in crl}
        return Crl(
            path,
            crl.issuer.rfc4514_string(),
            revoked,
            crl.last_update_utc,
            crl.next_update_utc,
        )

    def stale(self, now: datetime.datetime | None = None) -> bool:
        now = now or datetime.datetime.now(datetime.UTC)
        return self.next_update is not None and now > self.next_update

    def why_revoked(self, cert_pem: bytes) -> str | None:
        """None unless the certificate is revoked by this CRL; then why, in one line."""
        serial, issuer, cn = _identity(cert_pem)
        entry = self.revoked.get(serial)
        if entry is None or issuer != self.issuer:
            return None
        because = f" ({entry.reason})" if entry.reason else ""
        return (
            f"certificate {cn or 'without a common name'} (serial {serial:x}) was revoked "
            f"{entry.when:%Y-%m-%d %H:%M} UTC{because} by {self.path}"
        )


def _entry(entry: Any) -> Revoked:
    from cryptography import x509

    try:
        reason = entry.extensions.get_extension_for_class(x509.CRLReason).value.reason.name
    except x509.ExtensionNotFound:
        reason = ""
    return Revoked(entry.serial_number, entry.revocation_date_utc, reason)


_identities: dict[bytes, tuple[int, str, str]] = {}


def _identity(cert_pem: bytes) -> tuple[int, str, str]:
    """A certificate's (serial, issuer, common name), parsed once per certificate seen."""
    known = _identities.get(cert_pem)
    if known is None:
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        cert = x509.load_pem_x509_certificate(cert_pem)
        names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
        cn = str(names[0].value) if names else ""
        if len(_identities) >= CACHE:
            _identities.clear()
        known = _identities[cert_pem] = (cert.serial_number, cert.issuer.rfc4514_string(), cn)
    return known
