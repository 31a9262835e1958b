"""Past one daemon, for real: a 3-server NATS JetStream cluster, daemons as processes on one
PostgreSQL audit store, a simulated fleet of 256 nodes in 64 prefill/decode cells published
as its agents publish. The fleet is judged alike by 1, 2 and 4 daemons and by one ledger on
the same events; a daemon and a NATS server killed mid-run lose nothing and double nothing;
a cell that moves between a transfer's two ends is judged once."""

from __future__ import annotations

import asyncio
import io
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from agent_helpers import wait_for
from bus_cluster import NatsCluster
from daemon_helpers import stored_findings, stored_records

from kvguard.cli.fleet import render
from kvguard.cli.process import Service, start_daemon
from kvguard.daemon.store import Store
from kvguard.ledger import Ledger
from kvguard.proto import bus, pb, receipt
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset import load_ruleset
from kvguard.testbed.fleet import Fleet, fleet, publish

LEASE = "2"  # seconds: a lost daemon's cells move this soon


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsCluster]:
    cluster = NatsCluster(tmp_path / "nats", "t", {"host-a": ["d0", "p0"]})
    yield cluster
    cluster.stop()


def daemons(
    nats: NatsCluster,
    store: str,
    n: int,
    tmp: Path,
    first: int = 0,
    cluster: str = "",
    more: tuple[str, ...] = (),
) -> list[Service]:
    tmp.mkdir(parents=True, exist_ok=True)
    return [
        start_daemon(
            store,
            0,
            *nats.args(cluster=cluster),
            "--bus-lease",
            LEASE,
            "--bus-name",
            f"daemon-{i}",
            "--audit-head",
            str(tmp / f"head-{i}"),
            *more,
            quiet=True,
        )
        for i in range(first, first + n)
    ]


def stored_events(store: str) -> Counter[tuple[str, int, int]]:
    """Each stored event's (node, epoch, seq), with how often it is stored."""
    s = Store(store)
    try:
        events = [pb.Event.FromString(body) for _, _, body in s.rows(kind="event")]
    finally:
        s.close()
    return Counter((e.node, e.epoch, e.seq) for e in events)


def verdicts(findings: list[pb.Finding] | list) -> Counter[tuple[str, str, str, str]]:
    return Counter((f.finding, f.rule, f.node, f.req) for f in findings)


def one_ledger(f: Fleet) -> Counter[tuple[str, str, str, str]]:
    """The verdicts of one ledger on the fleet's events, in the stream's order."""
    ledger, rules, found = Ledger(), load_ruleset(), []
    for _, events in f.batches:
        for event in events:
            for finding in ledger.apply(event):
                judged = rules.evaluate(finding)
                if judged is not None:
                    found.append(judged)
    return verdicts(found)


def finished_on_decode(store: str) -> set[str]:
    """The requests that finished on a decode node (where their clients are answered)."""
    s = Store(store)
    try:
        events = [pb.Event.FromString(body) for _, _, body in s.rows(kind="event")]
    finally:
        s.close()
    return {e.finish.req for e in events if e.WhichOneof("payload") == "finish" and e.node.startswith("d")}


def stored_count(store: str) -> int:
    s = Store(store)
    try:
        return s.count("event")
    finally:
        s.close()


def all_stored(store: str, f: Fleet, timeout: float = 120) -> Counter[tuple[str, int, int]]:
    assert wait_for(lambda: stored_count(store) >= f.events, timeout=timeout), (
        f"{stored_count(store)} of {f.events} events stored"
    )
    time.sleep(0.5)  # anything stored twice would show by now
    return stored_events(store)


def alive(nats: NatsCluster, cluster: str) -> int:
    """How many daemons say they are alive on the bus of kvguard cluster `cluster`."""

    async def count() -> int:
        nc = await nats.settings().connect("kvguard-test")
        try:
            kv = await nc.jetstream().key_value(bus.bucket_name(cluster))
            return sum(1 for key in await kv.keys() if key.startswith("daemon."))
        except Exception:
            return 0
        finally:
            await nc.close()

    return asyncio.run(count())


def alerts(daemon: Service, count: int, timeout: float = 30) -> list[svc.Alert]:
    """The first `count` alerts of the daemon's alert stream, from the start."""
    got: list[svc.Alert] = []
    with grpc.insecure_channel(daemon.address) as channel:
        for alert in svc_grpc.AlertServiceStub(channel).Subscribe(svc.AlertFilter(), timeout=timeout):
            got.append(alert)
            if len(got) == count:
                break
    return got


