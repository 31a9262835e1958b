"""`kvguard daemon`: the global ledger behind gRPC.

Agents stream event batches in (AgentService); each batch is checked (the stream's node
identity, bound to its client certificate under mutual TLS; sequence; bounds), applied to the
one global ledger, evaluated by the ruleset and committed to the audit store with its findings
and commands, and only then acknowledged. Findings fan out to alert subscribers (AlertService,
resumable by cursor) and kill/quarantine commands go back to the agent of the node they name.
On start the ledger is rebuilt from the store, so a restart loses nothing and changes no
verdict. The daemon times its own part of each alert (receipt of the batch to the verdict,
to the durable alert, to its write to each subscriber, to the ack) and reports it with the
fleet state.

Where a batch goes: everything of the daemon runs on one asyncio event loop, in one thread
(the gRPC streams too), so a batch never waits for another thread to be woken or for the GIL:
the stream reads its events' heads once (proto/wire.py; the events stay bytes, and every
part that needs their fields reads them from the heads: the ledger, the store's writer) and
queues it, and the loop applies the
queued batches to the ledger in arrival order, one step (at most APPLY_SLICE events, or
DELIVERING_SLICE while alerts are being written out) at a time with whatever became ready in
between, so deliveries never wait behind a queue of batches; each command goes out as soon
as it is ordered; the batch's rows join the next group; a store-writer process commits the
groups in order (on another core) while the batches that arrive meanwhile make up the next
(group commit: a group goes to the writer when the one before it is reported durable, or at
once if it holds an alert, even in the middle of a batch: the step ends at the alert's event);
the loop reads each commit's report and sends its alerts and acks.

Invariants: an acknowledged event is durable, and an alert's cursor names a durable record;
(node, seq) is applied and stored at most once; a store failure after the ledger moved on
stops the daemon (it restarts from the store rather than run ahead of it). Commands do not
wait for the disk: a leak in progress is stopped as soon as it is judged. If the daemon dies
before the commit, the agent resends the batch and the same verdict orders the command again
(the guard kills a request once), so commands are at-least-once.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import sys
import threading
import time
import traceback
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvguard.daemon.latency import Latencies
from kvguard.daemon.room import RESERVE, StoreRoom
from kvguard.daemon.store import EventRun, Record, Store
from kvguard.daemon.writer import InlineWriter, Writer
from kvguard.ledger import snapshot
from kvguard.ledger.findings import KILL_ACTIONS, BadEvent, Finding
from kvguard.ledger.ledger import CLOCK_SKEW_NS, Ledger
from kvguard.proto import pb, wire
from kvguard.proto.channel import MAX_MESSAGE, TRANSPORT_LIMIT, Tls, peer_names
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset import Ruleset, load_ruleset

MAX_BATCH = 65536
MAX_IN_FLIGHT = 8  # batches of one stream applied or committing but not yet acknowledged
MAX_UNDELIVERED = 10_000  # commands kept per node while it is not connected
SUBSCRIBER_QUEUE = 100_000  # alerts waiting for one slow subscriber before it reads from the store
BACKLOG_PAGE = 1000  # alerts read from the store at a time
FREEZE_EVERY_S = 1.0  # how often long-lived objects leave the garbage collector's view
SNAPSHOT_EVERY = 1 << 22  # events after which the next group is followed by a snapshot
APPLY_SLICE = 256  # events applied in one step of the loop (~2.5 ms): the most a delivery waits behind
DELIVERING_SLICE = 16  # ... while alerts are being written to subscribers (each write waits a turn)


@dataclass
class Subscriber:
    """One alert stream's live feed: filled as commits are reported, drained by the stream
    (both on the daemon's loop). When it overflows, later alerts are not queued: the stream
    catches up from the store instead (it holds everything published)."""

    filter: svc.AlertFilter
    # (record id, finding, when the daemon received the batch that raised it)
    live: asyncio.Queue[tuple[int, Finding, float]] = field(
        default_factory=lambda: asyncio.Queue(SUBSCRIBER_QUEUE)
    )
    overflowed: bool = False
    dropped: int = 0
    delivering: bool = False  # live alerts queued or being written (the daemon counts these streams)

    def push(self, record_id: int, finding: Finding, received: float) -> bool:
        """Queue a live alert; True if the stream had nothing to deliver until now."""
        if self.overflowed:
            self.dropped += 1
            return False
        try:
            self.live.put_nowait((record_id, finding, received))
        except asyncio.QueueFull:
            self.overflowed = True
            self.dropped += 1
            return False
        started, self.delivering = not self.delivering, True
        return started


Reply = Callable[[svc.DaemonMessage], None]


@dataclass(slots=True)
class Batch:
    """One stream's batch on its way through the daemon."""

    node: str
    events: wire.Batch  # as received, its heads read once: the ledger and the store take them
    reply: Reply  # where its ack goes (the stream's outbox)
    # How far it is applied, when that takes more than one step of the loop:
    ack: svc.Ack | None = None  # set at its first event
    index: int = -1  # its place in the group being filled (-1: not in it yet)
    done: int = 0  # events applied
    run: int = -1  # start of the run of accepted events still open
    received: float = field(default_factory=time.perf_counter)  # for the daemon's own latencies


@dataclass(slots=True)
class Group:
    """Events applied to the ledger and committed together: what they produced, to commit
    and then release. A group may end in the middle of a batch (an alert's group goes to the
    writer at once); the batch's ack goes with the group that holds its last event."""

    batches: list[wire.Batch] = field(default_factory=list)  # with events in it
    parts: list[Record | EventRun] = field(default_factory=list)  # EventRun.batch: index in batches
    rows: int = 0  # the ids its parts take (a run of events one per event)
    # (its id less the group's first, the finding, when its batch was received)
    findings: list[tuple[int, Finding, float]] = field(default_factory=list)
    ended: list[Batch] = field(default_factory=list)  # batches whose last event it holds: their acks
    committed: Future[int] = field(default_factory=Future)  # its first record id, once durable

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
        writer: Writer | None = None,
        clock_skew_ns: int = CLOCK_SKEW_NS,
        snapshot_every: int = SNAPSHOT_EVERY,
        store_reserve: int = RESERVE,
    ) -> None:
        if mode not in ("monitor", "enforce"):
            raise ValueError(f"daemon mode {mode!r} is not monitor or enforce")
        self.mode = mode  # monitor: record and alert, never order a kill
        self.store = store
        self.ruleset = ruleset if ruleset is not None else load_ruleset()
        self.ledger, through = self._restored(store, Ledger(clock_skew_ns=clock_skew_ns))
        self.lock = threading.Lock()
        self.counters: Counter[str] = Counter()
        self.latencies = Latencies()  # receipt of a batch to its verdicts, alerts and ack
        self.subscribers: list[Subscriber] = []
        self.outboxes: dict[str, Reply] = {}  # node -> how to send to its stream (thread-safe)
        self._outbox_lock = threading.Lock()
        self._undelivered: dict[str, list[svc.Command]] = {}  # commands that found their node away
        self._command_id = store.count("command")
        self.writer: Writer = writer if writer is not None else InlineWriter(store)
        rebuilt = 0
        for node, batch, skip in store.event_batches(after=through):
            self.ledger.replay(batch, node, skip)  # verdicts are already stored; this rebuilds the state
            rebuilt += len(batch) - skip
        self.counters["rebuilt_events"] = rebuilt
        self.counters["snapshot_through"] = through
        # Dumping the ledger takes ~10 µs per request it knows (2 s for a window at full load):
        # a periodic snapshot is dumped by a forked copy of the daemon while it goes on.
        self.snapshot_every = snapshot_every
        self._snapshotting: threading.Thread | None = None
        self._snapshot_after = -rebuilt  # live events counted from 0: the replayed ones count too
        # node -> the last sequence number the store holds (what a new stream is told); moves
        # only when a group commits, while the ledger runs ahead by the groups in flight.
        self._durable: dict[str, int] = {name: node.last_seq for name, node in self.ledger.nodes.items()}
        self._inbox: deque[Batch] = deque()  # received, not yet applied (the head is next)
        self._apply_due = False  # _apply_next is scheduled
        self._delivering = 0  # subscriber streams with live alerts to write (Subscriber.delivering)
        self._next = Group()  # events applied since the last submit
        self._committing: deque[Group] = deque()  # submitted, not yet reported durable, in order
        self._alerting = 0  # groups in _committing that hold an alert
        self._drained: asyncio.Event | None = None  # close(): set once nothing is left to commit
        self._frozen = time.monotonic()
        gc.freeze()
        # The daemon's loop: the gRPC server runs on it too (serve()).
        self.loop = asyncio.new_event_loop()
        try:
            self.writer.start(self.loop, self._committed, self._store_failed)  # StoreError: no writer
        except BaseException:
            self.loop.close()
            raise
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvguard-daemon", daemon=True)
        self._thread.start()
        # Whether there is room for more: measured before anything is taken, then every second.
        self.room = StoreRoom(
            store.space, store.engine.url.render_as_string(hide_password=True), store_reserve
        )

    def _restored(self, store: Store, fresh: Ledger) -> tuple[Ledger, int]:
        """The ledger of the store's latest snapshot, if it is sound and was taken with this
        daemon's settings, and the record it was taken after; else `fresh` and 0 (the whole
        store is replayed), saying why."""
        found = store.latest_snapshot()
        if isinstance(found, str):
            if found != "no snapshot":
                print(f"kvguard daemon: {found}; replaying the whole store", file=sys.stderr, flush=True)
            return fresh, 0
        through, body = found
        try:
            ledger = snapshot.load(body)
        except snapshot.SnapshotError as exc:
            print(f"kvguard daemon: {exc}; replaying the whole store", file=sys.stderr, flush=True)
            return fresh, 0
        if snapshot.settings(ledger) != snapshot.settings(fresh):
            said = "the snapshot was taken with other ledger settings"
            print(f"kvguard daemon: {said}; replaying the whole store", file=sys.stderr, flush=True)
            return fresh, 0
        return ledger, through

    def save_snapshot(self) -> int:
        """Store the ledger's state as of the last committed record (call once the apply
        thread has stopped and the writer has committed everything); returns that record."""
        return self.store.save_snapshot(snapshot.dump(self.ledger))

    # ------------------------------------------------------------------ ingest

    def ingest(self, batch: Batch) -> None:
        """Take one batch of a node's events (on the daemon's loop) to apply in arrival order:
        its commands go out as soon as it is applied, its ack to `batch.reply` once it is
        durable. Batches that arrive while a group commits are committed together next (group
        commit), so a stream waits for one commit, not for everyone else's in turn."""
        self._inbox.append(batch)
        if not self._apply_due:
            self._apply_due = True
            self.loop.call_soon(self._apply_next)

    def _apply_next(self) -> None:
        """Apply the oldest batch received (up to APPLY_SLICE of its events), then let the loop
        run what became ready meanwhile before the next: applying is the loop's one long step
        (~10 µs an event), and the steps that deliver a kill, an ack or an alert are short;
        taken in turn with whole batches they would wait behind every batch received before
        them, and behind all of a large one (the node agent sends up to 4,096 events at once)."""
        self._apply_due = False
        if not self._inbox:
            return  # close() applied it already
        # Smaller steps while alerts are being written: a stream writes one alert at a time,
        # and its next write waits for a turn of the loop, i.e. for the step before it.
        limit = DELIVERING_SLICE if self._delivering else APPLY_SLICE
        try:
            whole = self._apply(self._inbox[0], self._next, limit)
        except Exception as exc:  # a bug: the ledger may have moved past what the group holds
            traceback.print_exc(file=sys.stderr)
            self._store_failed(exc)  # stop; the restart rebuilds from the store
            return
        if whole:
            self._inbox.popleft()
        if self._inbox:
            self._apply_due = True
            self.loop.call_soon(self._apply_next)
        if not self._committing or self._next.findings:
            # Group commit, except for alerts: their group goes to the writer now, queued
            # behind the commit in flight, which the writer then takes up without waiting
            # for the loop to read that commit's report first.
            self._submit()
        if time.monotonic() - self._frozen > FREEZE_EVERY_S:
            # The ledger only grows (a request object per request), and a full collection
            # walks every object it can see: at 10^5-10^6 requests that is a 50-100 ms stop,
            # the daemon's worst alert latency. Survivors of the last second move out of its
            # view (gc.freeze, O(1)). They are the ledger's, which live on anyway; only cyclic
            # garbage among them would never be freed, and the daemon's objects are freed by
            # reference counting.
            gc.freeze()
            self._frozen = time.monotonic()

    def delivered(self, sub: Subscriber) -> None:
        """A subscriber's stream has written all its live alerts, or ended."""
        if sub.delivering:
            sub.delivering = False
            self._delivering -= 1

    def _submit(self) -> None:
        """Everything applied so far goes to the writer as one group. A batch applied in part
        goes with its events so far only for an alert's sake (the rest in a later group): its
        ack waits for its last event anyway, and each piece sends the writer its whole message."""
        group = self._next
        partial = self._inbox[0] if self._inbox and self._inbox[0].index >= 0 else None
        if not group.batches or (partial is not None and not group.findings):
            return
        self._next = Group()
        if partial is not None:  # its run so far ends here
            if partial.run >= 0:
                group.add(EventRun(partial.index, partial.run, partial.done))
            partial.index = partial.run = -1
        self._committing.append(group)
        self._alerting += bool(group.findings)
        self.writer.submit(group.batches, group.parts)
        if (
            self.snapshot_every
            and group.rows
            and self._snapshotting is None
            and self.counters["events"] - self._snapshot_after >= self.snapshot_every
        ):
            self._fork_snapshot(group)

    def _committed(self, first_id: int) -> None:
        """The writer's report: the oldest group in flight is durable. Its alerts go out, then
        its acks (its commands went out before the commit, so a stream's commands reach its
        agent before the ack of the batch that caused them); then the next group is submitted."""
        group = self._committing.popleft()
        group.committed.set_result(first_id)
        self._alerting -= bool(group.findings)
        now = time.perf_counter()  # the group's alerts and acks all go out in this step
        for row_index, finding, received in group.findings:
            self._publish(first_id + row_index, finding, received)
            self.latencies.record("alert", now - received)
        for batch in group.ended:
            ack = batch.ack
            assert ack is not None
            self._durable[ack.node] = ack.durable_seq
            batch.reply(svc.DaemonMessage(ack=ack))
            self.latencies.record("ack", now - batch.received)
        self._submit()
        if self._drained is not None and not self._committing:
            self._drained.set()

    def close(self, timeout: float = 60) -> None:
        """Commit what was applied, then stop the loop (call from another thread, after the
        server stops and before the writer closes). Acks of that last work reach no stream;
        the agents resend it and the ledger answers with repeats."""

        async def drain() -> None:
            self._drained = asyncio.Event()
            while self._inbox:
                self._apply_next()
            self._submit()
            if self._committing:
                await self._drained.wait()

        if self._thread.is_alive():
            with contextlib.suppress(TimeoutError):
                asyncio.run_coroutine_threadsafe(drain(), self.loop).result(timeout)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        saving = self._snapshotting
        if saving is not None:
            saving.join(timeout=120)  # a forked snapshot being stored finishes first
        self.room.close()

    def _fork_snapshot(self, group: Group) -> None:
        """Snapshot the ledger as it is after the group just submitted (whose rows end at the
        state it holds now) without stopping: a forked copy dumps it (the loop stalls ~30 ms
        for a 450 MB ledger instead of ~2 s), and a thread stores the bytes once the group is
        durable."""
        self._snapshot_after = self.counters["events"]  # the next is due snapshot_every on, whatever happens
        try:
            forked = snapshot.Forked(self.ledger)
        except OSError as exc:
            self.counters["snapshot_failures"] += 1
            print(f"kvguard daemon: periodic ledger snapshot not taken: {exc}", file=sys.stderr, flush=True)
            return
        self._snapshotting = threading.Thread(
            target=self._store_forked,
            args=(forked, group.committed, group.rows),
            name="kvguard-daemon-snapshot",
            daemon=True,
        )
        self._snapshotting.start()

    def _store_forked(self, forked: snapshot.Forked, committed: Future[int], rows: int) -> None:
        try:
            body = forked.result()
            through = committed.result() + rows - 1  # groups commit in order: all before it too
            self.store.save_snapshot(body, through)
            self.counters["snapshots"] += 1
            self.counters["snapshot_through"] = through
        except Exception as exc:  # the next one is due after another snapshot_every events
            self.counters["snapshot_failures"] += 1
            print(f"kvguard daemon: periodic ledger snapshot not saved: {exc}", file=sys.stderr, flush=True)
        finally:
            self._snapshotting = None

    def _store_failed(self, exc: BaseException) -> None:
        # The ledger has moved past what is durable: stop, and rebuild from the store.
        print(f"kvguard daemon: {exc}; stopping", file=sys.stderr, flush=True)
        os._exit(70)

    def durable_seq(self, node: str) -> int:
        """The last sequence number of `node` that the store holds (0: none)."""
        return self._durable.get(node, 0)

    def _apply(self, batch: Batch, group: Group, limit: int) -> bool:
        """Apply up to `limit` more events of a batch to the ledger, into `group`; True once the
        batch is whole. Its accepted events become runs of rows, each finding (and the kill it
        orders) a row right after the event that raised it. The step ends after an event that
        raised an alert, so that its group goes to the writer now, not after the rest of the
        batch; unless an alert's group is committing already: then the step goes on (a storm
        of findings in a large batch would otherwise send the writer that batch per finding)."""
        if batch.ack is None:
            batch.ack = svc.Ack(node=batch.node)
        if batch.index < 0:  # its first events in this group
            batch.index = len(group.batches)
            group.batches.append(batch.events)
        node, ack, m, run, events = batch.node, batch.ack, batch.index, batch.run, batch.events
        end = min(len(events), batch.done + limit)
        i, accepted = batch.done, 0
        with self.lock:
            while i < end:
                # The clean common events in C, as many as come in a row; the next one (a
                # finding, an error, anything less common) one at a time.
                clean = self.ledger.apply_clean(events, i, end, node)
                if clean > i:
                    accepted += clean - i
                    if run < 0:
                        run = i
                    i = clean
                    if i == end:
                        break
                found = self._apply_event(node, events, i, ack)
                if found is None:  # not applied: not stored
                    if run >= 0:
                        group.add(EventRun(m, run, i))
                        run = -1
                    i += 1
                    continue
                accepted += 1
                if run < 0:
                    run = i
                if found:
                    group.add(EventRun(m, run, i + 1))
                    run = -1
                    self._judge(found, group, batch.received)
                    if group.findings and not self._alerting:
                        end = i + 1
                i += 1
            ack.accepted += accepted
            batch.done, batch.run = end, run
            if end < len(events):
                return False
            if run >= 0:
                group.add(EventRun(m, run, len(events)))
            known = self.ledger.nodes.get(node)
            ack.durable_seq = known.last_seq if known else 0
            group.ended.append(batch)
            self.counters["events"] += ack.accepted
        return True

    def _apply_event(self, node: str, events: wire.Batch, i: int, ack: svc.Ack) -> Sequence[Finding] | None:
        """Event i of `node`'s batch to the ledger: its findings, or None (and why, in the
        ack) if it was not applied (another node's event among them)."""
        try:
            return self.ledger.apply_serialized(events.event(i), node)
        except BadEvent as exc:
            self.counters[exc.kind] += 1
            if exc.kind == "repeat":
                ack.repeats += 1
            else:
                ack.rejected.add(seq=events.seq(i), reason=str(exc))
        except Exception as exc:  # a bug must not take the daemon or the stream down
            self.counters["internal"] += 1
            ack.rejected.add(seq=events.seq(i), reason=f"internal error applying the event: {exc!r}")
            traceback.print_exc(file=sys.stderr)
        return None

    def _judge(self, found: Sequence[Finding], out: Group, received: float) -> None:
        """The ruleset's verdict on each finding of an event (of a batch received at
        `received`): its row, then its commands' rows; the commands go out now, before the
        commit (see the module's invariants)."""
        for f in found:
            evaluated = self.ruleset.evaluate(f)
            if evaluated is None:
                continue
            out.findings.append((out.rows, evaluated, received))
            self.counters["findings"] += 1
            out.add(Record.of_finding(evaluated))
            for command in self._commands_for(evaluated):
                body = command.SerializeToString()
                out.add(Record("command", evaluated.node, command.id, evaluated.ts_ns, body, evaluated.req))
                self.counters["kills" if command.HasField("kill") else "quarantines"] += 1
                self.send_command(evaluated.node, command)
            self.latencies.record("verdict", time.perf_counter() - received)

    # ------------------------------------------------------------------ streams and commands

    def connect(self, node: str, send: Reply) -> bool:
        """A node's stream is open (False: the node has one already). Commands that found the
        node away go out on it now."""
        with self._outbox_lock:
            if node in self.outboxes:
                return False
            self.outboxes[node] = send
            waiting = self._undelivered.pop(node, [])
        for command in waiting:
            send(svc.DaemonMessage(command=command))
        self.counters["commands_late"] += len(waiting)
        return True

    def disconnect(self, node: str, send: Reply) -> None:
        """The stream that registered `send` for the node is over. (Equality, not identity:
        a stream passes its bound method, a new object at each access, equal to the first.)"""
        with self._outbox_lock:
            if self.outboxes.get(node) == send:
                del self.outboxes[node]

    def send_command(self, node: str, command: svc.Command) -> None:
        """To the node's stream; kept for its next stream while it has none (an agent that
        reconnects resends what was not acknowledged, which the ledger has seen: the command
        would never be ordered again)."""
        with self._outbox_lock:
            outbox = self.outboxes.get(node)
            if outbox is None:
                waiting = self._undelivered.setdefault(node, [])
                if len(waiting) >= MAX_UNDELIVERED:
                    self.counters["commands_dropped"] += 1
                    return
                waiting.append(command)
                return
        outbox(svc.DaemonMessage(command=command))

    def _publish(self, record_id: int, finding: Finding, received: float) -> None:
        for sub in list(self.subscribers):
            if _matches(sub.filter, finding) and sub.push(record_id, finding, received):
                self._delivering += 1

    def _commands_for(self, finding: Finding) -> list[svc.Command]:
        """In enforce mode, for the node of the finding (it holds the request and the pages):
        kill the request, and take the pages out of circulation, as the rule's action says."""
        if self.mode != "enforce":
            return []
        commands = []
        if finding.action in KILL_ACTIONS and finding.req:
            kill = svc.KillRequest(
                req=finding.req, finding=finding.finding, rule=finding.rule, message=finding.message
            )
            commands.append(svc.Command(kill=kill))
        if "quarantine" in finding.action and finding.pages and finding.pool is not None:
            pages = svc.QuarantinePages(pool=finding.pool, pages=finding.pages, finding=finding.finding)
            commands.append(svc.Command(quarantine=pages))
        for command in commands:
            self._command_id += 1
            command.id = self._command_id
        return commands

    # ------------------------------------------------------------------ fleet

    def fleet(self) -> svc.FleetState:
        with self.lock:
            state = svc.FleetState(requests=self.ledger.known_requests, events=self.counters["events"])
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
            # What the ledger could not see or judge, and what it retired and forgot.
            for name, n in self.ledger.stats.totals().items():
                state.counters[f"ledger_{name}"] = n
        state.store.CopyFrom(self.room.state())
        for took in self.latencies.summaries():
            state.latencies.add(
                stage=took.stage,
                count=took.count,
                p50_ms=took.p50_s * 1e3,
                p99_ms=took.p99_s * 1e3,
                max_ms=took.max_s * 1e3,
            )
        return state


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
        names = peer_names(self.context)
        # A node's own probes (node/ebpf: the agent's witness) stream under the node's name.
        if names is not None and name.split("/", 1)[0] not in names:
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
        durable = self.daemon.durable_seq(name)
        self.out.put_nowait(svc.DaemonMessage(ack=svc.Ack(node=name, durable_seq=durable)))
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
                    self._fail("malformed", f"unexpected {exc} message after hello")
                    return
                if len(events) > MAX_BATCH:
                    self._fail("malformed", f"batch of {len(events)} events (at most {MAX_BATCH})")
                    return
                if self.daemon.room.refusing:  # the agent keeps the batch and sends it again later
                    self._fail("store_full", self.daemon.room.refusing)
                    return
                batch = Batch(self.node, events, self.reply)  # received: its latencies count from now
                await self.in_flight.acquire()  # an agent that does not wait for acks waits here
                self.daemon.ingest(batch)
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            for _ in range(MAX_IN_FLIGHT):  # the acks of what was accepted go out first
                await self.in_flight.acquire()
            self.out.put_nowait(None)

    def end(self) -> None:
        """The stream is over: its node is free for the next stream, which also gets the
        commands queued here but never sent."""
        if not self.node:
            return
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
    subscriber's cursor, then live alerts, each once, in cursor order."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def _backlog(self, after: int) -> list[tuple[int, bytes]]:
        return [
            (record_id, body)
            for record_id, _, body in self.daemon.store.rows(kind="finding", after=after, limit=BACKLOG_PAGE)
        ]

    async def _catch_up(self, request: svc.AlertFilter, after: int) -> AsyncIterator[svc.Alert]:
        """The stored alerts after `after`, read a page at a time off the event loop."""
        loop = asyncio.get_running_loop()
        while True:
            page = await loop.run_in_executor(None, self._backlog, after)
            for record_id, body in page:
                finding = pb.Finding.FromString(body)
                if _matches(request, Finding.from_proto(finding)):
                    yield svc.Alert(cursor=record_id, finding=finding)
                after = record_id
            if len(page) < BACKLOG_PAGE:
                return

    async def Subscribe(
        self, request: svc.AlertFilter, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[svc.Alert]:
        sub = Subscriber(request)
        self.daemon.subscribers.append(sub)  # before reading the backlog: nothing falls between
        try:
            last = request.after
            while True:
                # Live alerts from here on are queued; what came before, or is dropped while
                # the queue is full, is read from the store (the loop runs one step at a
                # time, so nothing is published between these two lines).
                sub.overflowed = False
                while not sub.live.empty():
                    sub.live.get_nowait()
                async for alert in self._catch_up(request, last):
                    last = alert.cursor
                    yield alert
                while not sub.overflowed:
                    if sub.live.empty():
                        self.daemon.delivered(sub)
                    record_id, finding, received = await sub.live.get()
                    if record_id > last:
                        last = record_id
                        yield svc.Alert(cursor=record_id, finding=finding.to_proto())
                        # written to the stream: the alert has left the daemon
                        self.daemon.latencies.record("sent", time.perf_counter() - received)
                self.daemon.counters["subscriber_caught_up"] += 1
        finally:
            self.daemon.subscribers.remove(sub)
            self.daemon.delivered(sub)


class AuditServicer(svc_grpc.AuditServiceServicer):
    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    def Query(self, request: svc.AuditQuery, context: grpc.ServicerContext) -> Iterator[svc.AuditRecord]:
        # AuditQuery's fields are Store.rows()'s filters, by the same names.
        filters = {f.name: getattr(request, f.name) for f in request.DESCRIPTOR.fields}
        for record_id, kind, body in self.daemon.store.rows(**filters):
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


class Server:
    """The gRPC server, on the daemon's loop: the agent and alert streams run there (no thread
    per stream, so a batch never changes threads in the daemon); audit queries and fleet
    state run in a small thread pool."""

    def __init__(self, daemon: Daemon, listen: str, tls: Tls | None = None) -> None:
        self.loop = daemon.loop
        self._server: grpc.aio.Server | None = None
        start = self._start(daemon, listen, tls)
        self.port = asyncio.run_coroutine_threadsafe(start, self.loop).result()

    async def _start(self, daemon: Daemon, listen: str, tls: Tls | None) -> int:
        server = grpc.aio.server(
            migration_thread_pool=futures.ThreadPoolExecutor(max_workers=8),
            options=[
                ("grpc.max_receive_message_length", TRANSPORT_LIMIT),
                ("grpc.max_send_message_length", TRANSPORT_LIMIT),
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
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        names = [s.full_name for s in svc.DESCRIPTOR.services_by_name.values()]
        for name in ["", *names]:
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        reflection.enable_server_reflection([*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
        if tls is None:
            port = server.add_insecure_port(listen)
        else:
            port = server.add_secure_port(listen, tls.server_credentials())
        if port == 0:
            raise OSError(f"cannot listen on {listen}")
        await server.start()
        self._server = server
        return port

    def stop(self, grace: float) -> None:
        """Stop serving; streams get `grace` seconds to end."""
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(grace), self.loop).result(timeout=grace + 5)


def serve(daemon: Daemon, listen: str, tls: Tls | None = None) -> Server:
    """Start the gRPC server (health checking and reflection on; mutual TLS when `tls` is
    given, else plaintext); `.port` is where it listens."""
    return Server(daemon, listen, tls)
