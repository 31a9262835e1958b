"""The ledger's limits in a real daemon: a pool report or read event above them is refused
with its reason and counted as `limit`, the rest of the batch kept; a daemon started with lower
limits still replays what its store holds, and bounds only what comes next."""

from __future__ import annotations

from pathlib import Path

import grpc

from kvguard.agents.upstream import AgentStream
from kvguard.cli.process import start_daemon
from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc


def pool(seq: int, num_pages: int, pool_id: int = 0) -> pb.Event:
    report = pb.PoolReport(pool=pool_id, role="colocated", page_size=16, num_pages=num_pages)
    return pb.Event(node="n0", seq=seq, ts_ns=seq, pool=report)


def fleet(channel: grpc.Channel) -> svc.FleetState:
    return svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest(), timeout=10)


def test_reports_and_reads_above_the_limits_are_refused_and_a_restart_under_lower_ones_replays(
    tmp_path: Path,
) -> None:
    store = str(tmp_path / "audit.db")
    first = start_daemon(store, 0, "--max-read-entries", "4")
    try:
        with grpc.insecure_channel(first.address) as channel:
            stream = AgentStream(channel, "n0")
            entries = [pb.ReadEntry(req=f"r{i}", pool=0, pages=[1], tokens=16) for i in range(5)]
            ack = stream.send(
                [
                    pool(1, 1 << 24),
                    pool(1, 2048),
                    pb.Event(node="n0", seq=2, ts_ns=2, read=pb.Read(reads=entries)),
                ]
            )
            assert ack.accepted == 1 and [(r.seq, r.reason) for r in ack.rejected] == [
                (1, "pool: pool 0 of node n0 reports 16777216 pages, above the limit of 4194304 a pool"),
                (
                    2,
                    "read: 5 entries in one read event of node n0, above the limit of 4 (a guard splits a "
                    "larger launch's reads into several events)",
                ),
            ]
            state = fleet(channel)
            assert state.counters["limit"] == 2
            assert [p.report.num_pages for n in state.nodes for p in n.pools] == [2048]
            stream.close()
    finally:
        first.stop()
    second = start_daemon(store, 0, "--max-pages-per-pool", "1024")
    try:
        with grpc.insecure_channel(second.address) as channel:
            state = fleet(channel)
            assert state.counters["rebuilt_events"] + state.counters["snapshot_through"] >= 1
            assert [p.report.num_pages for n in state.nodes for p in n.pools] == [2048]  # replayed
            stream = AgentStream(channel, "n0")
            ack = stream.send([pool(2, 2048, 1), pool(3, 1024, 1)])
            assert ack.accepted == 1 and [r.reason for r in ack.rejected] == [
                "pool: pool 1 of node n0 reports 2048 pages, above the limit of 1024 a pool"
            ]
            stream.close()
    finally:
        second.stop()
