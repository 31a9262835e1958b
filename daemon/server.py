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
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvguard.agents.guard import KILL_ACTIONS
from kvguard.daemon.store import Record, Store, StoreError
from kvguard.ledger.findings import Finding
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


def _matches(f: svc.AlertFilter, finding: Finding) -> bool:
    return (
        (not f.findings or finding.finding in f.findings)
        and (not f.severities or finding.severity in f.severities)
        and (not f.tenant or f.tenant in (finding.tenant, finding.victim_tenant))
        and (not f.node or f.node == finding.node)
    )


class Daemon:
    """The global ledger, the store and the fan-out; the gRPC services call into it."""

    def __init__(self, store: Store, ruleset: Ruleset | None = None, *, mode: str = "enforce") -> None:
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
        self._command_id = 0
        rebuilt = 0
        for event in store.events():
            self.ledger.apply(event)  # verdicts are already stored; this rebuilds the state
            rebuilt += 1
        self.counters["rebuilt_events"] = rebuilt

    # ------------------------------------------------------------------ ingest

    def ingest(self, node: str, events: Any) -> svc.Ack:
        ack = svc.Ack(node=node)
        with self.lock:
            rows: list[Record] = []
            findings: list[Finding] = []
            for event in events:
                if event.node != node:
                    self.counters["identity"] += 1
                    ack.rejected.add(
                        seq=event.seq, reason=f"event of node {event.node!r} on the stream of {node!r}"
                    )
                    continue
                try:
                    raw = self.ledger.apply(event)
                except BadEvent as exc:
                    self.counters[exc.kind] += 1
                    if exc.kind == "repeat":
                        ack.repeats += 1
                    else:
                        ack.rejected.add(seq=event.seq, reason=str(exc))
                    continue
                ack.accepted += 1
                rows.append(Record.of_event(event))
                for f in raw:
                    evaluated = self.ruleset.evaluate(f)
                    if evaluated is not None:
                        findings.append(evaluated)
                        rows.append(Record.of_finding(evaluated))
            try:
                ids = self.store.append(rows)
            except StoreError as exc:
                # The ledger has moved past what is durable: stop, and rebuild from the store.
                print(f"kvguard daemon: {exc}; stopping", file=sys.stderr, flush=True)
                os._exit(70)
            known = self.ledger.nodes.get(node)
            ack.durable_seq = known.last_seq if known else 0
            finding_ids = [i for i, row in zip(ids, rows, strict=True) if row.kind == "finding"]
            self.counters["events"] += ack.accepted
            self.counters["findings"] += len(findings)
        for record_id, finding in zip(finding_ids, findings, strict=True):
            self._publish(record_id, finding)
            self._dispatch(finding)
        return ack

    def _publish(self, record_id: int, finding: Finding) -> None:
        for sub in list(self.subscribers):
            if _matches(sub.filter, finding):
                try:
                    sub.queue.put_nowait((record_id, finding))
                except queue.Full:
                    sub.dropped += 1  # the subscriber resumes from the store by cursor

    def _dispatch(self, finding: Finding) -> None:
        if self.mode != "enforce" or finding.action not in KILL_ACTIONS or not finding.req:
            return
        outbox = self.outboxes.get(finding.node)
        with self.lock:
            self._command_id += 1
            command = svc.Command(
                id=self._command_id,
                kill=svc.KillRequest(
                    req=finding.req, finding=finding.finding, rule=finding.rule, message=finding.message
                ),
            )
            self.store.append(
                [
                    Record(
                        "command",
                        finding.node,
                        self._command_id,
                        finding.ts_ns,
                        command.SerializeToString(),
                        finding.req,
                    )
                ]
            )
        self.counters["kills"] += 1
        if outbox is not None:
            outbox.put(svc.DaemonMessage(command=command))

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
        return state


class AgentServicer(svc_grpc.AgentServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def Stream(
        self, request_iterator: Iterator[svc.AgentMessage], context: grpc.ServicerContext
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
                        if len(msg.batch.events) > MAX_BATCH:
                            fail(
                                "malformed", f"batch of {len(msg.batch.events)} events (at most {MAX_BATCH})"
                            )
                            return
                        out.put(svc.DaemonMessage(ack=self.daemon.ingest(node[0], msg.batch.events)))
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
                if _matches(request, _from_proto(finding)):
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


def _from_proto(msg: pb.Finding) -> Finding:
    return Finding(
        finding=msg.finding,
        node=msg.node,
        req=msg.req,
        tenant=msg.tenant,
        victim_req=msg.victim_req,
        victim_tenant=msg.victim_tenant,
        pool=msg.pool if msg.HasField("pool") else None,
        pages=tuple(msg.pages),
        seq=msg.seq,
        ts_ns=msg.ts_ns,
        message=msg.message,
        details=dict(msg.details),
        severity=msg.severity,
        action=msg.action,
        rule=msg.rule,
        tags=tuple(msg.tags),
    )


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
    svc_grpc.add_AgentServiceServicer_to_server(AgentServicer(daemon), server)
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
