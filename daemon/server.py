"""`kvguard daemon`: the global ledger behind gRPC.

Agents stream event batches in (AgentService); each batch is checked (the stream's node
identity, sequence, bounds), applied to the one global ledger, evaluated by the ruleset and
committed to the audit store with its findings, and only then acknowledged. Findings fan out
to alert subscribers (AlertService, resumable by cursor) and kill/quarantine commands go back
to the agent of the node that holds the request. On start the ledger is rebuilt from the
store, so a restart loses nothing and changes no verdict.

Invariants: an acknowledged event is durable; (node, seq) is applied and stored at most once;
a store failure after the ledger moved on stops the daemon (it restarts from the store rather
than run ahead of it).
"""

from __future__ import annotations

import gc
import os
import queue
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvguard.daemon.store import EventRun, Record, Store, StoreError, rows_of
from kvguard.daemon.writer import StoreWriter
from kvguard.ledger.findings import KILL_ACTIONS, Finding
from kvguard.ledger.ledger import BadEvent, Ledger
from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset import Ruleset, load_ruleset

MAX_MESSAGE = 16 << 20
MAX_BATCH = 65536
MAX_IN_FLIGHT = 8  # batches of one stream applied or committing but not yet acknowledged
FREEZE_EVERY_S = 1.0  # how often long-lived objects leave the garbage collector's view


@dataclass
class Subscriber:
    filter: svc.AlertFilter
    queue: queue.Queue[tuple[int, Finding] | None] = field(default_factory=lambda: queue.Queue(100_000))
    dropped: int = 0


class InlineWriter:
    """The store written from the daemon's own process (tests, tools): the same interface as
    StoreWriter, each group committed before submit() returns."""

    def __init__(self, store: Store) -> None:
        self.store = store

    def submit(self, messages: Sequence[bytes], parts: Sequence[Record | EventRun]) -> Future[int]:
        done: Future[int] = Future()
        try:
            ids = self.store.append(rows_of(messages, parts))
            done.set_result(ids[0] if ids else 0)
        except StoreError as exc:
            done.set_exception(exc)
        return done


Reply = Callable[[svc.DaemonMessage], None]


@dataclass(slots=True)
class Batch:
    """One stream's batch on its way through the daemon."""

    node: str
    events: Sequence[pb.Event]
    message: bytes  # the AgentMessage as received: what the store keeps of each event
    reply: Reply  # where its ack goes (the stream's outbox)


@dataclass(slots=True)
class Applied:
    """What applying a group produced, to commit and then release."""

    parts: list[Record | EventRun] = field(default_factory=list)
    rows: int = 0  # rows the parts expand to
    findings: list[tuple[int, Finding]] = field(default_factory=list)  # (index of its row, finding)
    commands: list[svc.Command] = field(default_factory=list)
    acks: list[svc.Ack] = field(default_factory=list)

    def add(self, part: Record | EventRun) -> None:
        self.parts.append(part)
        self.rows += part.stop - part.start if isinstance(part, EventRun) else 1


def _matches(f: svc.AlertFilter, finding: Finding) -> bool:
    return (
        (not f.findings or finding.finding in f.findings)
        and (not f.severities or finding.severity in f.severities)
        and (not f.tenant or f.tenant in (finding.tenant, finding.victim_tenant))
        and (not f.node or f.node == finding.node)
    )


