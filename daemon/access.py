"""Who may reach the daemon, and what each caller may call.

Invariants: a plaintext listener is on loopback or a local socket only, unless the operator
said --insecure (`check_listener`: an address that is not provably local, such as a wildcard,
a name that resolves to any other address, or one that does not resolve, is refused). Under
mutual TLS every call is made in the role its client certificate gives it (proto/channel.py,
`peer_role`): a node's certificate opens agent streams (for the nodes it names, checked at
the hello), a reader's queries the audit log, subscribes to alerts and reads the fleet state,
and an operator's does what a reader's does and acts (ControlService) (SERVICE_ROLES). Any
other call is refused before its servicer runs, with PERMISSION_DENIED and the reason, counted
(`access_denied_<role>`) and logged; a service missing from SERVICE_ROLES is refused to every
certificate. A certificate the CRL in force revokes (proto/crl.py; `Revocation`, replaced
whole on reload) is refused every call, whatever its role, with the reason, counted
(`access_denied_revoked`); its streams still open when a new CRL revokes it are cut then.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import ipaddress
import socket
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc

from kvguard.proto.channel import DAEMON, NODE, OPERATOR, OPERATOR_URI, READER, READER_URI, peer_role
from kvguard.proto.crl import Crl
from kvguard.proto.logs import fields, logger

log = logger("daemon")

Resolve = Callable[..., list[tuple[Any, ...]]]  # socket.getaddrinfo's shape

ROLES = frozenset({NODE, READER, OPERATOR})
_READS = frozenset({READER, OPERATOR})
# Under mutual TLS, the roles that may call each service.
SERVICE_ROLES: dict[str, frozenset[str]] = {
    "kvguard.v1.AgentService": frozenset({NODE}),
    "kvguard.v1.AlertService": _READS,
    "kvguard.v1.AuditService": _READS,
    "kvguard.v1.FleetService": _READS,
    "kvguard.v1.ControlService": frozenset({OPERATOR}),
    "grpc.health.v1.Health": ROLES,
    "grpc.reflection.v1alpha.ServerReflection": ROLES,
}
_MAY = {
    NODE: "may only stream the events of the nodes it names",
    READER: "may read the audit log, the alerts and the fleet state, but neither act nor speak for a node",
    OPERATOR: "may read the audit log, the alerts and the fleet state and act, but not speak for a node",
    DAEMON: "is a client of the bus only, never of a daemon",
}
_TAKES = {
    NODE: "a node's certificate (no role URI)",
    READER: f"a reader's certificate (URI SAN {READER_URI})",
    OPERATOR: f"an operator's certificate (URI SAN {OPERATOR_URI})",
}


class ListenerError(ValueError):
    """A plaintext listener that others could reach, without --insecure."""


# ------------------------------------------------------------------------------- the listener


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


# ----------------------------------------------------------------------------------- the roles


class Revocation:
    """The CRL in force, and the streams open under each client certificate (changed on the
    loop only), so that a certificate a new CRL revokes loses them at once, not at its next call."""

    def __init__(self, crl: Crl | None = None) -> None:
        self.crl = crl
        self._open: dict[bytes, dict[asyncio.Task[Any], Any]] = {}  # certificate -> stream task -> context
        self.cut: dict[asyncio.Task[Any], str] = {}  # a stream cut -> why

    def why(self, context: Any) -> str | None:
        """Why the caller's certificate is revoked; None if it is not (or there is no CRL)."""
        crl = self.crl
        pem = context.auth_context().get("x509_pem_cert") if crl is not None else None
        return crl.why_revoked(pem[0]) if crl is not None and pem else None

    @contextlib.contextmanager
    def streaming(self, context: Any) -> Iterator[None]:
        """While a stream runs (on the loop), it is known under its certificate."""
        pem = context.auth_context().get("x509_pem_cert")
        task = asyncio.current_task()
        if not pem or task is None:
            yield
            return
        self._open.setdefault(pem[0], {})[task] = context
        try:
            yield
        finally:
            streams = self._open.get(pem[0], {})
            streams.pop(task, None)
            if not streams:
                self._open.pop(pem[0], None)
            self.cut.pop(task, None)

    def replace(self, crl: Crl | None) -> list[str]:
        """Put `crl` in force (on the loop) and cut each open stream it revokes; what was cut."""
        self.crl = crl
        said = []
        for pem, streams in list(self._open.items()):
            why = crl.why_revoked(pem) if crl is not None else None
            for task, context in list(streams.items()) if why else ():
                self.cut[task] = why  # type: ignore[assignment]
                task.cancel()
                said.append(f"{context.peer()}: {why}")
        return said


