"""A bounded soak of the daemon's faults: 64 simulated nodes stream as agents do (a batch at a
time, resending from what the daemon says is durable whenever a stream breaks) into a daemon
that snapshots every few hundred events and is SIGKILLed three times at random points and
started again on the same store. In the end every event is stored exactly once, every finding
is judged once and is what a local replay of the same events finds, no snapshot failed, and
the newest loads."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
from daemon_helpers import clean_requests, facts, stale_reads, stored_findings

from kvguard.agents.upstream import AgentStream, DaemonRefused
from kvguard.cli.process import Service, start_daemon
from kvguard.daemon.store import Store
from kvguard.ledger import Ledger, snapshot
from kvguard.proto import pb
from kvguard.proto.capture import event_to_json
from kvguard.proto.channel import channel
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset import load_ruleset
from kvguard.ruleset.replay import replay

NODES = 64
BATCH = 20
KILLS = 3
REQUESTS = 60  # a node's: ~16,000 events in all, some 20 s of streaming


def node_events(i: int) -> list[pb.Event]:
    """Node i's stream: a pool, then requests of its own, every third node's with stale reads."""
    node = f"n{i:02d}"
    return stale_reads(node, REQUESTS) if i % 3 == 0 else clean_requests(node, REQUESTS)


def counters(address: str) -> dict[str, int]:
    with channel(address, None) as ch:
        return dict(svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10).counters)


def test_three_sigkills_under_load_lose_and_double_nothing(tmp_path: Path) -> None:
    rng = random.Random(41)
    store = str(tmp_path / "audit.db")
    streams = {f"n{i:02d}": node_events(i) for i in range(NODES)}
    total = sum(len(e) for e in streams.values())
    batches = total // BATCH
    kill_at = sorted(rng.sample(range(batches // 8, batches - batches // 8), KILLS))
    daemon: Service = start_daemon(store, 0, "--snapshot-every", "400")
    port = int(daemon.address.rsplit(":", 1)[1])
    durable = {node: 0 for node in streams}  # what each node's agent was last told is stored
    open_streams: dict[str, AgentStream] = {}
    sent = failures = taken = 0
    try:
        while any(durable[n] < len(e) for n, e in streams.items()):
            for node, events in streams.items():
                if durable[node] >= len(events):
                    continue
                try:
                    stream = open_streams.get(node)
                    if stream is None:
                        stream = open_streams[node] = AgentStream(channel(daemon.address, None), node)
                        durable[node] = max(durable[node], stream.durable_seq)
                    # From what is durable on: what is only applied may be lost with the daemon.
                    ack = stream.send(events[durable[node] : durable[node] + BATCH])
                    assert not ack.rejected, ack.rejected
                    durable[node] = max(durable[node], ack.durable_seq)
                except (grpc.RpcError, DaemonRefused):
                    open_streams.pop(node, None)
                    continue
                sent += 1
                if kill_at and sent == kill_at[0]:
                    kill_at.pop(0)
                    before = counters(daemon.address)
                    failures += before.get("snapshot_failures", 0)
                    taken += before.get("snapshots", 0)
                    daemon.kill()  # SIGKILL: no flush, no snapshot of its own
                    open_streams.clear()
                    daemon = start_daemon(store, port, "--snapshot-every", "400")
        last = counters(daemon.address)
        failures += last.get("snapshot_failures", 0)
        taken += last.get("snapshots", 0)
    finally:
        for stream in open_streams.values():
            stream.close()
        daemon.stop()
    assert not kill_at, "the daemon was not killed three times"
    assert failures == 0
    s = Store(store)
    try:
        stored = [(e.node, e.seq) for e in s.events()]
        newest = s.latest_snapshot()
    finally:
        s.close()
    assert len(stored) == len(set(stored)) == total  # none lost, none doubled
    assert not isinstance(newest, str), newest
    snapshot.load(newest[1])  # the newest snapshot loads
    assert taken >= 1  # taken while the streams went on (how many: as fast as the worker builds them)
    # The same findings as a local replay of every node's events.
    local: list = []
    lines = [event_to_json(e) for events in streams.values() for e in events]
    replay(lines, load_ruleset(), local.append, lambda e: None, Ledger())
    assert facts(stored_findings(store)) == facts(local) and len(local) == REQUESTS * len(range(0, NODES, 3))