class Daemon:
    """The global ledger, the store and the fan-out; the gRPC services call into it."""

    def __init__(
        self,
        store: Store,
        ruleset: Ruleset | None = None,
        *,
        mode: str = "enforce",
        writer: StoreWriter | None = None,
    ) -> None:
        if mode not in ("monitor", "enforce"):
            raise ValueError(f"daemon mode {mode!r} is not monitor or enforce")
        self.mode = mode  # monitor: record and alert, never order a kill
        self.store = store
        self.ruleset = ruleset if ruleset is not None else load_ruleset()
        self.ledger = Ledger()
        self.lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.subscribers: list[Subscriber] = []
        self.outboxes: dict[str, queue.Queue[svc.DaemonMessage | None]] = {}
        self._command_id = store.count("command")
        self._command_node: dict[int, str] = {}
        self._inbox: queue.Queue[Batch] = queue.Queue()
        self.writer: StoreWriter | InlineWriter = writer if writer is not None else InlineWriter(store)
        rebuilt = 0
        for event in store.events():
            self.ledger.apply(event)  # verdicts are already stored; this rebuilds the state
            rebuilt += 1
        self.counters["rebuilt_events"] = rebuilt
        gc.freeze()
        threading.Thread(target=self._write_loop, name="kvguard-daemon-apply", daemon=True).start()

    # ------------------------------------------------------------------ ingest

    def ingest(self, batch: Batch) -> None:
        """Queue one batch of a node's events; its ack goes to `batch.reply` once it is
        durable. The batches of all streams are applied by one thread and committed together
        (group commit), so a stream waits for one commit, not for everyone else's in turn."""
        self._inbox.put(batch)

    def _write_loop(self) -> None:
        frozen = time.monotonic()
        while True:
            group = [self._inbox.get()]
            count = len(group[0].events)
            while count < 16384:
                try:
                    batch = self._inbox.get_nowait()
                except queue.Empty:
                    break
                group.append(batch)
                count += len(batch.events)
            applied = self._apply(group)
            try:
                committed = self.writer.submit([b.message for b in group], applied.parts)
            except StoreError as exc:
                self._store_failed(exc)
            # The next group is applied while this one commits; acks wait for the commit.
            committed.add_done_callback(lambda done, g=group, a=applied: self._release(g, a, done))
            if time.monotonic() - frozen > FREEZE_EVERY_S:
                # The ledger only grows (a request object per request), and a full collection
                # walks every object it can see: at 10^5-10^6 requests that is a 50-100 ms
                # stop of every thread, the daemon's worst alert latency. Survivors of the
                # last second move out of its view (gc.freeze, O(1)); what the ledger keeps is
                # not cyclic garbage, so nothing that could be collected is kept by it.
                gc.freeze()
                frozen = time.monotonic()

    def _store_failed(self, exc: BaseException) -> None:
        # The ledger has moved past what is durable: stop, and rebuild from the store.
        print(f"kvguard daemon: {exc}; stopping", file=sys.stderr, flush=True)
        os._exit(70)

    def _release(self, group: list[Batch], applied: Applied, committed: Future[int]) -> None:
        """A group is durable: send its commands, its acks, its alerts (in that order, so a
        stream's commands reach its agent before the ack of the batch that caused them)."""
        try:
            first_id = committed.result()
        except BaseException as exc:
            self._store_failed(exc)
        for command in applied.commands:
            self.counters["kills"] += 1
            outbox = self.outboxes.get(self._command_node.pop(command.id, ""))
            if outbox is not None:
                outbox.put(svc.DaemonMessage(command=command))
        for batch, ack in zip(group, applied.acks, strict=True):
            batch.reply(svc.DaemonMessage(ack=ack))
        for row_index, finding in applied.findings:
            self._publish(first_id + row_index, finding)

    def _apply(self, group: list[Batch]) -> Applied:
        """Apply a group to the ledger; the accepted events become runs of rows, each finding
        (and the kill it orders) a row right after the event that raised it."""
        out = Applied()
        with self.lock:
            for m, batch in enumerate(group):
                node = batch.node
                ack = svc.Ack(node=node)
                run = -1  # start of the current run of accepted events
                for i, event in enumerate(batch.events):
                    found = self._apply_event(node, event, ack)
                    if found is None:  # not applied: not stored
                        if run >= 0:
                            out.add(EventRun(m, run, i))
                            run = -1
                        continue
                    ack.accepted += 1
                    if run < 0:
                        run = i
                    if found:
                        out.add(EventRun(m, run, i + 1))
                        run = -1
                        self._judge(found, out)
                if run >= 0:
                    out.add(EventRun(m, run, len(batch.events)))
                known = self.ledger.nodes.get(node)
                ack.durable_seq = known.last_seq if known else 0
                out.acks.append(ack)
            self.counters["events"] += sum(a.accepted for a in out.acks)
            self.counters["findings"] += len(out.findings)
        return out

    def _apply_event(self, node: str, event: pb.Event, ack: svc.Ack) -> Sequence[Finding] | None:
        """One event to the ledger: its findings, or None (and why, in the ack) if it was not
        applied."""
        if event.node != node:
            self.counters["identity"] += 1
            ack.rejected.add(seq=event.seq, reason=f"event of node {event.node!r} on the stream of {node!r}")
            return None
        try:
            return self.ledger.apply(event)
        except BadEvent as exc:
            self.counters[exc.kind] += 1
            if exc.kind == "repeat":
                ack.repeats += 1
            else:
                ack.rejected.add(seq=event.seq, reason=str(exc))
        except Exception as exc:  # a bug must not take the daemon or the stream down
            self.counters["internal"] += 1
            ack.rejected.add(seq=event.seq, reason=f"internal error applying the event: {exc!r}")
            traceback.print_exc(file=sys.stderr)
        return None

    def _judge(self, found: Sequence[Finding], out: Applied) -> None:
        """The ruleset's verdict on each finding of an event: its row, and its kill."""
        for f in found:
            evaluated = self.ruleset.evaluate(f)
            if evaluated is None:
                continue
            out.findings.append((out.rows, evaluated))
            out.add(Record.of_finding(evaluated))
            command = self._command_for(evaluated)
            if command is not None:
                out.commands.append(command)
                body = command.SerializeToString()
                out.add(Record("command", evaluated.node, command.id, evaluated.ts_ns, body, evaluated.req))

    def _publish(self, record_id: int, finding: Finding) -> None:
        for sub in list(self.subscribers):
            if _matches(sub.filter, finding):
                try:
                    sub.queue.put_nowait((record_id, finding))
                except queue.Full:
                    sub.dropped += 1  # the subscriber resumes from the store by cursor

    def _command_for(self, finding: Finding) -> svc.Command | None:
        """The kill for the node that holds the request (enforce mode), or None."""
        if self.mode != "enforce" or finding.action not in KILL_ACTIONS or not finding.req:
            return None
        self._command_id += 1
        self._command_node[self._command_id] = finding.node
        kill = svc.KillRequest(
            req=finding.req, finding=finding.finding, rule=finding.rule, message=finding.message
        )
        return svc.Command(id=self._command_id, kill=kill)

    # ------------------------------------------------------------------ fleet

    def fleet(self) -> svc.FleetState:
        with self.lock:
            state = svc.FleetState(requests=len(self.ledger.requests) - 1, events=self.counters["events"])
            for name, node in sorted(self.ledger.nodes.items()):
                ns = state.nodes.add(
                    node=name,
                    last_seq=node.last_seq,
                    last_ts_ns=node.last_ts_ns,
                    connected=name in self.outboxes,
                    dropped=node.dropped,
                )
                for pool in node.pools.values():
                    ns.pools.add(node=name, report=pool.report, pages_in_use=int((pool.pages.use > 0).sum()))
            for kind, n in self.ledger.stats.findings.items():
                state.findings[kind] = n
            for name, n in self.counters.items():
                state.counters[name] = n
        return state


