"""A client of the daemon's gRPC services (FleetService, AuditService, ControlService,
AlertService), shared by the dashboard (tui/, from worker threads, never from the UI's loop),
the alert feed (sinks/) and the commands that read the fleet.

Invariants: a call returns the daemon's answer or raises DaemonError, never grpc.RpcError
(Unreachable when the daemon cannot be reached: the caller retries after `Backoff`; Unsupported
when this daemon lacks the call: an older one, said plainly, and the rest goes on). After
Unreachable the next call opens a fresh channel, so a restarted daemon is found at once rather
than after gRPC's own reconnect backoff. Every call carries `kvguard-user` (the OS user): on a
plaintext daemon that is the name an operator's action is recorded under, marked unverified;
under mutual TLS the daemon takes the certificate's instead.
"""

from __future__ import annotations

import getpass
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import TypeVar

import grpc

from kvguard.proto.channel import OPERATOR, Tls, channel
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc

T = TypeVar("T")
CALL_TIMEOUT_S = 5.0
QUERY_LIMIT = 5000  # records one audit query of the dashboard reads at most
USER_METADATA = "kvguard-user"
# gRPC's own reconnects, between our fresh channels, stay quick too.
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 250),
    ("grpc.min_reconnect_backoff_ms", 250),
    ("grpc.max_reconnect_backoff_ms", 2000),
    ("grpc.max_receive_message_length", 64 << 20),
)


# What a gRPC status means to the person reading the dashboard or a command's error.
WORDS = {
    "UNAVAILABLE": "the daemon cannot be reached",
    "DEADLINE_EXCEEDED": "the daemon did not answer in time",
    "PERMISSION_DENIED": "not allowed",
    "UNAUTHENTICATED": "not authenticated",
    "UNIMPLEMENTED": "not served by this daemon",
    "NOT_FOUND": "not found",
    "INVALID_ARGUMENT": "refused",
    "FAILED_PRECONDITION": "refused",
    "ALREADY_EXISTS": "refused",
    "RESOURCE_EXHAUSTED": "the daemon is overloaded",
    "CANCELLED": "cancelled",
    "DATA_LOSS": "the audit store failed",
    "INTERNAL": "the daemon failed",
    "CLOSED": "the connection to the daemon closed",
    "ENDED": "the daemon ended the stream",
}


class DaemonError(RuntimeError):
    """A call the daemon did not answer as asked; the message says which call and why, in
    words (`code` keeps the gRPC status's name for programs)."""

    def __init__(self, call: str, code: str, details: str) -> None:
        words = WORDS.get(code, "failed")
        super().__init__(f"{call}: {words}: {details}" if details else f"{call}: {words}")
        self.call = call
        self.code = code
        self.details = details


class Unreachable(DaemonError):
    """The daemon cannot be reached (down, restarting, network): retry later."""


class Unsupported(DaemonError):
    """This daemon does not serve the call (UNIMPLEMENTED: older than the dashboard)."""


def error_of(call: str, exc: grpc.RpcError) -> DaemonError:
    """The DaemonError a failed gRPC call stands for."""
    code = exc.code() if hasattr(exc, "code") else None
    name = code.name if code is not None else "UNKNOWN"
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return Unreachable(call, name, details)
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return Unsupported(call, name, "it is older than the dashboard")
    return DaemonError(call, name, details)


class Backoff:
    """Waits between attempts at an unreachable daemon: `first` seconds, doubling to `cap`;
    back to `first` once a call succeeds."""

    def __init__(self, first: float = 0.25, cap: float = 2.0) -> None:
        self.first = first
        self.cap = cap
        self.next = first

    def failed(self) -> float:
        """The wait before the next attempt (and the one after it doubles)."""
        wait = self.next
        self.next = min(self.cap, self.next * 2)
        return wait

    def succeeded(self) -> None:
        self.next = self.first


