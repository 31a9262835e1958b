"""Who may reach the daemon.

Invariant: a plaintext listener is on loopback or a local socket only, unless the operator
said --insecure (`check_listener`: an address that is not provably local, such as a wildcard,
a name that resolves to any other address, or one that does not resolve, is refused).
"""

from __future__ import annotations

import contextlib
import ipaddress
import socket
from collections.abc import Callable
from typing import Any

Resolve = Callable[..., list[tuple[Any, ...]]]  # socket.getaddrinfo's shape


class ListenerError(ValueError):
    """A plaintext listener that others could reach, without --insecure."""


def check_listener(
    listen: str, *, tls: bool, insecure: bool, resolve: Resolve = socket.getaddrinfo
) -> str | None:
    """None if `listen` is fine as it is; the warning to say once at start if it is plaintext
    beyond loopback and `insecure` allows it. ListenerError (one line) if it does not."""
    if tls:
        return None
    reason = _beyond_loopback(listen, resolve)
    if reason is None:
        return None
    if not insecure:
        raise ListenerError(
            f"--listen {listen}: {reason}; in plaintext, anyone who reaches it could read the audit log and "
            "speak as any node: give --tls-ca, --tls-cert and --tls-key, listen on 127.0.0.1, or say "
            "--insecure on a network you trust"
        )
    return (
        f"warning: plaintext gRPC on {listen} ({reason}), as --insecure allows: anyone who reaches it can "
        "read the audit log and speak as any node"
    )


def _beyond_loopback(listen: str, resolve: Resolve) -> str | None:
    """Why `listen` (a gRPC server address) may be reached from another host; None if only
    from this one."""
    if listen.startswith(("unix:", "unix-abstract:")):  # local sockets: no network
        return None
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        return "not host:port"
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        with contextlib.suppress(ValueError):
            ipaddress.IPv6Address(listen)
            return f"not host:port (an IPv6 address goes in brackets: [{host}]:{port})"
        return "not host:port"
    if not host:
        return "an empty host is every interface"
    try:
        literal = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        literal = None
    if literal is not None:
        if literal.is_unspecified:
            return f"{host} is every {'IPv4 ' if literal.version == 4 else ''}interface"
        return None if _is_loopback(literal) else f"{host} is not a loopback address"
    try:
        found = resolve(host, int(port), type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as exc:
        return f"cannot resolve {host} ({getattr(exc, 'strerror', None) or exc})"
    for *_, sockaddr in found:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        if not _is_loopback(address):
            return f"{host} resolves to {address}, not a loopback address"
    return None if found else f"{host} resolves to no address"


def _is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return (mapped or address).is_loopback
