"""Integrity receipts on the wire and on paper: the receipt key (Ed25519, `cryptography`), a
receipt's signature, its file form, and the offline check (`verify`) that needs no daemon and
no store.

A receipt file is JSON: {"receipt": base64 of the Receipt's bytes, "signature": base64,
"key_id": hex, "shown": the receipt as JSON, for people}. Only the signed bytes count: `shown`
is never trusted, and a file that is not byte for byte what `to_file` makes of them is refused.

Invariants: a receipt verifies only under the public key whose id it names, with its bytes
exactly as signed; a private key anyone but its owner may read is refused; what `verify`
says a receipt proves is never more than the daemon recorded (docs/receipts.md).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError

from kvguard.proto.kvguard.v1 import services_pb2 as svc

MAX_FILE = 1 << 20  # bytes of a receipt file read


class ReceiptError(ValueError):
    """A key or a receipt file that cannot be used, and why, by name."""


def _crypto() -> Any:
    from cryptography.hazmat.primitives.asymmetric import ed25519

    return ed25519


def new_key(private: Path, public: Path) -> None:
    """A new Ed25519 receipt key: its private half to `private` (owner only, never over an
    existing file), its public half to `public`."""
    from cryptography.hazmat.primitives import serialization

    key = _crypto().Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public.write_bytes(public_pem(key.public_key()))


def public_pem(public: Any) -> bytes:
    from cryptography.hazmat.primitives import serialization

    pem: bytes = public.public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return pem


def key_id(public: Any) -> str:
    """A public key's id: hex of the first 8 bytes of SHA-256 of its 32 raw bytes."""
    from cryptography.hazmat.primitives import serialization

    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def load_private(path: str | Path) -> Any:
    """The receipt key in `path` (PEM, Ed25519), refused if others may read or write it."""
    from cryptography.hazmat.primitives import serialization

    try:
        st = os.stat(path)
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ReceiptError(f"receipt key {path}: {exc.strerror}") from None
    if st.st_mode & 0o077:
        raise ReceiptError(
            f"receipt key {path}: others may read or write it (mode {st.st_mode & 0o777:o}); chmod 600 it"
        )
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ReceiptError(f"receipt key {path}: not a PEM private key ({exc})") from None
    if not isinstance(key, _crypto().Ed25519PrivateKey):
        raise ReceiptError(f"receipt key {path}: not an Ed25519 key")
    return key


def load_public(path: str | Path) -> Any:
    """The public receipt key in `path` (PEM, as `kvguard audit receipt-key` prints it)."""
    from cryptography.hazmat.primitives import serialization

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ReceiptError(f"public key {path}: {exc.strerror}") from None
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise ReceiptError(f"public key {path}: not a PEM public key ({exc})") from None
    if not isinstance(key, _crypto().Ed25519PublicKey):
        raise ReceiptError(f"public key {path}: not an Ed25519 key")
    return key


def sign(receipt: svc.Receipt, key: Any) -> svc.SignedReceipt:
    body = receipt.SerializeToString(deterministic=True)
    return svc.SignedReceipt(receipt=body, signature=key.sign(body), key_id=key_id(key.public_key()))


def shown(receipt: svc.Receipt) -> dict[str, Any]:
    return MessageToDict(receipt, preserving_proto_field_name=True)


def to_file(signed: svc.SignedReceipt) -> bytes:
    """A signed receipt as its file (JSON)."""
    doc = {
        "receipt": base64.b64encode(signed.receipt).decode(),
        "signature": base64.b64encode(signed.signature).decode(),
        "key_id": signed.key_id,
        "shown": shown(svc.Receipt.FromString(signed.receipt)),
    }
    return orjson.dumps(doc, option=orjson.OPT_INDENT_2) + b"\n"