class AgentServicer(svc_grpc.AgentServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def Stream(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
        """Requests arrive as bytes (AgentMessage as sent): each batch is parsed once, here,
        and its bytes go on to the store as they arrived."""
        out: queue.Queue[svc.DaemonMessage | None] = queue.Queue()
        in_flight = threading.BoundedSemaphore(MAX_IN_FLIGHT)
        node: list[str] = []

        def fail(code: str, message: str) -> None:
            self.daemon.counters[f"stream_{code}"] += 1
            out.put(svc.DaemonMessage(error=svc.StreamError(code=code, message=message)))

        def reply(msg: svc.DaemonMessage) -> None:
            out.put(msg)
            in_flight.release()

        def read() -> None:
            try:
                for data in request_iterator:
                    try:
                        msg = svc.AgentMessage.FromString(data)
                    except DecodeError as exc:
                        fail("malformed", f"the message is not a kvguard.v1.AgentMessage: {exc}")
                        return
                    body = msg.WhichOneof("body")
                    if not node:
                        name = msg.hello.node if body == "hello" else ""
                        if not name:
                            fail(
                                "identity", "the first message of a stream must be hello with the node's name"
                            )
                            return
                        if name in self.daemon.outboxes:
                            fail("identity", f"node {name!r} is already connected on another stream")
                            return
                        node.append(name)
                        self.daemon.outboxes[name] = out
                        known = self.daemon.ledger.nodes.get(name)
                        out.put(
                            svc.DaemonMessage(
                                ack=svc.Ack(node=name, durable_seq=known.last_seq if known else 0)
                            )
                        )
                    elif body == "batch":
                        events = msg.batch.events
                        if len(events) > MAX_BATCH:
                            fail("malformed", f"batch of {len(events)} events (at most {MAX_BATCH})")
                            return
                        in_flight.acquire()  # an agent that does not wait for acks is held here
                        self.daemon.ingest(Batch(node[0], events, data, reply))
                    else:
                        fail("malformed", f"unexpected {body or 'empty'} message after hello")
                        return
            except grpc.RpcError:
                pass
            finally:
                for _ in range(MAX_IN_FLIGHT):  # the acks of what was accepted go out first
                    in_flight.acquire()
                out.put(None)

        threading.Thread(target=read, daemon=True).start()
        try:
            while True:
                item = out.get()
                if item is None:
                    break
                yield item
        finally:
            if node and self.daemon.outboxes.get(node[0]) is out:
                del self.daemon.outboxes[node[0]]


class AlertServicer(svc_grpc.AlertServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def Subscribe(self, request: svc.AlertFilter, context: grpc.ServicerContext) -> Iterator[svc.Alert]:
        sub = Subscriber(request)
        self.daemon.subscribers.append(sub)  # before reading the backlog: nothing falls between
        try:
            last = request.after
            for record_id, _, body in self.daemon.store.rows(kind="finding", after=request.after):
                finding = pb.Finding.FromString(body)
                if _matches(request, Finding.from_proto(finding)):
                    yield svc.Alert(cursor=record_id, finding=finding)
                last = record_id
            while context.is_active():
                try:
                    item = sub.queue.get(timeout=0.5)
                except queue.Empty:
                    continue
                if item is None:
                    break
                record_id, finding = item
                if record_id > last:
                    last = record_id
                    yield svc.Alert(cursor=record_id, finding=finding.to_proto())
        finally:
            self.daemon.subscribers.remove(sub)


class AuditServicer(svc_grpc.AuditServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def Query(self, request: svc.AuditQuery, context: grpc.ServicerContext) -> Iterator[svc.AuditRecord]:
        for record_id, kind, body in self.daemon.store.rows(
            kind=request.kind,
            tenant=request.tenant,
            req=request.req,
            node=request.node,
            finding=request.finding,
            since_ns=request.since_ns,
            until_ns=request.until_ns,
            limit=request.limit,
        ):
            if kind == "event":
                yield svc.AuditRecord(id=record_id, kind=kind, event=pb.Event.FromString(body))
            elif kind == "finding":
                yield svc.AuditRecord(id=record_id, kind=kind, finding=pb.Finding.FromString(body))
            else:
                yield svc.AuditRecord(id=record_id, kind=kind, command=svc.Command.FromString(body))


class FleetServicer(svc_grpc.FleetServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def State(self, request: svc.FleetRequest, context: grpc.ServicerContext) -> svc.FleetState:
        return self.daemon.fleet()


def serve(daemon: Daemon, listen: str) -> tuple[grpc.Server, int]:
    """Start the gRPC server (health checking and reflection on); returns it and its port."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=64),
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE),
            ("grpc.max_send_message_length", MAX_MESSAGE),
        ],
    )
    # AgentService by hand: its requests are taken as bytes, so each event's bytes go to the
    # store as received.
    handler = grpc.stream_stream_rpc_method_handler(
        AgentServicer(daemon).Stream,
        request_deserializer=None,
        response_serializer=svc.DaemonMessage.SerializeToString,
    )
    generic = grpc.method_handlers_generic_handler("kvguard.v1.AgentService", {"Stream": handler})
    server.add_generic_rpc_handlers((generic,))
    svc_grpc.add_AlertServiceServicer_to_server(AlertServicer(daemon), server)
    svc_grpc.add_AuditServiceServicer_to_server(AuditServicer(daemon), server)
    svc_grpc.add_FleetServiceServicer_to_server(FleetServicer(daemon), server)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [s.full_name for s in svc.DESCRIPTOR.services_by_name.values()]
    for name in ["", *names]:
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return server, port
