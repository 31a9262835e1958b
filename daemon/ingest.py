"""Batches to the ledger, and their records to the store, on the daemon's loop (`Ingest`).

A batch's events are applied in arrival order, one step (at most APPLY_SLICE events, or
DELIVERING_SLICE while alerts are being written out) at a time, so that deliveries never wait
behind a queue of batches. What is applied goes to the writer in groups: a group goes when
the one before it is reported durable (group commit), or at once if it holds an alert (the
step ends at the alert's event). Each finding is judged by the ruleset as its event is
applied, and the commands it orders go out before the commit.

Invariants: an acknowledged event is durable, and an alert's cursor names a durable record;
(node, epoch, seq) is applied and stored at most once, and a repeat of it with other bytes is
refused as tampered (seen.py); a batch's ack goes after every event of it is
durable; an error applying a batch, or a store failure, stops the daemon (exit 70), which
then rebuilds from the store rather than run ahead of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvguard.daemon.commands import Commands
from kvguard.daemon.fanout import Fanout
from kvguard.daemon.latency import Latencies
from kvguard.daemon.ledgers import WHOLE, Ledgers
from kvguard.daemon.outcomes import Outcomes
from kvguard.daemon.receipts import ADMIT, Receipts
from kvguard.daemon.receipts import ENDS as RECEIPT_ENDS
from kvguard.daemon.repeats import Repeats
from kvguard.daemon.seen import Seen
from kvguard.daemon.snapshots import Snapshots
from kvguard.daemon.store import EventRun, Record
from kvguard.daemon.writer import Writer
from kvguard.ledger import BadEvent, Finding, Ledger
from kvguard.ledger.lifecycle import responds
from kvguard.proto import pb, wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.logs import fields, logger
from kvguard.ruleset import Ruleset

log = logger("daemon")
HEARTBEAT = wire.PAYLOAD["heartbeat"]  # its canary goes back to the node (Commands.echo)
ENDINGS = frozenset({wire.PAYLOAD["kill"], wire.PAYLOAD["finish"], wire.PAYLOAD["abort"], 0})  # Outcomes.saw

APPLY_SLICE = 256  # events applied in one step of the loop: the most a delivery waits behind
DELIVERING_SLICE = 16  # ... while alerts are being written to subscribers (each write waits a turn)
FREEZE_EVERY_S = 1.0  # how often long-lived objects leave the garbage collector's view
Reply = Callable[[svc.DaemonMessage], None]


@dataclass(slots=True)
class Batch:
    """One stream's batch on its way through the daemon."""

    node: str
    events: wire.Batch  # as received, its heads read once: the ledger and the store take them
    reply: Reply  # where its ack goes (the stream's outbox)
    cell: str = WHOLE  # whose ledger applies it (ledgers.py)
    # How far it is applied, when that takes more than one step of the loop:
    ack: svc.Ack | None = None  # set at its first event
    index: int = -1  # its place in the group being filled (-1: not in it yet)
    done: int = 0  # events applied
    run: int = -1  # start of the run of accepted events still open
    received: float = field(default_factory=time.perf_counter)  # for the daemon's own latencies


@dataclass(slots=True)
class Group:
    """Events applied to the ledger and committed together: what they produced, to commit and
    then release. A group may end in the middle of a batch (an alert's group goes to the writer
    at once); the batch's ack goes with the group that holds its last event."""

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