def from_file(path: str | Path) -> svc.SignedReceipt:
    """The signed receipt in a file `to_file` wrote; ReceiptError naming what is wrong."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE + 1)
    except OSError as exc:
        raise ReceiptError(f"receipt {path}: {exc.strerror}") from None
    if len(data) > MAX_FILE:
        raise ReceiptError(f"receipt {path}: larger than {MAX_FILE} bytes: not a receipt")
    try:
        doc = orjson.loads(data)
        signed = svc.SignedReceipt(
            receipt=base64.b64decode(doc["receipt"], validate=True),
            signature=base64.b64decode(doc["signature"], validate=True),
            key_id=str(doc["key_id"]),
        )
        svc.Receipt.FromString(signed.receipt)  # a receipt, or not one
    except (orjson.JSONDecodeError, KeyError, TypeError, binascii.Error, DecodeError) as exc:
        raise ReceiptError(f"receipt {path}: not a receipt file ({type(exc).__name__}: {exc})") from None
    if data != to_file(signed):  # the file is as issued, byte for byte, or it is not the receipt
        raise ReceiptError(f"receipt {path}: not as it was issued (its bytes or what it shows altered)")
    return signed


@dataclass
class Verdict:
    """The offline check of one receipt: whether it holds, why not, and what it proves."""

    ok: bool
    reason: str
    receipt: svc.Receipt | None = None
    proves: list[str] = field(default_factory=list)
    does_not: list[str] = field(default_factory=list)


def verify(signed: svc.SignedReceipt, public: Any, tenant: str = "", req: str = "") -> Verdict:
    """Check a receipt under `public` (and, given, that it is of `tenant`'s request `req`)."""
    from cryptography.exceptions import InvalidSignature

    if signed.key_id != key_id(public):
        return Verdict(False, f"signed by key {signed.key_id}, not by this key ({key_id(public)})")
    try:
        public.verify(signed.signature, signed.receipt)
    except InvalidSignature:
        return Verdict(False, "the signature does not match its bytes: the receipt was altered")
    try:
        receipt = svc.Receipt.FromString(signed.receipt)
    except DecodeError:
        return Verdict(False, "signed, but not a receipt")
    if tenant and receipt.tenant != tenant:
        return Verdict(
            False, f"the receipt is of tenant {receipt.tenant!r}'s request, not of {tenant!r}", receipt
        )
    if req and receipt.req != req:
        return Verdict(False, f"the receipt is of request {receipt.req!r}, not of {req!r}", receipt)
    return Verdict(True, "", receipt, *_meaning(receipt))


def _meaning(r: svc.Receipt) -> tuple[list[str], list[str]]:
    attended = f"{r.pages_attended} pages over {r.tokens} tokens"
    kinds = ", ".join(f"{s.pages} {s.kind}" + (f" ({s.rule})" if s.rule else "") for s in r.sources)
    proves = [
        f"the daemon that holds this key signed it ({r.daemon or 'unnamed'}, kvguard {r.kvguard_version})",
        f"it saw request {r.req} of tenant {r.tenant} on {len(r.nodes)} node(s): {attended}; "
        f"its pages' KV came from: {kinds or 'nowhere recorded'}",
    ]
    if r.verdict == "clean":
        proves.append(
            "no finding named the request when it was signed, under the rules of digest "
            + r.ruleset_digest[:16]
        )
    else:
        named = ", ".join(f"{f.finding} as {f.role} (record {f.record})" for f in r.findings)
        proves.append(f"findings named the request: {named}")
    proves.append(
        f"its end is record {r.chain_record} of the audit chain (hash {r.chain_hash.hex()[:16]}...)"
    )
    does_not = [
        "that no later receipt supersedes it: a finding heard after it (a transfer reported late) "
        "issues a new one; ask for the request's current receipt, or the tenant's exposure report",
        "anything of what kvguard did not see: engines, nodes or KV paths without its guard",
    ]
    if r.supersedes:
        does_not.insert(0, f"(it supersedes the receipt of record {r.supersedes})")
    return proves, does_not