class RoleCheck(grpc.aio.ServerInterceptor):
    """Refuses each call its caller's role may not make (SERVICE_ROLES), or whose certificate
    is revoked, before the servicer runs; installed on a server with mutual TLS. `counters` is
    changed on `loop` only."""

    def __init__(
        self, counters: Counter[str], loop: asyncio.AbstractEventLoop, revocation: Revocation | None = None
    ) -> None:
        self.counters = counters
        self.loop = loop
        self.revocation = revocation or Revocation()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method  # type: ignore[attr-defined]
        allowed = SERVICE_ROLES.get(method.split("/")[1] if method.count("/") == 2 else "", frozenset())
        if handler is None:
            return handler
        return _checked_handler(
            handler, lambda context: self._refusal(method, allowed, context), self.revocation
        )

    def _refusal(self, method: str, allowed: frozenset[str], context: Any) -> str | None:
        """None if the caller may call `method`; otherwise why not (counted and logged)."""
        revoked = self.revocation.why(context)
        role = peer_role(context)
        if revoked is None and (allowed == ROLES or role in allowed):
            return None
        names = context.auth_context().get("x509_common_name", [])
        who = names[0].decode(errors="replace") if names else "no common name"
        who = who if who.isprintable() else ascii(who)  # the log keeps one line per refusal
        if revoked is not None:
            reason, counter = revoked, "access_denied_revoked"
        elif role is None:
            reason, counter = f"{method} takes a client certificate", "access_denied_unknown"
        elif not allowed:
            reason, counter = f"{method} is open to no certificate", f"access_denied_{role}"
        else:
            takes = " or ".join(_TAKES[r] for r in (NODE, READER, OPERATOR) if r in allowed)
            article = "an" if role == OPERATOR else "a"
            reason = f"{method} takes {takes}; this one ({who}) is {article} {role}'s, which {_MAY[role]}"
            counter = f"access_denied_{role}"
        with contextlib.suppress(RuntimeError):  # a loop already closed: the daemon is stopping
            self.loop.call_soon_threadsafe(self.counters.update, {counter: 1})
        cn = names[0].decode(errors="replace") if names else ""
        log.warning(
            f"refused {context.peer()}: {reason}",
            extra=fields(peer=context.peer(), method=method, cn=cn, role=role or "", reason=reason),
        )
        return reason


def _checked_handler(
    handler: grpc.RpcMethodHandler, refusal: Callable[[Any], str | None], revocation: Revocation
) -> grpc.RpcMethodHandler:
    """`handler` with `refusal` asked first: a reason ends the call with PERMISSION_DENIED."""
    if handler.request_streaming and handler.response_streaming:
        behavior, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler
    elif handler.request_streaming:
        behavior, make = handler.stream_unary, grpc.stream_unary_rpc_method_handler
    elif handler.response_streaming:
        behavior, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
    else:
        behavior, make = handler.unary_unary, grpc.unary_unary_rpc_method_handler
    return make(  # type: ignore[operator]
        _checked(behavior, refusal, revocation),
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _checked(
    behavior: Callable[..., Any], refusal: Callable[[Any], str | None], revocation: Revocation
) -> Callable[..., Any]:
    """`behavior` behind `refusal`, of the same kind (gRPC runs coroutines and async
    generators on its loop, plain functions and generators in its thread pool); a stream on
    the loop is known to `revocation` while it runs, and one it cuts ends with the reason."""
    denied = grpc.StatusCode.PERMISSION_DENIED

    if inspect.isasyncgenfunction(behavior):

        async def checked_stream(request: Any, context: Any) -> AsyncIterator[Any]:
            if (reason := refusal(context)) is not None:
                await context.abort(denied, reason)
            with revocation.streaming(context):
                try:
                    async with contextlib.aclosing(behavior(request, context)) as responses:
                        async for response in responses:
                            yield response
                except asyncio.CancelledError:
                    task = asyncio.current_task()
                    why = revocation.cut.get(task) if task is not None else None
                    if why is None:
                        raise
                    await context.abort(denied, why)

        return checked_stream
    if inspect.iscoroutinefunction(behavior):

        async def checked_call(request: Any, context: Any) -> Any:
            if (reason := refusal(context)) is not None:
                await context.abort(denied, reason)
            return await behavior(request, context)

        return checked_call
    if inspect.isgeneratorfunction(behavior):

        def checked_sync_stream(request: Any, context: Any) -> Iterator[Any]:
            if (reason := refusal(context)) is not None:
                context.abort(denied, reason)
            yield from behavior(request, context)

        return checked_sync_stream

    def checked_sync_call(request: Any, context: Any) -> Any:
        if (reason := refusal(context)) is not None:
            context.abort(denied, reason)
        return behavior(request, context)

    return checked_sync_call