def fleet_state(daemon: Service) -> svc.FleetState:
    with grpc.insecure_channel(daemon.address) as channel:
        return svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest(), timeout=10)


def test_the_fleet_is_judged_alike_by_one_two_and_four_daemons(
    nats: NatsCluster, pg_databases: Callable[[], str], tmp_path: Path
) -> None:
    f = fleet(64, ticks=14, length=4, fault_every=5)  # 256 nodes in 64 cells
    expected = one_ledger(f)
    assert sum(n for (kind, *_), n in expected.items() if kind == "transfer_mismatch") == len(f.planted) > 0
    for n in (1, 2, 4):
        judged_by(n, nats, f, expected, pg_databases(), tmp_path)


def judged_by(
    n: int, nats: NatsCluster, f: Fleet, expected: Counter[tuple[str, str, str, str]], store: str, tmp: Path
) -> None:
    """The fleet's events, published the same way to a kvguard cluster of their own, judged
    by `n` daemons: all stored once, judged as `expected`, every daemon holding cells."""
    cluster = f"fleet{n}"
    running = daemons(nats, store, n, tmp / cluster, cluster=cluster)
    try:
        assert wait_for(lambda: alive(nats, cluster) == n)  # each takes its share as cells appear
        publish(f, nats.settings(cluster=cluster))
        events = all_stored(store, f)
        assert len(events) == f.events and set(events.values()) == {1}, f"{n} daemon(s): lost or doubled"
        assert verdicts(stored_findings(store)) == expected, f"{n} daemon(s) judged otherwise"
        names = {f"daemon-{i}" for i in range(n)}

        def held() -> set[str]:
            return {c.daemon for c in fleet_state(running[0]).cells}

        assert wait_for(lambda: held() == names), f"{n} daemon(s) hold {held()}"
        state = fleet_state(running[-1])
        assert len(state.cells) == 64 and all(len(c.sources) == 4 for c in state.cells)

        # Any daemon shows every node, each with the daemon that judges it; its own, only its own.
        # (Within a turn a moved cell's nodes may still be said by its former daemon: asked again.)
        def shown_right() -> bool:
            now = fleet_state(running[0])
            holder = {node: c.daemon for c in now.cells for node in c.sources}
            with grpc.insecure_channel(running[0].address) as channel:
                own = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest(own=True), timeout=10)
            mine = {k for k, d in holder.items() if d == "daemon-0"}
            return (
                len(holder) == 256
                and {node.node: node.daemon for node in now.nodes} == holder
                and {node.node for node in own.nodes} == mine
            )

        assert wait_for(shown_right, timeout=60), f"{n} daemon(s): the fleet shown is not every node"
        # Any daemon's alert stream carries every daemon's alerts, once each, in the store's order.
        wanted = [x for x in stored_records(store) if "repeat" not in x.details]
        got = alerts(running[0], len(wanted))
        assert Counter((a.finding.finding, a.finding.node, a.finding.req) for a in got) == Counter(
            (x.finding, x.node, x.req) for x in wanted
        )
        assert [a.cursor for a in got] == sorted({a.cursor for a in got})
        table = io.StringIO()
        render(state, table)  # `kvguard fleet`
        assert f"on the bus as daemon-{n - 1}:" in table.getvalue()
        assert all(f"{c.cell}  {c.daemon}" in table.getvalue() for c in state.cells)
    except BaseException:
        for i, d in enumerate(running):  # what each daemon said, to tell why
            print(f"daemon-{i}:\n{d.stop()[-4000:]}")
        raise
    finally:
        for d in running:
            d.stop()


