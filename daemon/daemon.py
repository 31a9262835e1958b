"""`kvguard daemon`'s core (`Daemon`): its ledgers (ledgers.py: one for every node, rebuilt
from the audit store at start; on the bus one per cell it holds, rebuilt as it takes each),
and the parts around them, all on one asyncio event loop in one thread: the ingest
(ingest.py: batches applied, judged, committed in groups), the commands back to the nodes
(commands.py), operators' actions (control.py), each node's liveness (nodes.py), the alert
fan-out (fanout.py), the periodic snapshots (snapshots.py) and the store's room (room.py). The
gRPC services (service.py) call into it. Its rules are reloaded in place (`reload_rules`), and
its loop marks each turn of a heartbeat that systemd's watchdog reads (`start_heartbeat`).

Invariants: a ledger starts from its latest sound snapshot plus every event of its nodes
stored after it, so a restart or a cell's move loses nothing and changes no verdict; only the
loop's thread changes a ledger in use (the fleet state reads them under the ingest's lock);
the daemon times its own part of each alert (receipt to verdict, to durable alert, to its
write, to the ack); a reload loads and checks the new rules off the loop and swaps them in
whole on it, between two findings, and rules that fail to load leave the old ones in force
and raise a critical alert of the daemon's own (kind "internal", rule kvguard_reload_failed),
stored and sent like any.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from kvguard.daemon.commands import Commands, Reply
from kvguard.daemon.control import Control
from kvguard.daemon.fanout import Fanout
from kvguard.daemon.ingest import Batch, Ingest
from kvguard.daemon.latency import Latencies
from kvguard.daemon.ledgers import WHOLE, Ledgers
from kvguard.daemon.nodes import Nodes
from kvguard.daemon.pool_map import PoolNotFound, read_pool
from kvguard.daemon.receipts import Receipts
from kvguard.daemon.room import RESERVE, StoreRoom
from kvguard.daemon.seen import Seen
from kvguard.daemon.snapshots import SNAPSHOT_EVERY, Snapshots, restored
from kvguard.daemon.store import Store
from kvguard.daemon.writer import InlineWriter, Writer
from kvguard.ledger import CLOCK_SKEW_NS, Finding, Ledger, snapshot
from kvguard.ledger.limits import UNBOUNDED, Limits
from kvguard.proto import wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.logs import logger
from kvguard.ruleset import Ruleset, RulesetError, load_ruleset
from kvguard.ruleset.evaluator import signature

if TYPE_CHECKING:
    from kvguard.daemon.bus import BusIntake

log = logger("daemon")

REPLAY_REFUSALS_SAID = 10  # stored events refused at start that are logged one by one (all are counted)
RELOAD_FAILED_RULE = "kvguard_reload_failed"  # the rule id of the daemon's alert on a refused reload
ON_LOOP_TIMEOUT_S = 60.0  # how long a reload waits for the loop (a loop stuck longer: the watchdog's)
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class CellStart:
    """Where a cell taken on the bus starts: its snapshot's ledger, the record it was taken
    after, and the nodes it holds."""

    ledger: Ledger
    through: int
    nodes: frozenset[str]


@dataclass(frozen=True, slots=True)
class RulesChange:
    """What a reload changed, by rule id."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    changed: tuple[str, ...]
    rules: int  # in the new rule set

    def __str__(self) -> str:
        said = [f"{len(ids)} {what}" for what, ids in (("added", self.added), ("removed", self.removed))]
        said.append(f"{len(self.changed)} changed")
        named = ", ".join(self.added + self.removed + self.changed)
        return f"{self.rules} rules; " + ", ".join(said) + (f" ({named})" if named else "")


def rules_change(old: Ruleset, new: Ruleset) -> RulesChange:
    """The rules `new` adds, removes and changes against `old`, by id, each in load order."""
    before = {rule.id: signature(rule) for rule in old.rules}
    after = {rule.id: signature(rule) for rule in new.rules}
    return RulesChange(
        added=tuple(i for i in after if i not in before),
        removed=tuple(i for i in before if i not in after),
        changed=tuple(i for i in after if i in before and after[i] != before[i]),
        rules=len(new.rules),
    )


