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

import os
import queue
import sys
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvguard.daemon.store import Record, Store, StoreError
from kvguard.daemon.writer import StoreWriter
from kvguard.ledger.findings import KILL_ACTIONS, Finding
from kvguard.ledger.ledger import BadEvent, Ledger
from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset import Ruleset, load_ruleset

MAX_MESSAGE = 16 << 20
MAX_BATCH = 65536


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

    def submit(self, rows: Sequence[Record]) -> Future[int]:
        done: Future[int] = Future()
        try:
            ids = self.store.append(rows)
            done.set_result(ids[0] if ids else 0)
        except StoreError as exc:
            done.set_exception(exc)
        return done


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
        self._inbox: queue.Queue[Any] = queue.Queue()
        self._completions: queue.Queue[Any] = queue.Queue()
        self.writer: StoreWriter | InlineWriter = writer if writer is not None else InlineWriter(store)
        rebuilt = 0
        for event in store.events():
            self.ledger.apply(event)  # verdicts are already stored; this rebuilds the state
            rebuilt += 1
        self.counters["rebuilt_events"] = rebuilt
        threading.Thread(target=self._write_loop, name="kvguard-daemon-apply", daemon=True).start()
        threading.Thread(target=self._complete_loop, name="kvguard-daemon-complete", daemon=True).start()

    # ------------------------------------------------------------------ ingest

    def ingest(self, node: str, events: Sequence[pb.Event], raw: Sequence[bytes] | None = None) -> svc.Ack:
        """Apply and commit one batch of a node's events; returns its acknowledgement once
        durable. The batches of all streams are committed together by one writer thread
        (group commit), so a stream waits for one commit, not for everyone else's in turn."""
        done: Future[svc.Ack] = Future()
        self._inbox.put((node, events, raw, done))
        return done.result()

    def _write_loop(self) -> None:
        while True:
            items = [self._inbox.get()]
            count = len(items[0][1])
            while count < 16384:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
                items.append(item)
                count += len(item[1])
            try:
                applied = self._apply(items)
                committed = self.writer.submit(applied[0])
            except BaseException as exc:  # every waiter must learn of it
                for *_, done in items:
                    if not done.done():
                        done.set_exception(exc)
                continue
            # The next group is applied while this one commits; acks wait for the commit.
            self._completions.put((items, applied, committed))

    def _complete_loop(self) -> None:
        while True:
            items, (_, findings, commands, acks), committed = self._completions.get()
            try:
                first_id = committed.result()
            except StoreError as exc:
                # The ledger has moved past what is durable: stop, and rebuild from the store.
                print(f"kvguard daemon: {exc}; stopping", file=sys.stderr, flush=True)
                os._exit(70)
            # Commands first: a stream's commands reach its agent before the ack of the batch
            # that caused them.
            for command in commands:
                self.counters["kills"] += 1
                outbox = self.outboxes.get(self._command_node.pop(command.id, ""))
                if outbox is not None:
                    outbox.put(svc.DaemonMessage(command=command))
            for (_, _, _, done), ack in zip(items, acks, strict=True):
                done.set_result(ack)
            for row_index, finding in findings:
                self._publish(first_id + row_index, finding)

    def _apply(
        self, items: list[Any]
    ) -> tuple[list[Record], list[tuple[int, Finding]], list[svc.Command], list[svc.Ack]]:
        rows: list[Record] = []
        findings: list[tuple[int, Finding]] = []  # (index of its row, finding)
        commands: list[svc.Command] = []
        acks: list[svc.Ack] = []
        with self.lock:
            for node, events, raw, _ in items:
                ack = svc.Ack(node=node)
                for i, event in enumerate(events):
                    if event.node != node:
                        self.counters["identity"] += 1
                        reason = f"event of node {event.node!r} on the stream of {node!r}"
                        ack.rejected.add(seq=event.seq, reason=reason)
                        continue
                    try:
                        found = self.ledger.apply(event)
                    except BadEvent as exc:
                        self.counters[exc.kind] += 1
                        if exc.kind == "repeat":
                            ack.repeats += 1
                        else:
                            ack.rejected.add(seq=event.seq, reason=str(exc))
                        continue
                    ack.accepted += 1
                    rows.append(Record.of_event(event, raw[i] if raw is not None else None))
                    for f in found:
                        evaluated = self.ruleset.evaluate(f)
                        if evaluated is None:
                            continue
                        findings.append((len(rows), evaluated))
                        rows.append(Record.of_finding(evaluated))
                        command = self._command_for(evaluated)
                        if command is not None:
                            commands.append(command)
                            body = command.SerializeToString()
                            rows.append(
                                Record(
                                    "command",
                                    evaluated.node,
                                    command.id,
                                    evaluated.ts_ns,
                                    body,
                                    evaluated.req,
                                )
                            )
                known = self.ledger.nodes.get(node)
                ack.durable_seq = known.last_seq if known else 0
                acks.append(ack)
            self.counters["events"] += sum(a.accepted for a in acks)
            self.counters["findings"] += len(findings)
        return rows, findings, commands, acks

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

    def Stream(
        self, request_iterator: Iterator[svc.RawAgentMessage], context: grpc.ServicerContext
    ) -> Iterator[Any]:
        out: queue.Queue[svc.DaemonMessage | None] = queue.Queue()
        node: list[str] = []

        def fail(code: str, message: str) -> None:
            self.daemon.counters[f"stream_{code}"] += 1
            out.put(svc.DaemonMessage(error=svc.StreamError(code=code, message=message)))

        def read() -> None:
            try:
                for msg in request_iterator:
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
                        raw = list(msg.batch.events)
                        if len(raw) > MAX_BATCH:
                            fail("malformed", f"batch of {len(raw)} events (at most {MAX_BATCH})")
                            return
                        try:
                            events = [pb.Event.FromString(b) for b in raw]
                        except DecodeError as exc:
                            fail("malformed", f"an event of the batch is not a kvguard.v1.Event: {exc}")
                            return
                        out.put(svc.DaemonMessage(ack=self.daemon.ingest(node[0], events, raw)))
                    else:
                        fail("malformed", f"unexpected {body or 'empty'} message after hello")
                        return
            except grpc.RpcError:
                pass
            finally:
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
    # AgentService by hand: its requests are read as RawAgentMessage (the same bytes on the
    # wire), so each event's bytes go to the store as received.
    handler = grpc.stream_stream_rpc_method_handler(
        AgentServicer(daemon).Stream,
        request_deserializer=svc.RawAgentMessage.FromString,
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
