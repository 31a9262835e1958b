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


def test_a_large_refused_event_is_kept_as_a_bounded_prefix_with_its_size_and_digest(tmp_path: Path) -> None:
    import hashlib
    import subprocess
    import sys

    from kvguard.daemon.store import Store
    from kvguard.daemon.store.rows import REFUSAL_BYTES
    from kvguard.proto.channel import channel

    store = str(tmp_path / "audit.db")
    daemon = start_daemon(store)
    events = [pb.Event(node="n0", seq=i, admit=pb.Admit(req=f"r{i}", tenant="x" * 3_000_000)) for i in (1, 2)]
    try:
        with channel(daemon.address, None) as ch:
            stream = AgentStream(ch, "n0")
            ack = stream.send(events)  # refused: a stage that is none (and a tenant over its bound)
            stream.close()
        assert ack.accepted == 0 and len(ack.rejected) == 2
    finally:
        daemon.stop()
    s = Store(store)
    rows = [svc.Refusal.FromString(body) for _, _, body in s.rows(kind="refused")]
    s.close()
    for row, event in zip(rows, events, strict=True):
        whole = event.SerializeToString()
        assert row.event == whole[:REFUSAL_BYTES] and row.size == len(whole)
        assert row.sha256 == hashlib.sha256(whole).digest()
    assert Path(store).stat().st_size < 2 * 2 * REFUSAL_BYTES + (1 << 20)  # not 6 MB of refused bytes
    said = subprocess.run(
        [sys.executable, "-m", "kvguard", "audit", "query", "--store", store, "--kind", "refused"],
        capture_output=True,
        text=True,
    ).stdout
    assert said.count(f"(first {REFUSAL_BYTES} kept; sha256 ") == 2


def test_replay_to_sends_batches_under_the_message_limit_and_refuses_only_an_event_over_it(
    tmp_path: Path,
) -> None:
    import subprocess
    import sys

    from kvguard.daemon.store import Store
    from kvguard.proto.builder import EventLog
    from kvguard.proto.channel import MAX_MESSAGE

    pages = 1 << 20
    log = EventLog()
    log.add("n0", "pool", pool=0, role="colocated", page_size=16, num_pages=pages)
    step = 200_000  # each alloc ~0.8 MB on the wire: together far over the daemon's 16 MiB
    for i in range(pages // step):
        log.add("n0", "admit", req=f"r{i}", tenant="acme", stage="decode")
        log.add("n0", "alloc", req=f"r{i}", pool=0, pages=list(range(i * step, (i + 1) * step)))
    huge = log.add("n0", "admit", req="huge", tenant="acme", stage="decode")
    huge_alloc = log.add("n0", "alloc", req="huge", pool=0, pages=list(range(pages)) * 6)  # ~19 MB alone
    assert huge_alloc.ByteSize() > MAX_MESSAGE and huge.seq
    after = log.add("n0", "free", req="r0", pool=0, pages=list(range(step)))
    capture = tmp_path / "big.jsonl"
    capture.write_text(log.to_jsonl())
    store = str(tmp_path / "audit.db")
    daemon = start_daemon(store)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "kvguard", "replay", str(capture), "--to", daemon.address],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        daemon.stop()
    said = done.stdout + done.stderr
    assert done.returncode == 1 and "Traceback" not in said, said[-2000:]
    assert f"over the daemon's message limit of {MAX_MESSAGE}: not sent" in said
    s = Store(store)
    stored = [e.seq for e in s.events()]
    s.close()
    assert stored == [e.seq for e in log.events if e.seq != huge_alloc.seq]  # all but the one
    assert after.seq in stored
