"""The daemon's intake from the bus (`BusIntake`), on the daemon's loop: the cells it leases,
each read from the cluster's JetStream stream by a durable pull consumer of its own, batches
into the ingest as a node's gRPC stream would bring them; commands back on each node's
command subject; nodes' statuses heard on theirs (proto/bus.py names them all).

Which daemon judges a cell is a lease (the KV bucket's key `cell.<cell>`, which lapses
LEASE_S after its last renewal): a daemon takes unleased cells up to its share (the cells
over the daemons alive, `daemon.<name>` keys that lapse the same way), gives back what is over
its share when another daemon joins, and lets go of a cell it could not renew for half a
lease, before any other daemon may take it.

Invariants: a cell is judged by one daemon at a time, as far as its lease says (a daemon
stalled for longer than half a lease may judge on until it next looks: leases assume that
timers run); a taken cell's nodes are first rebuilt from the audit store, shared by every
daemon (Daemon.adopt: judged by nobody again), and its consumer restarts after the last
batch every daemon before acknowledged, so what was delivered and not acknowledged comes
again, and what of it is stored already is a repeat; a batch is acknowledged to JetStream
only once the store holds it (its ack from the ingest), so the stream keeps what no store
holds; a cell is given back only once what was taken of it is stored.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import math
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from google.protobuf.message import DecodeError

from kvguard.daemon.bus_view import FleetView
from kvguard.daemon.cell_snapshots import CellSnapshots
from kvguard.daemon.ingest import Batch
from kvguard.daemon.service import GUARD_STATES, MAX_BATCH, MAX_STATUS_BYTES
from kvguard.ledger import Ledger
from kvguard.proto import bus, wire
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.logs import logger

if TYPE_CHECKING:
    from kvguard.daemon.daemon import Daemon

log = logger("daemon")

LEASE_S = 10.0  # a cell's lease (and a daemon's word that it is alive) lapses this long after renewal
MAX_AGE_S = 7 * 86400.0  # how long the stream keeps events (a daemon must have stored them by then)
FETCH = 256  # messages (batches) fetched at once
IN_FLIGHT = 256  # a cell's batches taken and not yet stored: its consumer waits beyond
ACK_WAIT_S = 120.0  # a batch delivered and not acknowledged in this long is delivered again
START_TRIES = 20  # making the stream and the bucket, half a second apart


@dataclass(eq=False)
class Cell:
    """A cell this daemon holds: its lease's revision, its sources and what is in flight."""

    name: str
    revision: int
    renewed: float  # time.monotonic() of the last renewal
    sources: set[str] = field(default_factory=set)
    in_flight: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(IN_FLIGHT))
    pending: int = 0  # batches taken and not yet stored
    ledger: Ledger | None = None  # its own, once taken (Daemon.adopt)
    taken: int = 0  # events taken since it was
    snapshot_at: int = 0  # ... when its last snapshot was begun
    task: asyncio.Task[None] | None = None
    stopping: bool = False  # read no more of it
    leaving: bool = False  # being given back (renewed until it is)


async def make_stream(js: Any, settings: bus.BusSettings, max_age_s: float = MAX_AGE_S) -> None:
    """The cluster's stream, made (or brought to these settings) as the daemons need it."""
    from nats.js.api import StorageType, StreamConfig

    config = StreamConfig(
        name=bus.stream_name(settings.cluster),
        subjects=[f"{bus.ROOT}.{settings.cluster}.>"],
        num_replicas=settings.replicas,
        storage=StorageType.FILE,
        allow_direct=True,
        max_age=max_age_s,
    )
    try:
        await js.add_stream(config)
    except Exception as exc:  # there, with other settings: brought to these
        if "already in use" not in str(exc):
            raise
        await js.update_stream(config)


def _rank(cell: str, daemon: str) -> bytes:
    """Rendezvous hashing: each daemon tries cells in its own order, so daemons that start
    together mostly try different cells first."""
    return hashlib.blake2b(f"{cell}\0{daemon}".encode(), digest_size=8).digest()


