"""The bus's throughput (issue 43): request-steps/s a simulated fleet is judged at, through 1,
2 and 4 daemons on NATS JetStream, against one daemon fed by the same events over direct gRPC
(the default), side by side in one run, as ratios. Everything runs on this machine: the three
JetStream servers, PostgreSQL (the shared audit store: $KVGUARD_TEST_PG, as the tests take it),
the daemons and the publisher.

The fleet (testbed/fleet.py) is built first: `--cells` cells of one prefill and three decode
nodes. For the bus, the fleet is published to the stream first; then the daemons start together
(they see one another within a quarter lease, before any takes a cell); the clock runs from the
first event stored to the last (what the daemons take, judge and store), so neither the
publisher's speed nor the daemons' start is measured. For gRPC, one
process streams each node's batches to the daemon as an agent does (several in flight), and the
clock runs the same way. Each path's findings are checked to be the fleet's (the same for all).

    python bench/bus.py --cells 64 --ticks 40 --arrivals 4 --length 16
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter, deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))  # the tests' JetStream cluster: bus_cluster.py

from bus_cluster import NatsCluster  # noqa: E402
from sqlalchemy import create_engine, text  # noqa: E402
from sqlalchemy.engine import make_url  # noqa: E402

from kvguard.agents.upstream import AgentStream  # noqa: E402
from kvguard.cli.process import Service, start_daemon  # noqa: E402
from kvguard.daemon.bus import make_stream  # noqa: E402
from kvguard.daemon.store import Store  # noqa: E402
from kvguard.proto import pb  # noqa: E402
from kvguard.proto.channel import channel  # noqa: E402
from kvguard.testbed.fleet import Fleet, fleet, publish  # noqa: E402

PG = os.environ.get("KVGUARD_TEST_PG", "postgresql+psycopg://kvguard:kvguard@127.0.0.1:5432/kvguard_test")
IN_FLIGHT = 4  # batches a node's gRPC stream sends ahead of their acks (as the agent does)


def database() -> str:
    admin = create_engine(PG, isolation_level="AUTOCOMMIT")
    name = f"kvguard_bench_{uuid.uuid4().hex[:10]}"
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return make_url(PG).set(database=name).render_as_string(hide_password=False)


def drop(url: str) -> None:
    admin = create_engine(PG, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'DROP DATABASE IF EXISTS "{make_url(url).database}" WITH (FORCE)'))
    admin.dispose()


def stored(url: str) -> int:
    s = Store(url)
    try:
        return s.count("event")
    finally:
        s.close()


def findings(url: str) -> Counter[tuple[str, str, str]]:
    s = Store(url)
    try:
        found = [pb.Finding.FromString(body) for _, _, body in s.rows(kind="finding")]
    finally:
        s.close()
    return Counter((f.finding, f.node, f.req) for f in found if not f.details.get("update_of"))


def clock(url: str, f: Fleet, timeout: float = 600) -> float:
    """Seconds from the first event stored to the last (polled)."""
    deadline = time.monotonic() + timeout
    while stored(url) == 0:
        assert time.monotonic() < deadline, "nothing stored"
        time.sleep(0.01)
    start = time.monotonic()
    while (n := stored(url)) < f.events:
        assert time.monotonic() < deadline, f"{n} of {f.events} stored"
        time.sleep(0.02)
    return time.monotonic() - start


def caught(found: Counter[tuple[str, str, str]]) -> set[str]:
    """The requests a transfer_mismatch was found for."""
    return {req for kind, _, req in found if kind == "transfer_mismatch"}


def over_grpc(f: Fleet, url: str, tmp: Path) -> tuple[float, Counter[tuple[str, str, str]]]:
    daemon = start_daemon(url, 0, "--audit-head", str(tmp / "grpc-head"), quiet=True)
    try:
        ch = channel(daemon.address, None)
        streams: dict[str, AgentStream] = {}
        sent: dict[str, deque[int]] = {}

        def send() -> None:
            for node, events in f.batches:
                stream = streams.get(node)
                if stream is None:
                    stream = streams[node] = AgentStream(ch, node)
                    sent[node] = deque()
                if len(sent[node]) >= IN_FLIGHT:
                    stream.next_ack()
                    sent[node].popleft()
                stream.post([e.SerializeToString() for e in events])
                sent[node].append(1)

        sender = threading.Thread(target=send)
        sender.start()
        seconds = clock(url, f)
        sender.join()
        for stream in streams.values():
            stream.close()
        ch.close()
        return seconds, findings(url)
    finally:
        daemon.stop()


def over_bus(
    f: Fleet, url: str, nats: NatsCluster, n: int, tmp: Path, lease: float
) -> tuple[float, Counter[tuple[str, str, str]]]:
    cluster = f"bench{n}{uuid.uuid4().hex[:6]}"
    settings = nats.settings(cluster=cluster)

    async def stream() -> None:
        nc = await settings.connect("kvguard-bench")
        await make_stream(nc.jetstream(), settings)
        await nc.close()

    asyncio.run(stream())
    publish(f, settings)  # before the clock: the daemons find the fleet's events waiting
    running: dict[int, Service] = {}

    def start(i: int) -> None:
        args = [*nats.args(cluster=cluster), "--bus-lease", str(lease), "--bus-name", f"daemon-{i}"]
        running[i] = start_daemon(url, 0, *args, "--audit-head", str(tmp / f"{cluster}-{i}"), quiet=True)

    # Started together: they see one another (a quarter lease) before any takes a cell.
    starting = [threading.Thread(target=start, args=(i,)) for i in range(n)]
    try:
        for t in starting:
            t.start()
        seconds = clock(url, f)
        return seconds, findings(url)
    finally:
        for t in starting:
            t.join()
        for d in running.values():
            d.stop()


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--cells", type=int, default=64)
    parser.add_argument("--ticks", type=int, default=40)
    parser.add_argument("--arrivals", type=int, default=4, help="requests a cell admits a tick")
    parser.add_argument("--length", type=int, default=16, help="ticks a request decodes")
    parser.add_argument("--daemons", default="1,2,4")
    parser.add_argument("--lease", type=float, default=4.0)
    args = parser.parse_args()
    f = fleet(args.cells, ticks=args.ticks, arrivals=args.arrivals, length=args.length, fault_every=20)
    print(
        f"fleet: {len(f.cells)} cells, {sum(len(n) for n in f.cells.values())} nodes, {f.events} events "
        f"in {len(f.batches)} batches, {f.request_steps} request-steps, {len(f.planted)} planted faults"
    )
    rows: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        nats = NatsCluster(tmp / "nats", "bench", {})
        try:
            url = database()
            try:
                seconds, over = over_grpc(f, url, tmp)
            finally:
                drop(url)
            # gRPC interleaves the nodes of a cell as its streams happen to come (a planted
            # short transfer is then found at its sender or at its receiver); every planted
            # fault is found either way. The bus keeps one order: its runs agree exactly.
            assert caught(over) == set(f.planted), "over gRPC, planted faults went unfound"
            rows.append(("gRPC, 1 daemon", seconds))
            reference: Counter[tuple[str, str, str]] | None = None
            for n in (int(x) for x in args.daemons.split(",")):
                url = database()
                try:
                    seconds, found = over_bus(f, url, nats, n, tmp, args.lease)
                finally:
                    drop(url)
                assert caught(found) == set(f.planted), f"{n} daemon(s): planted faults went unfound"
                reference = reference if reference is not None else found
                assert found == reference, f"{n} daemon(s) judged otherwise than the first run on the bus"
                rows.append((f"JetStream, {n} daemon{'s' if n > 1 else ''}", seconds))
        finally:
            nats.stop()
    base = f.request_steps / rows[0][1]
    print(f"\n{'path':<22} {'seconds':>8} {'M req-steps/s':>14} {'events/s':>10} {'ratio':>6}")
    for label, seconds in rows:
        rate = f.request_steps / seconds
        print(
            f"{label:<22} {seconds:>8.2f} {rate / 1e6:>14.3f} {f.events / seconds:>10.0f} {rate / base:>6.2f}"
        )
    print(f"\nevery planted fault found on every path ({len(f.planted)}); the same findings on every bus run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
