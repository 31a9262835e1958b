"""The daemon's gRPC services, on the daemon's loop: AgentService (one stream per node: batches
and the agent's status in, acks and commands back; `AgentSession`), AlertService (the alert
feed, resumable by cursor), AuditService (audit queries), FleetService (the fleet state, a
pool's map, the rules), ControlService (operators' actions: control.py), health checking and
reflection; mutual TLS when it is configured (`serve`), and then each call only in its
caller's role; without it, loopback only unless told otherwise (access.py).

Invariants: a stream speaks for the one node its hello names, which under mutual TLS its
client certificate must name too, and a node has one stream at a time; a batch is refused
whole if its message is oversized or malformed, or while the store has no room (the agent
keeps it and sends it again); a status after the hello is kept as the node's last word
(nodes.py: not stored, not an event), a malformed or oversized one ends the stream like a bad
batch; a stream has at most MAX_IN_FLIGHT batches in the daemon, and its acks go out before it
ends; an alert stream sends each alert once, in cursor order, the backlog from the store and
then the live ones, with the same filter (proto/filter.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import time
from collections.abc import AsyncIterator, Iterator
from concurrent import futures
from dataclasses import replace

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvguard.daemon.access import Revocation, RoleCheck, check_listener
from kvguard.daemon.control import ControlServicer
from kvguard.daemon.daemon import Daemon
from kvguard.daemon.fanout import Subscriber
from kvguard.daemon.ingest import Batch
from kvguard.daemon.pool_map import PoolNotFound
from kvguard.daemon.store import RowError
from kvguard.proto import pb, wire
from kvguard.proto.channel import MAX_MESSAGE, TRANSPORT_LIMIT, Tls, node_of, peer_names
from kvguard.proto.crl import Crl
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.proto.limits import NODE_BYTES, unstorable

MAX_BATCH = 65536
MAX_IN_FLIGHT = 8  # batches of one stream applied or committing but not yet acknowledged
BACKLOG_PAGE = 1000  # alerts read from the store at a time
SHARED_POLL_S = 1.0  # on the bus: how often an alert stream reads the other daemons' alerts
MAX_STATUS_BYTES = 1 << 16  # an agent's NodeStatus message at most
GUARD_STATES = ("connected", "gone", "none")


class AgentSession:
    """One AgentService stream, on the daemon's loop: its node (named by the hello), the
    messages going back (acks as commits are reported, commands as they are ordered, a
    StreamError), and the bound on its batches in the daemon."""

    def __init__(self, daemon: Daemon, context: grpc.aio.ServicerContext) -> None:
        self.daemon = daemon
        self.context = context
        self.loop = asyncio.get_running_loop()
        self.out: asyncio.Queue[svc.DaemonMessage | None] = asyncio.Queue()
        self.in_flight = asyncio.Semaphore(MAX_IN_FLIGHT)
        self.node = ""
        self.closed = False

    def reply(self, msg: svc.DaemonMessage) -> None:
        """A batch's ack (on the loop, as its commit is reported)."""
        self.out.put_nowait(msg)
        self.in_flight.release()

    def send(self, msg: svc.DaemonMessage) -> None:
        """A command for this stream's node (thread-safe: send_command may be called from
        anywhere; on the loop, as the ledger's verdicts are, it is queued at once)."""
        try:
            on_loop = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            on_loop = False
        if on_loop:
            self._command(msg)
        else:
            self.loop.call_soon_threadsafe(self._command, msg)

    def _command(self, msg: svc.DaemonMessage) -> None:
        if self.closed:  # the stream ended before this reached it: the node's next one takes it
            self.daemon.send_command(self.node, msg.command)
        else:
            self.out.put_nowait(msg)

    def _fail(self, code: str, message: str) -> None:
        self.daemon.counters[f"stream_{code}"] += 1
        self.out.put_nowait(svc.DaemonMessage(error=svc.StreamError(code=code, message=message)))

    def _hello(self, msg: svc.RawAgentMessage) -> bool:
        """The stream's first message names its node; False (and the reason sent) if not
        acceptable."""
        name = msg.hello.node if msg.WhichOneof("body") == "hello" else ""
        if not name:
            self._fail("identity", "the first message of a stream must be hello with the node's name")
            return False
        why = unstorable(name, NODE_BYTES)
        if why:  # its refused events' records name it: the store must be able to keep it
            self._fail("identity", f"node name {name[:40]!r} {why}")
            return False
        try:  # a node's own probes (node/ebpf: the agent's witness) stream under the node's name
            node = node_of(name)
        except ValueError as exc:
            self._fail("identity", str(exc))
            return False
        names = peer_names(self.context)
        if names is not None and node not in names:
            self._fail(
                "identity",
                f"node {name!r} is not named by the client's certificate "
                f"(it names {', '.join(sorted(names))})",
            )
            return False
        # Commands waiting for the node come through `send`, i.e. on the loop after this
        # step: after the hello's ack.
        if not self.daemon.connect(name, self.send):
            self._fail("identity", f"node {name!r} is already connected on another stream")
            return False
        self.node = name
        self.daemon.nodes.opened(name)
        epoch, seq = self.daemon.durable(name)
        self.out.put_nowait(svc.DaemonMessage(ack=svc.Ack(node=name, durable_seq=seq, durable_epoch=epoch)))
        return True

    async def read(self, requests: AsyncIterator[bytes]) -> None:
        """Take the agent's messages until the stream ends or breaks a rule; then, once the
        acks of what was accepted are out, end the replies."""
        try:
            async for data in requests:
                if len(data) > MAX_MESSAGE:
                    self._fail("oversized", f"message of {len(data)} bytes (at most {MAX_MESSAGE})")
                    return
                try:
                    if not self.node:
                        if not self._hello(svc.RawAgentMessage.FromString(data)):
                            return
                        continue
                    events = wire.decode_batch(data)  # its events' heads, read once
                except DecodeError as exc:
                    self._fail("malformed", f"the message is not a kvguard.v1.AgentMessage: {exc}")
                    return
                except wire.NotABatch as exc:
                    if str(exc) == "status" and self._status(data):
                        continue
                    if str(exc) != "status":
                        self._fail("malformed", f"unexpected {exc} message after hello")
                    return
                if len(events) > MAX_BATCH:
                    self._fail("malformed", f"batch of {len(events)} events (at most {MAX_BATCH})")
                    return
                if self.daemon.room.refusing:  # the agent keeps the batch and sends it again later
                    self._fail("store_full", self.daemon.room.refusing)
                    return
                batch = Batch(self.node, events, self.reply)  # received: its latencies count from now
                self.daemon.nodes.batch(self.node, events)
                await self.in_flight.acquire()  # an agent that does not wait for acks waits here
                self.daemon.ingest(batch)
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            for _ in range(MAX_IN_FLIGHT):  # the acks of what was accepted go out first
                await self.in_flight.acquire()
            self.out.put_nowait(None)

    def _status(self, data: bytes) -> bool:
        """The agent's word on the node (a NodeStatus after the hello): kept as the node's
        last; False (and the reason sent) if it is not acceptable."""
        if len(data) > MAX_STATUS_BYTES:
            self._fail("malformed", f"status of {len(data)} bytes (at most {MAX_STATUS_BYTES})")
            return False
        status = svc.RawAgentMessage.FromString(data).status
        if status.guard not in GUARD_STATES:
            self._fail("malformed", f"status: guard {status.guard[:40]!r} is not connected, gone or none")
            return False
        self.daemon.nodes.said(self.node, status)
        return True

    def end(self) -> None:
        """The stream is over: its node is free for the next stream, which also gets the
        commands queued here but never sent."""
        if not self.node:
            return
        self.daemon.nodes.closed(self.node)
        self.daemon.disconnect(self.node, self.send)
        self.closed = True
        while not self.out.empty():
            item = self.out.get_nowait()
            if item is not None and item.HasField("command"):
                self.daemon.send_command(self.node, item.command)