class DaemonClient:
    """The daemon at `address` (mutual TLS when `tls`), as the dashboard calls it.

    `pin_fleet`, when set, rewrites each FleetState before it is returned: the tests' hook
    for the fields that change by themselves (the clocks, rates and ages), so that screens
    are the same from run to run against a real daemon.
    """

    def __init__(self, address: str, tls: Tls | None = None, user: str | None = None) -> None:
        self.address = address
        self.tls = tls
        # Under mutual TLS only an operator's certificate may act; plaintext is the daemon's
        # to judge (it takes actions only from loopback, as `unverified:`).
        self.may_act = tls is None or tls.role() == OPERATOR
        self.user = user if user is not None else _os_user()
        self.metadata = ((USER_METADATA, self.user),)
        self.pin_fleet: Callable[[svc.FleetState], None] | None = None
        self._lock = threading.Lock()
        self._channel: grpc.Channel | None = None

    def sibling(self) -> DaemonClient:
        """Another client of the same daemon, as the same user, on a channel of its own (each
        thread of the app has one: a reset by one never cuts another's call short)."""
        twin = DaemonClient(self.address, self.tls, self.user)
        twin.pin_fleet = self.pin_fleet
        return twin

    def _open(self) -> grpc.Channel:
        with self._lock:
            if self._channel is None:
                self._channel = channel(self.address, self.tls, CHANNEL_OPTIONS)
            return self._channel

    def reset(self) -> None:
        """Drop the channel: the next call opens a fresh one."""
        with self._lock:
            stale, self._channel = self._channel, None
        if stale is not None:
            stale.close()

    close = reset

    def _call(self, name: str, run: Callable[[grpc.Channel], T]) -> T:
        try:
            return run(self._open())
        except grpc.RpcError as exc:
            error = error_of(name, exc)
            if isinstance(error, Unreachable):
                self.reset()
            raise error from None
        except ValueError as exc:  # a channel closed under the call (the app is stopping)
            raise Unreachable(name, "CLOSED", str(exc)) from None

    def state(self) -> svc.FleetState:
        def run(ch: grpc.Channel) -> svc.FleetState:
            stub = svc_grpc.FleetServiceStub(ch)
            return stub.State(svc.FleetRequest(), timeout=CALL_TIMEOUT_S, metadata=self.metadata)

        state = self._call("FleetService.State", run)
        if self.pin_fleet is not None:
            self.pin_fleet(state)
        return state

    def pool(self, node: str, pool: int) -> svc.PoolMap:
        def run(ch: grpc.Channel) -> svc.PoolMap:
            request = svc.PoolMapRequest(node=node, pool=pool)
            return svc_grpc.FleetServiceStub(ch).Pool(request, timeout=CALL_TIMEOUT_S, metadata=self.metadata)

        return self._call("FleetService.Pool", run)

    def rules(self) -> svc.RulesState:
        def run(ch: grpc.Channel) -> svc.RulesState:
            stub = svc_grpc.FleetServiceStub(ch)
            return stub.Rules(svc.RulesRequest(), timeout=CALL_TIMEOUT_S, metadata=self.metadata)

        return self._call("FleetService.Rules", run)

    def query(self, f: Filter) -> list[svc.AuditRecord]:
        """The audit records the filter takes (at most QUERY_LIMIT, or its own limit)."""
        limited = f if f.limit else replace(f, limit=QUERY_LIMIT)

        def run(ch: grpc.Channel) -> list[svc.AuditRecord]:
            stub = svc_grpc.AuditServiceStub(ch)
            return list(stub.Query(limited.audit_query(), timeout=CALL_TIMEOUT_S, metadata=self.metadata))

        return self._call("AuditService.Query", run)

    def act(self, action: svc.Action) -> svc.ActionResult:
        """Have the daemon do `action`; returns once it is durable in the audit log."""

        def run(ch: grpc.Channel) -> svc.ActionResult:
            stub = svc_grpc.ControlServiceStub(ch)
            return stub.Act(action, timeout=CALL_TIMEOUT_S * 2, metadata=self.metadata)

        return self._call("ControlService.Act", run)

    def subscribe(self, f: Filter) -> tuple[Callable[[], None], Iterator[svc.Alert]]:
        """The live alert stream the filter takes (from its `after`), and what cancels it."""
        try:
            stub = svc_grpc.AlertServiceStub(self._open())
            call = stub.Subscribe(f.alert_filter(), metadata=self.metadata)
        except ValueError as exc:  # the channel was closed under it (a reset by another thread)
            raise Unreachable("AlertService.Subscribe", "CLOSED", str(exc)) from None
        return call.cancel, _alerts(call)


def _alerts(call: Iterator[svc.Alert]) -> Iterator[svc.Alert]:
    try:
        yield from call
    except grpc.RpcError as exc:
        raise error_of("AlertService.Subscribe", exc) from None
    except ValueError as exc:  # the channel was closed under it
        raise Unreachable("AlertService.Subscribe", "CLOSED", str(exc)) from None


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container): say so rather than fail
        return "unknown"