class Daemon:
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
        limits: Limits | None = None,
        rebuild: bool = True,
        receipt_key: Any = None,
        name: str = "",
    ) -> None:
        self.counters: Counter[str] = Counter()
        self.commands = Commands(mode, store.count("command"), self.counters)  # checks the mode first
        self.store = store
        self.ruleset = ruleset if ruleset is not None else load_ruleset()
        self.limits = limits if limits is not None else Limits()
        self.clock_skew_ns = clock_skew_ns
        self.seen = Seen()  # the last events of each node, to tell a repeat from a tampered copy
        # What was applied once is applied again whatever the limits are now; they bound what comes next.
        # A daemon on the bus (`rebuild` False) starts empty: it rebuilds each cell it takes (adopt).
        through, rebuilt, whole = store.last_id(), 0, None
        if rebuild:
            whole, through = restored(store, Ledger(clock_skew_ns=clock_skew_ns, limits=UNBOUNDED))
            rebuilt = self._replay(whole, store.event_batches(after=through), self.counters)
        self.ledgers = Ledgers(self.fresh, whole)
        self.counters["rebuilt_events"] = rebuilt
        self.counters["snapshot_through"] = through
        self.latencies = Latencies()  # receipt of a batch to its verdicts, alerts and ack
        self.fanout = Fanout()
        # Live events are counted from 0: the replayed ones count towards the first snapshot too.
        self.snapshots = Snapshots(
            store, snapshot_every if rebuild else 0, -rebuilt, self.counters, snapshot.settings(self.fresh())
        )
        self.writer: Writer = writer if writer is not None else InlineWriter(store)
        gc.freeze()
        self.loop = asyncio.new_event_loop()  # the gRPC server runs on it too (service.py)
        self.pipeline = Ingest(
            self.ledgers,
            self.ruleset,
            self.writer,
            self.commands,
            self.fanout,
            self.snapshots,
            self.latencies,
            self.counters,
            self.loop,
            self.seen,
        )
        self.nodes = Nodes()  # each node's stream, its agent's last word, its batches' rate and lag
        self.receipts: Receipts | None = None  # each request's signed receipt (receipt_key)
        if receipt_key is not None:
            self.receipts = self.pipeline.receipts = Receipts(
                receipt_key,
                store,
                self.loop,
                self.pipeline.record,
                self.counters,
                lambda: self.pipeline.ruleset.digest,
                name,
            )
            if rebuild:  # ends whose receipts a stop or a crash left unsigned
                self.receipts.recover(self.ledgers)
        try:
            # Operators' actions; the rule modes they set and the pages quarantined, as stored.
            self.control = Control(self.pipeline, store)
            self.writer.start(
                self.loop, self.pipeline.committed, self.pipeline.failed
            )  # StoreError: no writer
        except BaseException:
            self.loop.close()
            raise
        self._thread = threading.Thread(target=self.loop.run_forever, name="kvguard-daemon", daemon=True)
        self._thread.start()
        # Whether there is room for more: measured before anything is taken, then every second.
        self.room = StoreRoom(
            store.space, store.engine.url.render_as_string(hide_password=True), store_reserve
        )
        self.heartbeat_at = time.monotonic()  # the loop's last turn of its heartbeat (start_heartbeat)
        self.bus: BusIntake | None = None  # its intake on the bus, if it is on one (daemon/bus.py)

    def fresh(self) -> Ledger:
        """An empty ledger with the daemon's settings and limits."""
        return Ledger(clock_skew_ns=self.clock_skew_ns, limits=self.limits)

    @property
    def ledger(self) -> Ledger:
        """The ledger of every node off the bus (cell WHOLE)."""
        return self.ledgers.of(WHOLE)

    def _replay(
        self, ledger: Ledger, batches: Iterable[tuple[str, wire.Batch, int]], counts: Counter[str]
    ) -> int:
        """Apply stored events again to `ledger`, judging none (their verdicts are stored
        already): the state they left, rebuilt; returns how many, counting in `counts`. An
        event the ledger refuses now (a store edited, or written by another version) is said
        and skipped, so that one stored event cannot stop every start."""
        rebuilt = 0
        ledger.limits = UNBOUNDED  # what was applied once is applied again
        try:
            for node, batch, skip in batches:
                for i, exc in ledger.replay(batch, node, skip):
                    if exc.kind == "repeat":  # stored twice (a snapshot's nodes read again)
                        counts["replay_known"] += 1
                        continue
                    counts["replay_refused"] += 1
                    if counts["replay_refused"] <= REPLAY_REFUSALS_SAID:
                        epoch, seq = batch.position(i)
                        log.warning(
                            f"stored event seq {seq} (epoch {epoch}) of node {node} cannot be "
                            f"applied again ({exc}); skipped: see `kvguard audit verify`"
                        )
                self.seen.record(node, batch, skip, len(batch))
                rebuilt += len(batch) - skip
        finally:
            ledger.limits = self.limits
        return rebuilt

    async def adopt(self, cell: str, nodes: Collection[str], start: CellStart | None = None) -> Ledger:
        """Take over `cell` (on the bus) with `nodes`: its ledger from its snapshot `start`
        (None, or one lacking a node that stored events before it: empty) and the events of its
        nodes stored after it, applied again off the loop as another daemon applied them, so
        that what comes next is judged on their state and what is stored already is a repeat;
        the ends its last daemon left unsigned get their receipts. Then in use (on the loop);
        returns it."""
        loop = asyncio.get_running_loop()
        counts: Counter[str] = Counter()
        ledger = start.ledger if start is not None else self.fresh()

        def rebuild() -> int:
            nonlocal ledger
            through, held = (start.through, start.nodes) if start is not None else (0, frozenset[str]())
            if start is not None and not self.store.snapshot_covers(held, through, nodes):
                counts["cell_snapshots_partial"] += 1  # a node it lacks stored events before it
                log.warning(
                    f"bus: cell {cell}'s snapshot lacks a node that stored events before it: rebuilt whole"
                )
                ledger, through, held = self.fresh(), 0, frozenset()
            stored = self.store.event_batches(after=through, nodes=set(nodes) | set(held))
            rebuilt = self._replay(ledger, stored, counts)
            if self.receipts is not None:  # ends its last daemon left unsigned
                self.receipts.recover(Ledgers(self.fresh, ledger), set(nodes) | set(held))
            return rebuilt

        rebuilt = await loop.run_in_executor(None, rebuild)
        with self.pipeline.lock:
            self.ledgers.put(cell, ledger)
            for name, node in ledger.nodes.items():
                self.pipeline.durable[name] = (node.epoch, node.durable_seq)
        self.counters.update(counts)
        self.counters["adopted_events"] += rebuilt
        return ledger

    def release(self, cell: str, ledger: Ledger) -> None:
        """The cell is no longer this daemon's (on the loop, once what was taken of it is
        applied): its ledger is freed."""
        with self.pipeline.lock:
            self.ledgers.drop(cell, ledger)

    def start_heartbeat(self, every: float) -> None:
        """Let the loop note the time at least every `every` seconds, in `heartbeat_at`: what
        the watchdog reads to tell a loop that goes round from one that is stuck."""

        def beat() -> None:
            self.heartbeat_at = time.monotonic()
            self.loop.call_later(every, beat)

        self.loop.call_soon_threadsafe(beat)

    def _on_loop(self, call: Callable[[], T]) -> T:
        """`call()` run on the daemon's loop, from another thread; its result."""
        done: Future[T] = Future()

        def run() -> None:
            try:
                done.set_result(call())
            except BaseException as exc:  # handed to the caller's thread
                done.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return done.result(ON_LOOP_TIMEOUT_S)

    def reload_rules(self, path: Path | None) -> RulesChange:
        """Load the rules at `path` (None: the bundled ones) on the calling thread, then swap
        them in whole on the loop: the next finding is judged by them. RulesetError if they do
        not load: the rules in force stay, and the daemon's critical alert saying so is stored
        (and sent to subscribers) before this raises."""
        try:
            ruleset = load_ruleset(path)
        except RulesetError as exc:
            where = str(path) if path is not None else "the bundled rules"
            self.refuse_reload(f"rules reload from {where}", [str(e) for e in exc.errors], rules=where)
            raise
        change = rules_change(self.ruleset, ruleset)

        def swap() -> None:
            self.ruleset = self.pipeline.ruleset = self.control.ruleset = ruleset

        self._on_loop(swap)
        self.counters["reloads"] += 1
        return change

    def refuse_reload(self, what: str, errors: list[str], **details: str) -> None:
        """A reload (of the rules, or of the configuration) was refused for `errors`: count it
        and store the daemon's critical alert saying what and why, sent like any finding."""
        self.counters["reloads_refused"] += 1
        more = f" and {len(errors) - 1} more" if len(errors) > 1 else ""
        alert = Finding(
            finding="internal",
            ts_ns=time.time_ns(),
            message=f"{what} refused: {errors[0]}{more}; the previous settings stay in force",
            details={**details, "errors": "\n".join(errors)},
            severity="critical",
            action="alert",
            rule=RELOAD_FAILED_RULE,
            tags=("kvguard",),
        )
        with contextlib.suppress(TimeoutError):  # a loop that is late stores it when it goes round
            self._on_loop(lambda: self.pipeline.alert(alert)).result(ON_LOOP_TIMEOUT_S)

    @property
    def mode(self) -> str:
        return self.commands.mode

    def ingest(self, batch: Batch) -> None:
        """Take a node's batch (on the daemon's loop): see Ingest.ingest."""
        self.pipeline.ingest(batch)

    def connect(self, node: str, send: Reply) -> bool:
        return self.commands.connect(node, send)

    def disconnect(self, node: str, send: Reply) -> None:
        self.commands.disconnect(node, send)

    def send_command(self, node: str, command: svc.Command) -> None:
        self.commands.send(node, command)

    def durable_seq(self, node: str) -> int:
        """The last sequence number of `node`'s current epoch that the store holds (0: none)."""
        return self.durable(node)[1]

    def durable(self, node: str) -> tuple[int, int]:
        """The last (epoch, seq) of `node` that the store holds ((0, 0): none)."""
        return self.pipeline.durable.get(node, (0, 0))

    def save_snapshot(self) -> int:
        """Store the ledger's state as of the last committed record (off the bus; call once
        the loop has stopped and the writer has committed everything); returns that record."""
        return self.store.save_snapshot(snapshot.dump(self.ledger))

    def close(self, timeout: float = 60) -> None:
        """Commit what was applied, then stop the loop (call from another thread, after the
        server stops and before the writer closes). Acks of that last work reach no stream;
        the agents resend it and the ledger answers with repeats."""
        if self._thread.is_alive():
            with contextlib.suppress(TimeoutError):
                asyncio.run_coroutine_threadsafe(self.pipeline.drain(), self.loop).result(timeout)
                if self.receipts is not None and self.receipts.flush(timeout):  # the last ends' receipts
                    asyncio.run_coroutine_threadsafe(self.pipeline.drain(), self.loop).result(timeout)
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=10)
        # A periodic snapshot still being built is not waited for: the daemon saves its own at
        # a clean stop (save_snapshot), after all of it. Its worker is killed: none outlives the daemon.
        self.snapshots.close()
        self.snapshots.join(timeout=10)
        self.room.close()
        if self.receipts is not None:
            self.receipts.close()

    def fleet(self, own: bool = False) -> svc.FleetState:
        """The fleet as the daemon sees it: every node (with events, or a stream or its agent's
        word since the daemon started) and its pools, the counts, the store's room and the
        daemon's own latencies. On the bus, the nodes of other daemons' cells too, as they
        last said (`own`: this daemon's only)."""
        live = self.nodes.read()
        now = time.time_ns()
        with self.pipeline.lock:
            ledgers = self.ledgers
            known = ledgers.nodes()
            state = svc.FleetState(
                requests=ledgers.known_requests, events=self.counters["events"], now_ns=now, mode=self.mode
            )
            for name in sorted(known.keys() | live.keys()):
                ns = state.nodes.add(node=name, connected=name in self.commands.outboxes)
                seen = live.get(name)
                if seen is not None:
                    seen.fill(ns, now)
                node = known.get(name)
                if node is None:
                    continue
                ns.last_seq, ns.last_ts_ns, ns.dropped = node.last_seq, node.last_ts_ns, node.dropped
                ns.epoch, ns.restarts = node.epoch, node.restarts
                for pool in node.pools.values():
                    ns.pools.add(node=name, report=pool.report, pages_in_use=int((pool.pages.use > 0).sum()))
            for kind, n in ledgers.findings().items():
                state.findings[kind] = n
            judged = dict.fromkeys(
                ((k, r.id, r.severity) for r in self.pipeline.ruleset.rules if r.enabled for k in r.kinds), 0
            )
            judged.update(self.pipeline.judged)
            for (kind, rule_id, severity), n in sorted(judged.items()):
                state.judged.add(kind=kind, rule=rule_id, severity=severity, count=n)
            for name, n in self.counters.items():
                state.counters[name] = n
            if self.bus is not None:
                self.bus.view.fill(state, own)
            # What the ledger could not see or judge, and what it retired and forgot.
            for name, n in ledgers.totals().items():
                state.counters[f"ledger_{name}"] = n
        state.store.CopyFrom(self.room.state())
        if self.receipts is not None:
            state.receipt_key = self.receipts.public_pem
        for took in self.latencies.summaries():
            state.latencies.add(
                stage=took.stage,
                count=took.count,
                p50_ms=took.p50_s * 1e3,
                p99_ms=took.p99_s * 1e3,
                max_ms=took.max_s * 1e3,
            )
        return state

    def pool_map(self, node: str, pool: int) -> svc.PoolMap:
        """One pool of one node, page by page (pool_map.py); PoolNotFound naming what is not.
        The ledger is read under the ingest's lock, the message built after."""
        with self.pipeline.lock:
            ledger = self.ledgers.holding(node)
            elsewhere = self.bus.view.holder(node) if self.bus is not None else None
            if ledger is None and elsewhere:
                raise PoolNotFound(
                    f"node {node!r} is judged by daemon {elsewhere} on the bus: its pool map is there"
                )
            if ledger is None:
                names = ", ".join(sorted(self.ledgers.nodes())[:20]) or "none"
                raise PoolNotFound(f"node {node!r} is not known to the daemon's ledger (its nodes: {names})")
            epoch = ledger.nodes[node].epoch
            picture = read_pool(ledger, node, pool, self.commands.quarantined.of(node, pool, epoch))
        return picture.message()

    def rules(self) -> svc.RulesState:
        """The rules, each with the mode it is applied in (control.py)."""
        return self.control.rules()