class AgentServicer:
    """AgentService.Stream on the server's event loop. Requests arrive as bytes (AgentMessage
    as sent): each batch is parsed once, here, into its events' bytes, which go on to the
    ledger and, with the batch's bytes, to the store as they arrived."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    async def Stream(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[svc.DaemonMessage]:
        session = AgentSession(self.daemon, context)
        reader = asyncio.create_task(session.read(request_iterator))
        try:
            while (item := await session.out.get()) is not None:
                yield item
        finally:
            reader.cancel()
            session.end()


class AlertServicer:
    """AlertService.Subscribe on the server's event loop: the store's backlog after the
    subscriber's cursor, then live alerts, each once, in cursor order; on the bus, every
    daemon's alerts, from the store they all write."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def _backlog(self, f: Filter, after: int) -> list[tuple[int, bytes]]:
        page = replace(f, kind="finding", after=after, limit=BACKLOG_PAGE)
        return [(record_id, body) for record_id, _, body in self.daemon.store.rows(page)]

    async def _catch_up(self, f: Filter, after: int) -> AsyncIterator[svc.Alert]:
        """The stored alerts after `after` that the filter takes, read a page at a time off
        the event loop."""
        loop = asyncio.get_running_loop()
        while True:
            page = await loop.run_in_executor(None, self._backlog, f, after)
            for record_id, body in page:
                after = record_id
                finding = pb.Finding.FromString(body)
                if "repeat" not in finding.details:  # stored, never alerted (daemon/repeats.py)
                    yield svc.Alert(cursor=record_id, finding=finding)
            if len(page) < BACKLOG_PAGE:
                return

    async def Subscribe(
        self, request: svc.AlertFilter, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[svc.Alert]:
        f = Filter.of(request)
        fanout = self.daemon.fanout
        sub = Subscriber(f)
        fanout.subscribers.append(sub)  # before reading the backlog: nothing falls between
        try:
            last = f.after
            while True:
                # Live alerts from here on are queued; what came before, or is dropped while
                # the queue is full, is read from the store (the loop runs one step at a
                # time, so nothing is published between these two lines).
                sub.overflowed = False
                while not sub.live.empty():
                    sub.live.get_nowait()
                async for alert in self._catch_up(f, last):
                    last = alert.cursor
                    yield alert
                if self.daemon.bus is not None:
                    # On the bus every daemon writes the store: its alerts come in the store's
                    # order, read from it at each of this daemon's alerts and every poll.
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(sub.live.get(), SHARED_POLL_S)
                    continue
                while not sub.overflowed:
                    if sub.live.empty():
                        fanout.delivered(sub)
                    record_id, finding, received = await sub.live.get()
                    if record_id > last:
                        last = record_id
                        yield svc.Alert(cursor=record_id, finding=finding.to_proto())
                        # written to the stream: the alert has left the daemon
                        self.daemon.latencies.record("sent", time.perf_counter() - received)
                self.daemon.counters["subscriber_caught_up"] += 1
        finally:
            fanout.subscribers.remove(sub)
            fanout.delivered(sub)


class AuditServicer(svc_grpc.AuditServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def Query(self, request: svc.AuditQuery, context: grpc.ServicerContext) -> Iterator[svc.AuditRecord]:
        try:
            for record_id, kind, body in self.daemon.store.rows(Filter.of(request)):
                if kind == "event":
                    yield svc.AuditRecord(id=record_id, kind=kind, event=pb.Event.FromString(body))
                elif kind == "finding":
                    yield svc.AuditRecord(id=record_id, kind=kind, finding=pb.Finding.FromString(body))
                elif kind == "refused":
                    yield svc.AuditRecord(id=record_id, kind=kind, refused=svc.Refusal.FromString(body))
                elif kind == "action":
                    yield svc.AuditRecord(id=record_id, kind=kind, action=svc.Action.FromString(body))
                elif kind == "receipt":
                    yield svc.AuditRecord(id=record_id, kind=kind, receipt=svc.SignedReceipt.FromString(body))
                else:
                    yield svc.AuditRecord(id=record_id, kind=kind, command=svc.Command.FromString(body))
        except RowError as exc:  # a row edited outside kvguard: said, the daemon serves on
            context.abort(grpc.StatusCode.DATA_LOSS, f"audit store: {exc}")


class FleetServicer(svc_grpc.FleetServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def State(self, request: svc.FleetRequest, context: grpc.ServicerContext) -> svc.FleetState:
        return self.daemon.fleet(own=request.own)

    def Pool(self, request: svc.PoolMapRequest, context: grpc.ServicerContext) -> svc.PoolMap:
        try:
            return self.daemon.pool_map(request.node, request.pool)
        except PoolNotFound as exc:
            context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            raise  # abort raises; for the type checker

    def Rules(self, request: svc.RulesRequest, context: grpc.ServicerContext) -> svc.RulesState:
        return self.daemon.rules()


class Server:
    """The gRPC server, on the daemon's loop: the agent and alert streams and operators'
    actions run there (no thread per stream, so a batch never changes threads in the daemon);
    audit queries, the fleet state, pool maps and rules run in a small thread pool. A plaintext
    `listen` must be on loopback unless `insecure` (ListenerError otherwise:
    access.check_listener). Under mutual TLS, `crl` (replaced by `revoke`) says which client
    certificates no longer open anything."""

    def __init__(
        self,
        daemon: Daemon,
        listen: str,
        tls: Tls | None = None,
        *,
        insecure: bool = False,
        crl: Crl | None = None,
    ) -> None:
        check_listener(listen, tls=tls is not None, insecure=insecure)
        self.loop = daemon.loop
        self.tls = tls
        self.revocation = Revocation(crl)
        self._server: grpc.aio.Server | None = None
        start = self._start(daemon, listen, tls)
        self.port = asyncio.run_coroutine_threadsafe(start, self.loop).result()

    async def _start(self, daemon: Daemon, listen: str, tls: Tls | None) -> int:
        server = grpc.aio.server(
            migration_thread_pool=futures.ThreadPoolExecutor(max_workers=8),
            # Under mutual TLS each call is checked against its caller's role first.
            interceptors=[RoleCheck(daemon.counters, self.loop, self.revocation)]
            if tls is not None
            else None,
            options=[
                ("grpc.max_receive_message_length", TRANSPORT_LIMIT),
                ("grpc.max_send_message_length", TRANSPORT_LIMIT),
                # gRPC sets SO_REUSEPORT by default: a second daemon on a taken port would bind it
                # too and take half the new connections. One address, one daemon.
                ("grpc.so_reuseport", 0),
            ],
        )
        # AgentService by hand: its requests are taken as bytes, so each event's bytes go to
        # the store as received.
        handler = grpc.stream_stream_rpc_method_handler(
            AgentServicer(daemon).Stream,
            request_deserializer=None,
            response_serializer=svc.DaemonMessage.SerializeToString,
        )
        generic = grpc.method_handlers_generic_handler("kvguard.v1.AgentService", {"Stream": handler})
        server.add_generic_rpc_handlers((generic,))
        svc_grpc.add_AlertServiceServicer_to_server(AlertServicer(daemon), server)  # type: ignore[arg-type]
        svc_grpc.add_AuditServiceServicer_to_server(AuditServicer(daemon), server)
        svc_grpc.add_FleetServiceServicer_to_server(FleetServicer(daemon), server)
        # Actions run on the loop, where the ledger and command ids change.
        svc_grpc.add_ControlServiceServicer_to_server(ControlServicer(daemon.control), server)  # type: ignore[arg-type]
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        names = [s.full_name for s in svc.DESCRIPTOR.services_by_name.values()]
        for name in ["", *names]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        try:
            if tls is None:
                port = server.add_insecure_port(listen)
            else:
                port = server.add_secure_port(listen, tls.server_credentials())
        except RuntimeError:  # gRPC's "Failed to bind": taken, or not an address of this host
            port = 0
        if port == 0:
            raise OSError(f"cannot listen on {listen}: {bind_problem(listen)}")
        await server.start()
        self._server = server
        return port

    def revoke(self, crl: Crl | None, timeout: float = 60) -> list[str]:
        """Put `crl` in force; the open streams it revokes are cut (said, one line each)."""

        async def replace() -> list[str]:
            return self.revocation.replace(crl)

        return asyncio.run_coroutine_threadsafe(replace(), self.loop).result(timeout)

    def stop(self, grace: float) -> None:
        """Stop serving; streams get `grace` seconds to end."""
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace), self.loop).result(timeout=grace + 5)


def bind_problem(listen: str) -> str:
    """Why gRPC could not bind `listen` (it says only "Failed to bind"): the operating
    system's answer to a bind of the same address, e.g. "Address already in use"."""
    host, _, port = listen.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        found = socket.getaddrinfo(host or None, int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, ValueError, UnicodeError) as exc:
        return f"not an address of this host ({getattr(exc, 'strerror', None) or exc})"
    for family, kind, proto, _, sockaddr in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC binds
            try:
                probe.bind(sockaddr)
            except OSError as exc:
                in_use = exc.errno == errno.EADDRINUSE
                return "the address is in use" if in_use else exc.strerror or str(exc)
    return "taken, or not an address of this host"


def serve(
    daemon: Daemon, listen: str, tls: Tls | None = None, *, insecure: bool = False, crl: Crl | None = None
) -> Server:
    """Start the gRPC server (health checking and reflection on; mutual TLS when `tls` is
    given, refusing the certificates `crl` revokes, else plaintext, on loopback unless
    `insecure`); `.port` is where it listens."""
    return Server(daemon, listen, tls, insecure=insecure, crl=crl)