def test_a_daemon_and_a_nats_server_killed_mid_run_lose_and_double_nothing(
    nats: NatsCluster, pg_store_url: str, tmp_path: Path
) -> None:
    f = fleet(32, ticks=30, length=4, fault_every=5)
    expected = one_ledger(f)
    # Cells' snapshots taken while their events stream in: the cells that move start from them.
    # Receipts signed as requests end: the ends a lost daemon left unsigned, its cells' next signs.
    key = tmp_path / "receipt.key"
    receipt.new_key(key, tmp_path / "receipt.pub")
    more = ("--snapshot-every", "64", "--receipt-key", str(key))
    running = daemons(nats, pg_store_url, 2, tmp_path, more=more)
    publisher = threading.Thread(target=publish, args=(f, nats.settings()))
    publisher.start()
    try:
        assert wait_for(lambda: stored_count(pg_store_url) > f.events // 4, timeout=60)
        running[0].kill()  # SIGKILL: its cells move to the other once their leases lapse
        nats.kill(1)  # and one of the three servers: the stream has two replicas left
        assert wait_for(lambda: stored_count(pg_store_url) > f.events // 2, timeout=60)
        nats.start(1)
        publisher.join(120)
        events = all_stored(pg_store_url, f)
        assert len(events) == f.events and set(events.values()) == {1}, "lost or doubled"
        assert verdicts(stored_findings(pg_store_url)) == expected
        ended = finished_on_decode(pg_store_url)

        def first_receipts() -> Counter[str]:
            s = Store(pg_store_url)
            try:
                bodies = [svc.SignedReceipt.FromString(b).receipt for _, _, b in s.rows(kind="receipt")]
            finally:
                s.close()
            return Counter(r.req for r in map(svc.Receipt.FromString, bodies) if not r.supersedes)

        assert wait_for(lambda: set(first_receipts()) == ended, timeout=30), sorted(
            ended - set(first_receipts())
        )
        assert set(first_receipts().values()) == {1}, "a request with two first receipts"
    finally:
        publisher.join(120)
        for d in running[1:]:
            d.stop()


def test_a_cell_moved_between_a_transfers_two_ends_is_judged_once(
    nats: NatsCluster, pg_store_url: str, tmp_path: Path
) -> None:
    """The short transfer of the incident: daemon A stores the sender's side and dies; daemon B
    takes the cell, rebuilds it from the store, and judges the receiver's side against it:
    one transfer_mismatch, one kill to the decode node, nothing of A's judged again."""
    whole = fleet(1, decodes=1, ticks=12, length=3, fault_every=2)
    nodes = [(node, events) for node, events in whole.batches]
    cut = next(  # just after the planted request's send, before its receipt
        i
        for i, (node, events) in enumerate(nodes)
        if any(e.HasField("xfer_send") and e.xfer_send.req == whole.planted[0] for e in events)
    )
    first, rest = Fleet(whole.cells, nodes[: cut + 1]), Fleet(whole.cells, nodes[cut + 1 :])
    [a] = daemons(nats, pg_store_url, 1, tmp_path)
    commands: list[bytes] = []

    async def listen(stop: threading.Event) -> None:
        nc = await nats.settings().connect("kvguard-test-commands")
        decode = whole.cells["cell000"][1]

        async def heard(msg) -> None:  # type: ignore[no-untyped-def]
            commands.append(msg.data)

        await nc.subscribe(bus.command_subject(nats.cluster, decode), cb=heard)
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await nc.close()

    stop = threading.Event()
    listener = threading.Thread(target=asyncio.run, args=(listen(stop),))
    listener.start()
    b = None
    try:
        publish(first, nats.settings())
        all_stored(pg_store_url, first)
        before = verdicts(stored_findings(pg_store_url))
        a.kill()
        [b] = daemons(nats, pg_store_url, 1, tmp_path, first=1)
        publish(rest, nats.settings())
        events = all_stored(pg_store_url, whole, timeout=60)
        assert set(events.values()) == {1}
        after = verdicts(stored_findings(pg_store_url))
        assert after == one_ledger(whole)
        [mismatch] = [k for k in after if k[0] == "transfer_mismatch" and k[3] == whole.planted[0]]
        assert before[mismatch] == 0 and after[mismatch] == 1  # judged by B, once
        assert all(after[k] == n for k, n in before.items())  # A's verdicts stand, none again
        kills = [
            c for c in map(pb_command, commands) if c.HasField("kill") and c.kill.req == whole.planted[0]
        ]
        assert kills and {k.kill.finding for k in kills} >= {"transfer_mismatch"}
    finally:
        stop.set()
        listener.join(10)
        if b is not None:
            b.stop()


def pb_command(data: bytes) -> svc.Command:
    return svc.Command.FromString(data)


def snapshots_kept(nats: NatsCluster, change: str = "") -> dict[str, bytes]:
    """Each cell's snapshot object on the bus (its whole bytes); with `change`, that cell's
    has its last byte altered first."""

    async def read() -> dict[str, bytes]:
        nc = await nats.settings().connect("kvguard-test-snapshots")
        try:
            objects = await nc.jetstream().object_store(bus.snapshots_name(nats.cluster))
            if change:
                data = bytearray((await objects.get(bus.snapshot_name(change))).data)
                data[-1] ^= 1
                await objects.put(bus.snapshot_name(change), bytes(data))
            return {info.name: (await objects.get(info.name)).data for info in await objects.list()}
        except Exception:  # none yet
            return {}
        finally:
            await nc.close()

    return asyncio.run(read())


def test_a_cell_is_taken_from_its_snapshot_and_an_altered_one_is_refused(
    nats: NatsCluster, pg_store_url: str, tmp_path: Path
) -> None:
    """Daemon A keeps each cell's snapshot in the bus's object store, and dies. Daemon B takes
    the cells from their snapshots and the events stored after them, except the one whose
    snapshot was altered (said, and rebuilt from the store's whole history); the fleet is
    judged as one ledger judges it, every event stored once."""
    whole = fleet(3, ticks=16, length=3, fault_every=4)
    cut = len(whole.batches) // 2
    first, rest = Fleet(whole.cells, whole.batches[:cut]), Fleet(whole.cells, whole.batches[cut:])
    [a] = daemons(nats, pg_store_url, 1, tmp_path, more=("--snapshot-every", "1"))
    b = None
    try:
        publish(first, nats.settings())
        all_stored(pg_store_url, first)
        names = {bus.snapshot_name(cell) for cell in whole.cells}
        assert wait_for(lambda: set(snapshots_kept(nats)) == names, timeout=60), a.stop()[-3000:]
        a.kill()
        kept = snapshots_kept(nats, change="cell001")
        assert set(kept) == names and all(data.startswith(b"KVGCELL 1\n") for data in kept.values())
        [b] = daemons(nats, pg_store_url, 1, tmp_path, first=1)
        publish(rest, nats.settings())
        events = all_stored(pg_store_url, whole, timeout=60)
        assert len(events) == whole.events and set(events.values()) == {1}
        assert verdicts(stored_findings(pg_store_url)) == one_ledger(whole)
        counters = fleet_state(b).counters
        assert counters["cell_snapshots_loaded"] == 2 and counters["cell_snapshots_refused"] == 1
        # The two sound ones spared B their history; the altered one's cell replayed all of its.
        assert 0 < counters["adopted_events"] < first.events
        said = b.stop()
        assert "cell cell001's snapshot not used: the snapshot taken after record" in said
        assert "does not match the chain there; the cell is rebuilt from the audit store" in said
    finally:
        if b is not None:
            b.stop()


def test_the_dashboard_on_any_daemon_shows_the_whole_fleet(
    nats: NatsCluster, pg_store_url: str, tmp_path: Path
) -> None:
    """Two daemons share 4 cells; the dashboard on one of them lists all 16 nodes and says,
    of a node the other judges, which daemon that is."""
    from rich.console import Console
    from textual.widgets import DataTable

    from kvguard.proto.client import DaemonClient
    from kvguard.tui.app import TopApp

    f = fleet(4, ticks=6, length=3, fault_every=3)
    running = daemons(nats, pg_store_url, 2, tmp_path)
    try:
        assert wait_for(lambda: alive(nats, nats.cluster) == 2)
        publish(f, nats.settings())
        all_stored(pg_store_url, f)
        nodes = {n for members in f.cells.values() for n in members}
        assert wait_for(lambda: {n.node for n in fleet_state(running[0]).nodes} == nodes)
        app = TopApp(DaemonClient(running[0].address), label="daemon-0")

        def text() -> str:
            width, height = app.size
            console = Console(width=width, height=height, file=io.StringIO(), record=True, color_system=None)
            console.print(
                app.screen._compositor.render_update(full=True, screen_stack=app._background_screens)
            )
            return " ".join(console.export_text().split())

        async def drive() -> None:
            async with app.run_test(size=(160, 60)) as pilot:
                while app.data.fleet is None or app.screen.query_one("#nodes", DataTable).row_count < 16:
                    await pilot.pause(0.05)
                # The screen is painted a turn after the table fills: wait for what it shows.
                said = r"on the bus as daemon daemon-0: [1-3] of 4 cells, 1 other daemons"
                for _ in range(400):
                    if re.search(said, text()):
                        break
                    await pilot.pause(0.05)
                assert re.search(said, text()), text()
                for _ in range(16):  # down the nodes to one that daemon-1 judges
                    if "judged on the bus by daemon daemon-1" in text():
                        break
                    await pilot.press("down")
                    await pilot.pause()
                assert "judged on the bus by daemon daemon-1: as it last said" in text()

        asyncio.run(asyncio.wait_for(drive(), 60))
    finally:
        for d in running:
            d.stop()