class BusIntake:
    def __init__(
        self,
        daemon: Daemon,
        settings: bus.BusSettings,
        name: str,
        lease_s: float = LEASE_S,
        max_age_s: float = MAX_AGE_S,
        snapshot_every: int = 0,
    ) -> None:
        self.daemon = daemon
        self.snapshot_every = snapshot_every  # a cell's events taken after which its snapshot is due
        self.settings = settings
        self.name = name
        self.lease_s = lease_s
        self.max_age_s = max_age_s
        self.cluster = settings.cluster
        self.stream = bus.stream_name(settings.cluster)
        self.cells: dict[str, Cell] = {}
        self.counters: Counter[str] = daemon.counters
        self._nc: Any = None
        self._js: Any = None
        self._kv: Any = None
        self.snapshots: CellSnapshots | None = None  # once connected
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        self._tasks: set[asyncio.Future[Any]] = set()  # acks and publishes under way
        self._draining: dict[str, Cell] = {}  # cells let go whose batches taken are not all stored
        self.view = FleetView(name, self.counters)  # the fleet beyond its cells, for its fleet state
        daemon.bus = self  # its fleet state says the cells (view.fill)

    # ------------------------------------------------------------------ start, stop

    def start(self, timeout: float = 30.0) -> None:
        """Connect, make the stream and the lease bucket if they are not there, and begin
        taking cells (from another thread than the daemon's loop)."""
        asyncio.run_coroutine_threadsafe(self._start(), self.daemon.loop).result(timeout)

    async def _start(self) -> None:
        async def error(exc: Exception) -> None:
            log.warning(f"bus: {exc}")

        self._nc = await self.settings.connect(f"kvguard-daemon {self.name}", error_cb=error)
        self._js = self._nc.jetstream()
        for attempt in range(START_TRIES):  # servers still electing, daemons making them at once
            try:
                await make_stream(self._js, self.settings, self.max_age_s)
                self._kv = await self._bucket()
                break
            except Exception:
                if attempt == START_TRIES - 1:
                    raise
                await asyncio.sleep(0.5)
        self.snapshots = CellSnapshots(
            self.daemon, self._js, self.cluster, self.settings.replicas, self.snapshot_every
        )
        await self._nc.subscribe(f"{bus.CONTROL}.{self.cluster}.*.status", cb=self._status)
        await self._kv.put(f"daemon.{self.name}", self.name.encode())
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _bucket(self) -> Any:
        """The lease bucket, made if it is not there."""
        bucket = bus.bucket_name(self.cluster)
        try:
            return await self._js.key_value(bucket)
        except Exception:
            return await self._js.create_key_value(
                bucket=bucket, ttl=self.lease_s, history=1, replicas=self.settings.replicas
            )

    def close(self, timeout: float = 60.0) -> None:
        """Stop taking batches, let what was taken be stored and acknowledged, give every cell
        back (the next daemon takes them at once), and disconnect."""
        if self._nc is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._close(), self.daemon.loop)
        with contextlib.suppress(TimeoutError):
            future.result(timeout)

    async def _close(self) -> None:
        self._closing = True
        if self._task is not None:
            self._task.cancel()
        for cell in list(self.cells.values()):
            if not cell.leaving:
                cell.leaving = True
                await self._give_back(cell)
        while self.cells:  # those being given back already
            await asyncio.sleep(0.05)
        with contextlib.suppress(Exception):
            await self._kv.delete(f"daemon.{self.name}")
        with contextlib.suppress(Exception):
            await self._nc.close()  # nothing is pending: every cell was given back

    # ------------------------------------------------------------------ leases

    async def _run(self) -> None:
        every = self.lease_s / 4
        await asyncio.sleep(every)  # daemons that start together see one another first
        while not self._closing:
            try:
                await self._turn()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the bus down, a timeout: the next turn tries again
                self.counters["bus_turn_failed"] += 1
                log.warning(f"bus: {type(exc).__name__} {exc}".rstrip())
            await asyncio.sleep(every)

    async def _turn(self) -> None:
        """Renew what is held, say this daemon is alive, then take or give back cells."""
        now = time.monotonic()
        for cell in list(self.cells.values()):
            try:
                cell.revision = await self._kv.update(
                    bus.lease_key(cell.name), self.name.encode(), last=cell.revision
                )
                cell.renewed = time.monotonic()
            except Exception as exc:
                lost = "wrong last sequence" in str(exc).lower()
                if lost or now - cell.renewed > self.lease_s / 2:
                    why = "another daemon holds its lease" if lost else "its lease could not be renewed"
                    log.warning(f"bus: cell {cell.name} let go: {why}")
                    self.counters["cells_lost"] += 1
                    await self._let_go(cell)
        await self._kv.put(f"daemon.{self.name}", self.name.encode())
        keys = await self._keys()
        await self.view.say(self._kv, keys, self.daemon.fleet(own=True), self._nc.max_payload)
        self._snapshot_due()
        cells = await self._cells()
        alive = max(1, sum(1 for k in keys if k.startswith("daemon.")))
        leased = {k.removeprefix("cell.") for k in keys if k.startswith("cell.")}
        await self.view.look(self._kv, set(self.cells), cells, leased)
        share = math.ceil(len(cells) / alive)
        staying = sorted(
            (c for c in self.cells.values() if not c.leaving), key=lambda c: _rank(c.name, self.name)
        )
        if len(staying) > share:  # a daemon joined: what is over the share goes, as it ranks last here
            for spare in staying[share:]:
                spare.leaving = True
                self._spawn(self._give_back(spare))
            return
        for name in sorted(cells.keys() - self.cells.keys() - leased, key=lambda c: _rank(c, self.name)):
            if len(staying) >= share:
                break
            try:
                revision = await self._kv.create(bus.lease_key(name), self.name.encode())
            except Exception:  # another daemon took it first
                continue
            cell = self.cells[name] = Cell(name, revision, time.monotonic())
            staying.append(cell)
            self._spawn(self._take(cell, cells[name]))  # off the turn: renewals go on meanwhile

    def _snapshot_due(self) -> None:
        """Begin the snapshot of the held cell most overdue for one, if any is (one at a time)."""
        snapshots = self.snapshots
        if snapshots is None or not self.snapshot_every or snapshots.building:
            return
        due = [c for c in self.cells.values() if c.ledger is not None and not c.leaving]
        due = [c for c in due if c.taken - c.snapshot_at >= self.snapshot_every]
        if due:
            cell = max(due, key=lambda c: c.taken - c.snapshot_at)
            cell.snapshot_at = cell.taken
            self._spawn(snapshots.save(cell.name, sorted(cell.sources)))

    async def _keys(self) -> list[str]:
        from nats.js.errors import NoKeysError

        try:
            return list(await self._kv.keys())
        except NoKeysError:
            return []

    async def _cells(self) -> dict[str, set[str]]:
        """Every cell with events in the stream, and the sources (node, node/probe) of each."""
        info = await self._js.stream_info(self.stream, subjects_filter=f"{bus.ROOT}.{self.cluster}.>")
        cells: dict[str, set[str]] = {}
        for subject in info.state.subjects or {}:
            try:
                found = bus.parse_subject(subject)
            except bus.BusError:
                continue
            cells.setdefault(found.cell, set()).add(found.source)
        return cells

    # ------------------------------------------------------------------ cells

    async def _take(self, cell: Cell, sources: set[str]) -> None:
        """Hold the cell (leased): rebuild its nodes from the store, then read it from after
        the last batch any daemon acknowledged. One that cannot be taken is given back."""
        try:
            await self._taking(cell, sources)
        except Exception as exc:
            log.warning(f"bus: cell {cell.name} could not be taken: {type(exc).__name__} {exc}".rstrip())
            self.counters["cells_not_taken"] += 1
            await self._let_go(cell)
            with contextlib.suppress(Exception):
                await self._kv.delete(bus.lease_key(cell.name), last=cell.revision)

    async def _taking(self, cell: Cell, sources: set[str]) -> None:
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
        from nats.js.errors import NotFoundError

        name = cell.name
        started = time.perf_counter()
        while (old := self._draining.get(name)) is not None and old.pending:
            # Taken again before what this daemon took of it before is stored: the store must
            # hold it before the cell is rebuilt from it, or what comes again would be new to
            # the new ledger (and stored twice).
            await asyncio.sleep(0.05)
        start = await self.snapshots.load(name) if self.snapshots is not None else None
        before = self.counters["adopted_events"]
        cell.ledger = await self.daemon.adopt(name, sources, start)
        rebuilt = self.counters["adopted_events"] - before
        if cell.stopping:  # let go while it was being rebuilt
            self.daemon.release(name, cell.ledger)
            return
        durable = bus.consumer_name(name)
        first = None
        try:
            info = await self._js.consumer_info(self.stream, durable)
            first = info.ack_floor.stream_seq + 1
            await self._js.delete_consumer(self.stream, durable)  # a stalled owner's reads end here
        except NotFoundError:
            pass
        config = ConsumerConfig(
            durable_name=durable,
            filter_subject=bus.cell_filter(self.cluster, name),
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=ACK_WAIT_S,
            max_ack_pending=4 * IN_FLIGHT,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if first else DeliverPolicy.ALL,
            opt_start_seq=first,
        )
        await self._js.add_consumer(self.stream, config)
        sub = await self._js.pull_subscribe_bind(durable=durable, stream=self.stream)
        if cell.stopping:  # let go while it was being taken (_let_go releases its ledger)
            return
        cell.task = asyncio.get_running_loop().create_task(self._read(cell, sub))
        self.counters["cells_taken"] += 1
        whence = f"its snapshot after record {start.through} and " if start is not None else ""
        log.info(
            f"bus: cell {name} taken ({len(sources)} sources; from {whence}{rebuilt} stored events "
            f"applied again in {time.perf_counter() - started:.2f} s; "
            f"reading from stream sequence {first or 1})"
        )

    async def _read(self, cell: Cell, sub: Any) -> None:
        """The cell's batches into the ingest, in the stream's order, while it is held."""
        from nats.errors import TimeoutError as NatsTimeout

        while not cell.stopping:
            if self.daemon.room.refusing:  # the stream keeps them until the store has room
                await asyncio.sleep(1.0)
                continue
            try:
                msgs = await sub.fetch(FETCH, timeout=1.0)
            except (TimeoutError, NatsTimeout):
                continue
            except asyncio.CancelledError:
                return
            except Exception as exc:  # its consumer deleted: another daemon took the cell
                if not cell.stopping:
                    log.warning(f"bus: reading cell {cell.name}: {type(exc).__name__} {exc}".rstrip())
                    await asyncio.sleep(1.0)
                continue
            for msg in msgs:
                if cell.stopping:
                    return  # not acknowledged: delivered again to the cell's next daemon
                await cell.in_flight.acquire()
                self._batch(cell, msg)

    def _batch(self, cell: Cell, msg: Any) -> None:
        """One message: a source's batch to the ingest, acknowledged once it is stored."""
        try:
            source = bus.parse_subject(msg.subject).source
            events = wire.decode_batch(msg.data)
            if len(events) > MAX_BATCH:
                raise ValueError(f"batch of {len(events)} events (at most {MAX_BATCH})")
        except (bus.BusError, DecodeError, wire.NotABatch, ValueError) as exc:
            self.counters["bus_malformed"] += 1
            log.warning(f"bus: message {msg.subject} refused: {exc}")
            cell.in_flight.release()
            self._spawn(msg.term())  # never delivered again
            return
        if source not in cell.sources:
            cell.sources.add(source)
            if "/" not in source:  # a guard's node: its commands go to its command subject
                self.daemon.nodes.opened(source)
                self.daemon.connect(source, self._outbox(source))

        def stored(_: svc.DaemonMessage) -> None:
            cell.pending -= 1
            cell.in_flight.release()
            self._spawn(msg.ack())

        cell.pending += 1
        cell.taken += len(events)
        self.daemon.nodes.batch(source, events)
        self.daemon.ingest(Batch(source, events, stored, cell.name))

    def _outbox(self, node: str) -> _Outbox:
        return _Outbox(self, node)

    async def _let_go(self, cell: Cell) -> None:
        """Stop judging the cell now (its lease is gone): what was taken and not stored is
        delivered again to the daemon that holds it."""
        cell.stopping = True
        if cell.task is not None:
            cell.task.cancel()
        for source in cell.sources:
            if "/" not in source:
                self.daemon.disconnect(source, self._outbox(source))
                self.daemon.nodes.closed(source)
        if self.cells.get(cell.name) is cell:
            del self.cells[cell.name]
        self._draining[cell.name] = cell  # until what was taken of it is stored (_release)
        self._spawn(self._release(cell))

    async def _release(self, cell: Cell) -> None:
        """Free the cell's ledger once what was taken of it is applied and stored (a batch
        still in the ingest is judged on it)."""
        while cell.pending:
            await asyncio.sleep(0.05)
        if self._draining.get(cell.name) is cell:
            del self._draining[cell.name]
        if cell.ledger is not None:
            self.daemon.release(cell.name, cell.ledger)

    async def _give_back(self, cell: Cell) -> None:
        """Give the cell back: stop reading it, wait until what was taken of it is stored (and
        acknowledged), then delete its lease."""
        cell.stopping = True
        for _ in range(IN_FLIGHT):  # every batch taken is stored and acknowledged
            await cell.in_flight.acquire()
        await self._let_go(cell)
        with contextlib.suppress(Exception):
            await self._kv.delete(bus.lease_key(cell.name), last=cell.revision)
        self.counters["cells_given_back"] += 1
        log.info(f"bus: cell {cell.name} given back")

    # ------------------------------------------------------------------ control

    async def _status(self, msg: Any) -> None:
        """A node's status, kept where this daemon holds the node's cell."""
        node = bus.untoken(msg.subject.split(".")[3])
        if not any(node in cell.sources for cell in self.cells.values()):
            return
        if len(msg.data) > MAX_STATUS_BYTES:
            self.counters["bus_malformed"] += 1
            return
        try:
            status = svc.NodeStatus.FromString(msg.data)
        except DecodeError:
            self.counters["bus_malformed"] += 1
            return
        if status.guard in GUARD_STATES:
            self.daemon.nodes.said(node, status)

    def publish(self, node: str, message: svc.DaemonMessage) -> None:
        """A command to the node's command subject (from any thread)."""
        if not message.HasField("command") or self._nc is None:
            return
        data = message.command.SerializeToString()
        subject = bus.command_subject(self.cluster, node)
        self.daemon.loop.call_soon_threadsafe(lambda: self._spawn(self._nc.publish(subject, data)))

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run `coro` on the loop without waiting for it (kept referenced until it is done)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)


@dataclass(frozen=True)
class _Outbox:
    """A node's command outbox on the bus; equal for the same node (Commands.disconnect)."""

    intake: BusIntake
    node: str

    def __call__(self, message: svc.DaemonMessage) -> None:
        self.intake.publish(self.node, message)