class Ingest:
    def __init__(
        self,
        ledgers: Ledgers,
        ruleset: Ruleset,
        writer: Writer,
        commands: Commands,
        fanout: Fanout,
        snapshots: Snapshots,
        latencies: Latencies,
        counters: Counter[str],
        loop: asyncio.AbstractEventLoop,
        seen: Seen | None = None,
    ) -> None:
        self.ledgers = ledgers
        self.ruleset = ruleset
        self.writer = writer
        self.commands = commands
        self.fanout = fanout
        self.snapshots = snapshots
        self.latencies = latencies
        self.counters = counters
        self.loop = loop
        self.seen = seen if seen is not None else Seen()  # the last events applied, to tell repeats
        self.lock = threading.Lock()  # the ledger, against readers on other threads (fleet state)
        # node -> the last (epoch, seq) the store holds (what a new stream is told); moves only
        # when a group commits, while the ledger runs ahead by the groups in flight.
        self.durable: dict[str, tuple[int, int]] = {
            name: (node.epoch, node.durable_seq) for name, node in ledgers.nodes().items()
        }
        self._inbox: deque[Batch] = deque()  # received, not yet applied (the head is next)
        self._apply_due = False  # _apply_next is scheduled
        self._next = Group()  # events applied since the last submit
        self._committing: deque[Group] = deque()  # submitted, not yet reported durable, in order
        self._alerting = 0  # groups in _committing that hold an alert
        self._drained: asyncio.Event | None = None  # drain(): set once nothing is left to commit
        self._frozen = time.monotonic()
        # How each request a finding ordered stopped then ended, said as an update of it.
        self.outcomes = Outcomes(
            lambda finding: self.alert(finding, counter="outcomes"), self._responds, loop.call_later
        )
        # The findings the rules judged (and the daemon's own), by kind, rule and severity.
        self.judged: Counter[tuple[str, str, str]] = Counter()
        # One alert per run of findings that repeat one another; each is stored.
        self.repeats = Repeats(lambda finding: self.alert(finding, counter="repeated_ends"), loop.call_later)
        self.receipts: Receipts | None = None  # each request's receipt, if the daemon has a key

    def ingest(self, batch: Batch) -> None:
        """Take one batch of a node's events (on the daemon's loop) to apply in arrival order:
        its commands go out as soon as it is applied, its ack to `batch.reply` once it is
        durable. Batches that arrive while a group commits are committed together next."""
        self._inbox.append(batch)
        if not self._apply_due:
            self._apply_due = True
            self.loop.call_soon(self._apply_next)

    def _apply_next(self) -> None:
        """Apply the oldest batch received (up to a step of its events), then let the loop run
        what became ready meanwhile before the next: applying is the loop's one long step, and
        the steps that deliver a kill, an ack or an alert are short; taken in turn with whole
        batches they would wait behind every batch received before them."""
        self._apply_due = False
        if not self._inbox:
            return  # drain() applied it already
        # Smaller steps while alerts are being written: a stream writes one alert at a time,
        # and its next write waits for a turn of the loop, i.e. for the step before it.
        limit = DELIVERING_SLICE if self.fanout.delivering else APPLY_SLICE
        try:
            whole = self._apply(self._inbox[0], self._next, limit)
        except Exception as exc:  # a bug: the ledger may have moved past what the group holds
            log.exception("applying a batch failed; stopping")
            self.failed(exc)  # stop; the restart rebuilds from the store
            return
        if whole:
            self._inbox.popleft()
        self.outcomes.due()
        self.repeats.due()
        if self._inbox:
            self._apply_due = True
            self.loop.call_soon(self._apply_next)
        if not self._committing or self._next.findings:
            # Group commit, except for alerts: their group goes to the writer now, queued
            # behind the commit in flight, which the writer then takes up without waiting for
            # the loop to read that commit's report first.
            self._submit()
        if time.monotonic() - self._frozen > FREEZE_EVERY_S:
            # The ledger only grows, and a full collection walks every object it can see (the
            # daemon's worst pause): survivors of the last second leave its view (O(1)). They
            # are the ledger's, which live on anyway; the daemon's own objects are freed by
            # reference counting.
            gc.freeze()
            self._frozen = time.monotonic()

    def _submit(self) -> None:
        """Everything applied so far goes to the writer as one group. A batch applied in part
        goes with its events so far only for an alert's sake (the rest in a later group): its
        ack waits for its last event anyway."""
        group = self._next
        partial = self._inbox[0] if self._inbox and self._inbox[0].index >= 0 else None
        if not (group.batches or group.parts) or (partial is not None and not group.findings):
            return
        self._next = Group()
        if partial is not None:  # its run so far ends here
            if partial.run >= 0:
                group.add(EventRun(partial.index, partial.run, partial.done))
            partial.index = partial.run = -1
        self._committing.append(group)
        self._alerting += bool(group.findings)
        self.writer.submit(group.batches, group.parts)
        if group.rows and self.snapshots.due(self.counters["events"]):
            self.snapshots.start(self.counters["events"])

    def record(self, records: Sequence[Record]) -> tuple[Future[int], int]:
        """Records of the daemon's own (an operator's action and the commands it orders), into
        the chain after everything applied so far (on the loop): (the future of their group's
        first id, set once it is durable; where the first of them lies in the group)."""
        group = self._next
        partial = self._inbox[0] if self._inbox and self._inbox[0].index >= 0 else None
        if partial is not None and partial.run >= 0:  # what it applied so far comes first
            group.add(EventRun(partial.index, partial.run, partial.done))
            partial.run = -1
        at = group.rows
        for record in records:
            group.add(record)
        if not self._committing:
            self._submit()
        return group.committed, at

    def alert(self, finding: Finding, counter: str = "findings") -> Future[int]:
        """An alert of the daemon's own (a Finding it decided itself: no rule judges it), into
        the chain after everything applied so far (on the loop); once durable it reaches the
        subscribers as a detector's finding does. The future of its group's first record id."""
        group = self._next
        partial = self._inbox[0] if self._inbox and self._inbox[0].index >= 0 else None
        if partial is not None and partial.run >= 0:  # what it applied so far comes first
            group.add(EventRun(partial.index, partial.run, partial.done))
            partial.run = -1
        group.findings.append((group.rows, finding, time.perf_counter()))
        group.add(Record.of_finding(finding))
        self.counters[counter] += 1
        if counter == "findings":  # not an update of one
            self.judged[(finding.finding, finding.rule, finding.severity)] += 1
        if not self._committing:
            self._submit()
        return group.committed

    def committed(self, first_id: int) -> None:
        """The writer's report: the oldest group in flight is durable. Its alerts go out, then
        its acks (its commands went out before the commit, so a stream's commands reach its
        agent before the ack of the batch that caused them); then the next group is submitted."""
        group = self._committing.popleft()
        group.committed.set_result(first_id)
        self._alerting -= bool(group.findings)
        now = time.perf_counter()  # the group's alerts and acks all go out in this step
        for row_index, finding, received in group.findings:
            self.fanout.publish(first_id + row_index, finding, received)
            self.latencies.record("alert", now - received)
        for batch in group.ended:
            ack = batch.ack
            assert ack is not None
            self.durable[ack.node] = (ack.durable_epoch, ack.durable_seq)
            batch.reply(svc.DaemonMessage(ack=ack))
            self.latencies.record("ack", now - batch.received)
        self.outcomes.due()
        self.repeats.due()
        self._submit()
        if self._drained is not None and not self._committing:
            self._drained.set()

    async def drain(self) -> None:
        """Apply and commit what was received (on the loop, at the daemon's close); the runs
        of repeated findings end, and are said once their first is durable."""
        self._drained = asyncio.Event()
        while self._inbox:
            self._apply_next()
        self.repeats.due(stopping=True)
        self._submit()
        if self._committing:
            await self._drained.wait()

    @staticmethod
    def failed(exc: BaseException) -> None:
        # The ledger has moved past what is durable: stop, and rebuild from the store.
        log.error(f"{exc}; stopping")
        os._exit(70)

    def _apply(self, batch: Batch, group: Group, limit: int) -> bool:
        """Apply up to `limit` more events of a batch to the ledger, into `group`; True once
        the batch is whole. Its accepted events become runs of rows, each finding (and the
        commands it orders) a row right after the event that raised it. The step ends after
        an event that raised an alert, so that its group goes to the writer now; unless an
        alert's group is committing already: then the step goes on (a storm of findings in a
        large batch would otherwise send the writer that batch per finding)."""
        if batch.ack is None:
            batch.ack = svc.Ack(node=batch.node)
        if batch.index < 0:  # its first events in this group
            batch.index = len(group.batches)
            group.batches.append(batch.events)
        node, ack, m, run, events = batch.node, batch.ack, batch.index, batch.run, batch.events
        ledger = self.ledgers.of(batch.cell)
        end = min(len(events), batch.done + limit)
        i, accepted = batch.done, 0
        with self.lock:
            while i < end:
                # The clean common events in C, as many as come in a row; the next one (a
                # finding, an error, anything less common) one at a time.
                clean = ledger.apply_clean(events, i, end, node)
                if clean > i:
                    self.seen.record(node, events, i, clean)
                    accepted += clean - i
                    if run < 0:
                        run = i
                    i = clean
                    if i == end:
                        break
                found = self._apply_event(ledger, node, events, i, ack)
                if found is None or isinstance(found, Record):  # not applied: its refusal stored
                    if run >= 0:
                        group.add(EventRun(m, run, i))
                        run = -1
                    if found is not None:
                        group.add(found)
                    i += 1
                    continue
                accepted += 1
                self.seen.record(node, events, i, i + 1)
                if run < 0:
                    run = i
                if self.receipts is not None:
                    self._receipt(ledger, node, events, i, group, group.rows + i - run)
                if found:
                    group.add(EventRun(m, run, i + 1))
                    run = -1
                    self._judge(ledger, found, group, batch.received)
                    if group.findings and not self._alerting:
                        end = i + 1
                i += 1
            ack.accepted += accepted
            batch.done, batch.run = end, run
            if end < len(events):
                return False
            if run >= 0:
                group.add(EventRun(m, run, len(events)))
            known = ledger.nodes.get(node)
            if known is not None:
                # Up to its first gap: a number far ahead (a fault, an impostor) must not make
                # the agent drop what it has not yet had stored.
                ack.durable_epoch, ack.durable_seq = known.epoch, known.durable_seq
            group.ended.append(batch)
            self.counters["events"] += ack.accepted
        return True

    def _apply_event(
        self, ledger: Ledger, node: str, events: wire.Batch, i: int, ack: svc.Ack
    ) -> Sequence[Finding] | Record | None:
        """Event i of `node`'s batch to the ledger: its findings; or, if it was refused, the
        record that keeps it in the audit log (and why, in the ack); None for a repeat."""
        known = ledger.nodes.get(node)
        epoch = known.epoch if known is not None else None
        try:
            found = ledger.apply_serialized(events.event(i), node)
        except BadEvent as exc:
            at, seq = events.position(i)
            if exc.kind == "repeat":
                body = events.event(i)
                seen = self.seen.verdict(node, at, seq, body)
                if seen != "differs":
                    self.counters["repeat" if seen == "same" else "repeat_unverified"] += 1
                    ack.repeats += 1
                    return None
                exc = BadEvent(
                    f"event seq {seq} (epoch {at}) of node {node} repeats one already applied with "
                    "different bytes: a tampered or forged copy, refused",
                    "tampered",
                )
                log.warning(str(exc))
            self.counters[exc.kind] += 1
            ack.rejected.add(seq=seq, epoch=at, reason=str(exc))
            return self._refusal(node, events, i, exc.kind, str(exc))
        except Exception as exc:  # a bug must not take the daemon or the stream down
            self.counters["internal"] += 1
            at, seq = events.position(i)
            reason = f"internal error applying the event: {exc!r}"
            ack.rejected.add(seq=seq, epoch=at, reason=reason)
            log.exception(f"{node}: {reason}", extra=fields(node=node, seq=seq, epoch=at))
            return self._refusal(node, events, i, "internal", reason)
        kind = events.heads[i]["kind"]
        if kind in (HEARTBEAT, 0):  # 0: bytes protobuf reads (rare)
            self._canary(node, events.event(i))
        if kind in ENDINGS and (len(self.outcomes) or len(self.repeats)):
            ended = pb.Event.FromString(events.event(i))
            self.outcomes.saw(node, ended)
            payload = ended.WhichOneof("payload")
            if payload in ("kill", "finish", "abort"):
                handed_on = payload == "finish" and not self._responds(node)
                self.repeats.request_ended(getattr(ended, payload).req, node if handed_on else None)
        now = ledger.nodes.get(node)
        if now is not None and epoch is not None and now.epoch != epoch:  # its engine restarted
            self.counters["restarts"] += 1
            log.info(
                f"node {node} restarted (epoch {epoch} -> {now.epoch}): what its previous "
                "engine held is released; its pools are judged afresh"
            )
        return found

    def _receipt(self, ledger: Ledger, node: str, events: wire.Batch, i: int, group: Group, row: int) -> None:
        """Event i of `node`'s batch, applied at `row` of `group`: a request's first time, or
        its end where its client is answered (its receipt is due)."""
        receipts = self.receipts
        assert receipts is not None
        kind = events.heads[i]["kind"]
        if kind == ADMIT:
            receipts.admitted(events.event(i))
        elif kind in RECEIPT_ENDS and (known := ledger.nodes.get(node)) is not None and responds(known):
            receipts.ended(ledger, node, events.event(i), group.committed, row)

    def _responds(self, name: str) -> bool:
        """Whether node `name` answers its requests' clients (not a prefill node)."""
        node = self.ledgers.node(name)
        return node is None or responds(node)

    def _canary(self, node: str, body: bytes) -> None:
        """A heartbeat that carries the agent's self-test canary, applied in the node's order
        like any event: back to the node on its command path (neither is stored)."""
        event = pb.Event.FromString(body)
        if event.WhichOneof("payload") == "heartbeat" and event.heartbeat.canary:
            self.commands.echo(node, event.heartbeat.canary)

    @staticmethod
    def _refusal(node: str, events: wire.Batch, i: int, kind: str, reason: str) -> Record:
        """The audit record of event i of `node`'s stream, refused (`kind`, `reason`)."""
        epoch, seq = events.position(i)
        head = events.heads[i]
        return Record.of_refusal(node, epoch, seq, int(head["ts"]), kind, reason, events.event(i))

    def _judge(self, ledger: Ledger, found: Sequence[Finding], out: Group, received: float) -> None:
        """The ruleset's verdict on each finding of an event (of a batch received at
        `received`): its row, then its commands' rows; the commands go out now, before the
        commit (see the module's invariants)."""
        for f in found:
            evaluated, permitted_by = self.ruleset.judge(f)
            if f.finding == "cross_tenant_share" and self.receipts is not None:
                self.receipts.shared(f, "" if evaluated is not None else permitted_by)
            if evaluated is None:
                continue
            r = ledger.request(evaluated.req) if evaluated.req else None
            finished = r is not None and r.has_finished
            known = self.outcomes.watch(evaluated, time.time_ns(), out.committed, out.rows, finished)
            if known:  # its request's fate is known already: this finding says it
                evaluated = dataclasses.replace(evaluated, details={**evaluated.details, "outcome": known})
            repeat = self.repeats.judged(evaluated, out.committed, out.rows)
            if repeat:  # stored, not alerted: its run's first was, and its end says how many
                evaluated = dataclasses.replace(
                    evaluated, details={**evaluated.details, "repeat": str(repeat)}
                )
                self.counters["findings_repeated"] += 1
            else:
                out.findings.append((out.rows, evaluated, received))
            self.counters["findings"] += 1
            self.judged[(evaluated.finding, evaluated.rule, evaluated.severity)] += 1
            out.add(Record.of_finding(evaluated))
            if self.receipts is not None:
                self.receipts.judged(evaluated, out.committed)
            node = ledger.nodes.get(evaluated.node)
            for command in self.commands.of(evaluated, node.epoch if node is not None else 0):
                body = command.SerializeToString()
                out.add(Record("command", evaluated.node, command.id, evaluated.ts_ns, body, evaluated.req))
                self.counters["kills" if command.HasField("kill") else "quarantines"] += 1
                self.commands.send(evaluated.node, command)
            self.latencies.record("verdict", time.perf_counter() - received)
