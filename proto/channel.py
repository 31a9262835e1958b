"""Mutual TLS on kvguard's gRPC: the daemon and its clients (agents, `replay --to`, `audit
--daemon`) prove themselves to each other with certificates of one operator CA, and a
stream's node identity is bound to its client's certificate.

Invariants: with TLS on, the daemon serves only clients whose certificate the CA signed
(the handshake fails otherwise, before any request is read); a certificate is a reader's if
it carries the URI SAN READER_URI, an operator's with OPERATOR_URI, a daemon's own (a client
of the bus only, which opens nothing here) with DAEMON_URI, a node's otherwise (`peer_role`;
what each may call: daemon/access.py); and an agent stream may speak only for a node its
certificate names (the subject's CN or a DNS name among its SANs), or for that node's probes
(`node/probe`, the probe one of PROBES: the agent's eBPF witness `p0/ebpf`, its engine's CUDA
shim `p0/shim`); any other shape of name (`p0/anything`, `p0/../d0`, `p0/ebpf/x`) is refused
with or without TLS.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # grpc is imported where it is used: the CLI builds its parser without it
    import grpc


MAX_MESSAGE = 16 << 20  # the largest AgentMessage the daemon accepts
MAX_BATCH_BYTES = MAX_MESSAGE // 2  # what an agent puts in one batch (the events' bytes), at most
TRANSPORT_LIMIT = 64 << 20  # gRPC's own limit: beyond it gRPC refuses, before the daemon sees a byte

# The roles of a client certificate: a node's streams its events; a reader's (audit, alerts,
# fleet: a SIEM, a dashboard) reads; an operator's reads and acts (kill, quarantine, acknowledge,
# rule modes: ControlService); the daemon's own is a client of the bus only (its identity
# there), never of a daemon. A URN rather than a name, so that no node's name can make its
# certificate a reader's or an operator's.
NODE = "node"
READER = "reader"
OPERATOR = "operator"
DAEMON = "daemon"
READER_URI = "urn:kvguard:role:reader"
OPERATOR_URI = "urn:kvguard:role:operator"
DAEMON_URI = "urn:kvguard:role:daemon"


def role_of(uris: Sequence[str] | Sequence[bytes]) -> str:
    """The role a client certificate's URI SANs give it."""
    named = {u.decode() if isinstance(u, bytes) else u for u in uris}
    for role, uri in ((OPERATOR, OPERATOR_URI), (READER, READER_URI), (DAEMON, DAEMON_URI)):
        if uri in named:
            return role
    return NODE


# The sources a node's agent streams beside its guard, each as NODE/PROBE with its own sequence.
WITNESS_STREAM = "ebpf"  # the agent's eBPF wire witness
SHIM_STREAM = "shim"  # the engine's LD_PRELOAD CUDA copy shim
PROBES = frozenset({WITNESS_STREAM, SHIM_STREAM})


def node_of(stream: str) -> str:
    """The node a stream's name speaks for (`p0` for `p0` and `p0/ebpf`); a ValueError saying
    why for a name of any other shape."""
    node, sep, probe = stream.partition("/")
    if not node or node in (".", ".."):
        raise ValueError(f"node name {stream[:80]!r} does not start with a node's name")
    if sep and probe not in PROBES:
        probes = ", ".join(sorted(PROBES))
        raise ValueError(f"node name {stream[:80]!r}: after '/' comes a probe of the node, one of {probes}")
    return node


class TlsError(ValueError):
    """The TLS options are incomplete or a file cannot be read."""


@dataclass(frozen=True)
class Tls:
    """PEM bytes: the CA that signs the other side's certificate, our certificate and key."""

    ca: bytes
    cert: bytes
    key: bytes

    @staticmethod
    def load(ca: str | None, cert: str | None, key: str | None) -> Tls | None:
        """None when no option is given; all three or a TlsError that names what is missing."""
        given = {"--tls-ca": ca, "--tls-cert": cert, "--tls-key": key}
        if not any(given.values()):
            return None
        missing = [name for name, value in given.items() if not value]
        if missing:
            needs = "mutual TLS needs --tls-ca, --tls-cert and --tls-key"
            raise TlsError(f"{needs}; missing {', '.join(missing)}")
        data = {}
        for name, value in given.items():
            try:
                data[name] = Path(str(value)).read_bytes()
            except OSError as exc:
                raise TlsError(f"{name} {value}: {exc.strerror}") from None
            if b"-----BEGIN" not in data[name]:
                raise TlsError(f"{name} {value}: not a PEM file")
        return Tls(data["--tls-ca"], data["--tls-cert"], data["--tls-key"])

    def server_credentials(self) -> grpc.ServerCredentials:
        import grpc

        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True
        )

    def role(self) -> str:
        """The role this side's own certificate gives it (OPERATOR, READER, DAEMON or NODE),
        as the other side's `peer_role` will read it."""
        from cryptography import x509

        cert = x509.load_pem_x509_certificate(self.cert)
        try:
            names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        except x509.ExtensionNotFound:
            return NODE
        return role_of(names.get_values_for_type(x509.UniformResourceIdentifier))

    def names(self) -> frozenset[str]:
        """The node names this side's own certificate gives it (CN and DNS SANs), as the daemon
        reads them (`peer_names`): the nodes an agent with it may stream for."""
        from cryptography import x509
        from cryptography.x509.oid import NameOID

        cert = x509.load_pem_x509_certificate(self.cert)
        names = {str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)}
        try:
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            names |= set(sans.get_values_for_type(x509.DNSName))
        except x509.ExtensionNotFound:
            pass
        return frozenset(names)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        import grpc

        return grpc.ssl_channel_credentials(self.ca, self.key, self.cert)


def channel(address: str, tls: Tls | None, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
    """A channel to the daemon: mutual TLS when `tls` is given, plaintext otherwise."""
    import grpc

    if tls is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, tls.channel_credentials(), options=list(options))


def peer_names(context: Any) -> set[str] | None:
    """The names the client's certificate gives it (CN and DNS SANs); None on plaintext."""
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    names = auth.get("x509_common_name", []) + auth.get("x509_subject_alternative_name", [])
    return {name.decode(errors="replace") for name in names}


def peer_role(context: Any) -> str | None:
    """The role the client's certificate gives it (`role_of` its URI SANs); None on plaintext."""
    auth = context.auth_context()
    if auth.get("transport_security_type") != [b"ssl"]:
        return None
    return role_of(auth.get("peer_uri", []))
