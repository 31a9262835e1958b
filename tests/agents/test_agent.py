"""Guard -> node agent -> daemon -> store, for real: a Unix socket, a spool on disk, gRPC on
loopback. Every event is stored exactly once through restarts of the agent and the daemon,
and the daemon's kill reaches the guard that owns the request."""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from agent_helpers import leak, stored, wait_for
from daemon_helpers import stored_findings

from kvguard.agents import agent as agent_module
from kvguard.agents.agent import NodeAgent
from kvguard.agents.guard import AgentSink, Guard
from kvguard.agents.spool import Spool
from kvguard.cli.process import Service
from kvguard.cli.process import start_agent as agent_service
from kvguard.cli.process import start_daemon as daemon_service
from kvguard.daemon import service
from kvguard.daemon.daemon import Daemon
from kvguard.daemon.store import Store
from kvguard.daemon.writer import InlineWriter
from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.proto.local import MAX_FRAME, send_frame
from kvguard.ruleset import load_ruleset

RULES = load_ruleset()


def start_daemon(store: str, port: int = 0) -> tuple[Service, str]:
    d = daemon_service(store, port)
    return d, d.address


def start_agent(tmp: Path, address: str) -> Service:
    return agent_service(str(tmp / "agent.sock"), address, str(tmp / "spool"))


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[str, str, Service, Service]]:
    store = str(tmp_path / "audit.db")
    daemon, address = start_daemon(store)
    agent = start_agent(tmp_path, address)
    yield store, address, daemon, agent
    agent.stop()
    daemon.stop()


def traffic(guard: Guard, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        req = f"r{i}"
        pages = [i % 64, (i + 1) % 64]
        guard.admit(req, "acme", 32, "decode")
        guard.alloc(req, 0, pages)
        guard.write(req, 0, pages)
        guard.check_attention(0, [req], np.array([pages]), np.array([32]))
        guard.finish(req, 1)
        guard.free(req, 0, pages)


def test_events_reach_the_store_and_kills_reach_the_guard(tmp_path: Path, cluster) -> None:  # type: ignore[no-untyped-def]
    store, _, _, _ = cluster
    kills: list[tuple[str, str]] = []
    sink = AgentSink(tmp_path / "agent.sock", "d0")
    # The daemon decides here; its kill reaches the engine through the guard's command path.
    guard = Guard(
        "d0", mode="monitor", ruleset=RULES, sink=sink, on_kill=lambda r, why: kills.append((r, why))
    )
    guard.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
    traffic(guard, 20)
    # A leak the monitor-mode guard lets through: the daemon's verdict comes back as a kill.
    leak(guard)  # g1 reads page 40, which holds a1's KV
    assert wait_for(lambda: [req for req, _ in kills] == ["g1"])
    assert "stale_read (stale_read_cross_tenant)" in kills[0][1]
    killed = guard.killed["g1"]
    assert killed is not None and (killed.finding, killed.rule) == ("stale_read", "stale_read_cross_tenant")
    # Every event the guard made reached the store, the record of the kill among them.
    assert sink.flush()
    assert wait_for(lambda: len(stored(store)) == guard._seq)
    events = stored(store)
    assert [e.seq for e in events] == list(range(1, guard._seq + 1))
    assert (events[-1].kill.req, events[-1].kill.by) == ("g1", "daemon")
    sink.close()


def test_nothing_is_lost_or_doubled_when_the_agent_and_the_daemon_die(tmp_path: Path, store_url: str) -> None:
    store = store_url
    daemon, address = start_daemon(store)
    port = int(address.split(":")[1])
    agent = start_agent(tmp_path, address)
    sink = AgentSink(tmp_path / "agent.sock", "d0")
    guard = Guard("d0", ruleset=RULES, sink=sink)
    guard.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
    try:
        traffic(guard, 30)
        assert sink.flush()
        daemon.kill()  # the daemon dies; the agent keeps spooling
        traffic(guard, 30, start=30)
        assert sink.flush()
        time.sleep(0.3)
        agent.kill()  # and the agent dies too, with events only in its spool
        assert (tmp_path / "spool" / "d0.spool").stat().st_size > 0
        daemon, address = start_daemon(store, port)
        agent = start_agent(tmp_path, address)  # a new agent finds the spool
        traffic(guard, 30, start=60)  # the guard's sink reconnects by itself
        assert sink.flush()
        assert wait_for(lambda: len(stored(store)) == guard._seq, timeout=30)
    finally:
        sink.close()
        agent.stop()
        daemon.stop()
    seqs = [e.seq for e in stored(store)]
    assert sorted(seqs) == list(range(1, guard._seq + 1))  # every event, exactly once
    assert Store(store).verify()[0]


def test_an_unreachable_agent_never_blocks_the_engine(tmp_path: Path) -> None:
    sink = AgentSink(tmp_path / "nobody.sock", "d0", capacity=100)
    guard = Guard("d0", ruleset=RULES, sink=sink)
    guard.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
    started = time.monotonic()
    traffic(guard, 50)  # 300 events into a queue of 100, nobody reading
    assert time.monotonic() - started < 5
    assert sink.dropped > 0 and sink.dropped + sink.waiting + sink.sent == guard._seq  # none unaccounted
    before = sink.dropped
    assert guard.heartbeat().ok
    # The heartbeat carries the running count in-band (it may itself be dropped while the
    # queue is full; the next one that gets through carries the total).
    assert guard.ledger.nodes["d0"].dropped == before
    started = time.monotonic()
    assert not sink.flush(timeout=0.3)  # nobody takes them: it says so, in its time, not never
    assert time.monotonic() - started < 3
    threading.Thread(target=sink.close, daemon=True).start()  # close() waits for a connection


class WatchLog:
    """Stands in for the eBPF witness (tests/cuda_hooks/test_witness.py runs the real one): which
    processes the agent watches, under which node."""

    available = True
    unlabelled_posts = 0

    def __init__(self) -> None:
        self.watched: dict[int, str] = {}

    def watch(self, pid: int, name: str) -> None:
        self.watched[pid] = name

    def unwatch(self, pid: int) -> None:
        self.watched.pop(pid, None)

    def close(self) -> None:
        pass


def test_the_agent_welcomes_a_guard_only_once_it_watches_the_engine(tmp_path: Path) -> None:
    # An engine must not open a transfer connection before the agent's witness watches it (a
    # connection opened before cannot be followed): the agent answers the hello when it does.
    sink = AgentSink(tmp_path / "agent.sock", "d0")  # nothing sent: the sink connects at once
    assert not sink.wait_ready(0.3)  # no agent yet
    agent = NodeAgent(tmp_path / "agent.sock", "127.0.0.1:1", tmp_path / "spool")
    watch_log = agent.witness = WatchLog()
    threading.Thread(target=agent.serve, daemon=True).start()
    try:
        assert sink.wait_ready(20)
        assert watch_log.watched == {os.getpid(): "d0"}  # watched before the welcome, as promised
        sink.close()  # the guard goes: its process is no longer watched
        assert wait_for(lambda: watch_log.watched == {})
        assert not sink.ready.is_set()
    finally:
        agent.stop()


def test_a_guard_is_watched_again_as_soon_as_a_new_agent_serves(tmp_path: Path) -> None:
    # The agent restarts (an upgrade, a crash): the new one must watch the engine before its
    # next transfer, so the sink dials again at once, not at the engine's next event.
    sink = AgentSink(tmp_path / "agent.sock", "d0")
    try:
        for _ in range(2):
            agent = start_agent(tmp_path, "127.0.0.1:1")  # no daemon needed: nothing is sent
            try:
                assert sink.wait_ready(20)  # no event was put: the sink came by itself
            finally:
                agent.kill()  # a crash: its sockets close with it
            assert wait_for(lambda: not sink.ready.is_set())
        assert sink.sent == 0
    finally:
        sink.close()


def test_a_sink_that_never_found_its_agent_closes_at_once(tmp_path: Path) -> None:
    sink = AgentSink(tmp_path / "nobody.sock", "d0")
    started = time.monotonic()
    sink.close()
    assert time.monotonic() - started < 2 and not sink.ready.is_set()


def test_batches_stay_under_the_daemons_message_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Long contexts make big events: the agent cuts its batches by bytes, not only by count,
    # and an event the daemon could never take is dropped with a reason and a count rather
    # than resent forever. (Limits scaled down: 4 KiB messages, 2 KiB batches.)
    monkeypatch.setattr(agent_module, "MAX_MESSAGE", 4096)
    monkeypatch.setattr(agent_module, "MAX_BATCH_BYTES", 2048)
    store = str(tmp_path / "audit.db")
    daemon, address = start_daemon(store)
    agent = NodeAgent(tmp_path / "agent.sock", address, tmp_path / "spool")
    threading.Thread(target=agent.serve, daemon=True).start()
    try:
        sink = AgentSink(tmp_path / "agent.sock", "d0")
        guard = Guard("d0", mode="monitor", ruleset=RULES, sink=sink)
        guard.pool(0, "decode", page_size=16, num_pages=16384, context_len=1 << 18)
        for i in range(12):  # ~1 KiB each: 12 events that no 2 KiB batch holds together
            guard.alloc(f"r{i}", 0, list(range(4096 + 400 * i, 4096 + 400 * (i + 1))))
        guard.alloc("huge", 0, list(range(1000, 3200)))  # ~4.4 KiB: over the limit
        guard.alloc("after", 0, [1])
        assert sink.flush()
        assert wait_for(lambda: len(stored(store)) == guard._seq - 1)
        kept = stored(store)
        assert [e.alloc.req for e in kept[1:]] == [*(f"r{i}" for i in range(12)), "after"]
        assert agent.counters["oversized"] == 1
        assert agent.counters["acked"] == guard._seq - 1
        sink.close()
    finally:
        agent.stop()
        daemon.stop()


def test_the_spool_hands_out_batches_by_count_and_by_bytes(tmp_path: Path) -> None:
    spool = Spool(tmp_path, "d0")
    events = [
        pb.Event(node="d0", seq=i + 1, alloc=pb.Alloc(req=f"r{i}", pool=0, pages=range(100 * i, 100 * i + n)))
        for i, n in enumerate([300, 300, 300, 2000, 10])
    ]
    bodies = [e.SerializeToString() for e in events]
    spool.append(bodies, [(0, e.seq) for e in events])
    sizes = [len(b) for b in bodies]
    # the bytes as given
    assert spool.take(10, sizes[0] + sizes[1], timeout=0) == ([(0, 1), (0, 2)], bodies[:2])
    assert spool.take(2, 1 << 20, timeout=0)[0] == [(0, 1), (0, 2)]
    # Sent ahead of their acks: the next take starts after the last event sent.
    assert spool.take(2, 1 << 20, timeout=0, after=(0, 2))[0] == [(0, 3), (0, 4)]
    spool.ack((0, 3))
    assert spool.take(10, 100, timeout=0)[0] == [(0, 4)]  # alone, however big
    # Nothing beyond what was sent: a take waits, until wake() (an ack came) ends it early.
    threading.Timer(0.2, spool.wake).start()
    started = time.monotonic()
    assert spool.take(10, 1 << 20, timeout=30, after=(0, 5)) == ([], [])
    assert time.monotonic() - started < 10
    # Ahead of an ack, a few events wait a little (AHEAD_AFTER_S), not for the ack.
    sixth = pb.Event(node="d0", seq=6, alloc=pb.Alloc(req="r6", pool=0, pages=[1])).SerializeToString()
    spool.append([sixth], [(0, 6)])
    assert spool.take(10, 1 << 20, timeout=0, after=(0, 5), ahead=True) == ([], [])
    started = time.monotonic()
    assert spool.take(10, 1 << 20, timeout=30, after=(0, 5), ahead=True)[0] == [(0, 6)]
    assert time.monotonic() - started < 10
    spool.close()
    again = Spool(tmp_path, "d0")  # after a restart: the same events, from the file
    again.ack((0, 3))  # what the daemon's hello says it has
    assert again.take(10, sizes[3] + sizes[4], timeout=0) == ([(0, 4), (0, 5)], bodies[3:5])
    again.close()


def test_a_restarted_engines_events_are_not_taken_for_ones_the_daemon_has(tmp_path: Path) -> None:
    # The engine restarted: its new epoch numbers its events from 1 again. The daemon holding
    # (epoch 0, seq 3) of the old run says nothing of the new run's seq 1 and 2.
    spool = Spool(tmp_path, "d0")
    old = [pb.Event(node="d0", seq=i, heartbeat=pb.Heartbeat()).SerializeToString() for i in (1, 2, 3)]
    new = [pb.Event(node="d0", seq=i, epoch=7, heartbeat=pb.Heartbeat()).SerializeToString() for i in (1, 2)]
    spool.append(old + new, [(0, 1), (0, 2), (0, 3), (7, 1), (7, 2)])
    spool.ack((0, 3))
    assert spool.take(10, 1 << 20, timeout=0) == ([(7, 1), (7, 2)], new)
    spool.close()
    again = Spool(tmp_path, "d0")  # read back from the file: the positions from the bytes
    again.ack((0, 2))
    assert again.take(10, 1 << 20, timeout=0)[0] == [(0, 3), (7, 1), (7, 2)]
    again.ack((7, 1), {(7, 2)})
    assert again.take(10, 1 << 20, timeout=0) == ([], [])
    again.close()


def test_the_local_socket_refuses_bad_guards_and_keeps_serving(tmp_path: Path) -> None:
    store = str(tmp_path / "audit.db")
    daemon, address = start_daemon(store)
    agent = NodeAgent(tmp_path / "agent.sock", address, tmp_path / "spool")
    threading.Thread(target=agent.serve, daemon=True).start()
    try:
        assert wait_for(lambda: (tmp_path / "agent.sock").exists())

        def connect() -> socket.socket:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(str(tmp_path / "agent.sock"))
            return sock

        garbage = connect()  # not a protobuf message
        garbage.sendall(struct.pack(">I", 5) + b"\xff\xff\xff\xff\xff")
        huge = connect()  # a frame over the limit, announced
        huge.sendall(struct.pack(">I", MAX_FRAME + 1))
        nameless = connect()  # a hello without a node
        send_frame(nameless, svc.AgentMessage(hello=svc.Hello()))
        liar = connect()  # a guard of d1 sending d2's events
        send_frame(liar, svc.AgentMessage(hello=svc.Hello(node="d1")))
        pool = pb.Event(
            node="d2", seq=1, pool=pb.PoolReport(pool=0, role="decode", page_size=16, num_pages=8)
        )
        send_frame(liar, svc.AgentMessage(batch=svc.EventBatch(events=[pool])))
        assert wait_for(lambda: agent.counters["malformed"] == 3 and agent.counters["rejected"] == 1)
        # ... and an honest guard is still served.
        sink = AgentSink(tmp_path / "agent.sock", "d0")
        guard = Guard("d0", mode="monitor", ruleset=RULES, sink=sink)
        guard.pool(0, "decode", page_size=16, num_pages=8, context_len=128)
        assert sink.flush()
        assert wait_for(lambda: [e.node for e in stored(store)] == ["d0"])
        sink.close()
        for sock in (garbage, huge, nameless, liar):
            sock.close()
    finally:
        agent.stop()
        daemon.stop()


def test_the_agent_sends_on_while_a_batch_commits(tmp_path: Path, held_writer: type[InlineWriter]) -> None:
    # Events the engine reports while the agent's last batch is still committing go out
    # without waiting for that commit (up to IN_FLIGHT batches ahead of their acks, once
    # AHEAD_MIN events wait or the oldest has waited AHEAD_AFTER_S): here the disk holds every
    # commit, and the daemon still judges the later leak and its kill reaches the guard. Once
    # the disk moves, every event is stored once, in order, and the spool empties.
    store = Store(str(tmp_path / "audit.db"))
    writer = held_writer(store)
    daemon = Daemon(store, writer=writer)
    grpc_server = service.Server(daemon, "127.0.0.1:0")
    agent = NodeAgent(tmp_path / "agent.sock", f"127.0.0.1:{grpc_server.port}", tmp_path / "spool")
    threading.Thread(target=agent.serve, daemon=True).start()
    kills: list[str] = []
    sink = AgentSink(tmp_path / "agent.sock", "d0")
    try:
        # The daemon decides here; its kill reaches the engine through the guard.
        guard = Guard("d0", mode="monitor", ruleset=RULES, sink=sink, on_kill=lambda r, _: kills.append(r))
        guard.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
        traffic(guard, 5)
        assert sink.flush()
        assert wait_for(lambda: writer.held is not None and len(writer.held) >= 1)
        leak(guard)  # g1 reads page 40, which holds a1's KV
        assert sink.flush()
        assert wait_for(lambda: kills == ["g1"])
        assert store.count() == 0 and agent.counters["acked"] == 0  # nothing durable yet
        writer.release()
        assert wait_for(lambda: agent.counters["acked"] == guard._seq)
        assert [e.seq for e in stored(str(tmp_path / "audit.db"))] == list(range(1, guard._seq + 1))
        assert wait_for(lambda: not agent.spools["d0"].pending)
    finally:
        sink.close()
        agent.stop()
        grpc_server.stop(1)
        writer.release()
        daemon.close()
        store.close()


def shim_record(xfer: str, device_bytes: int) -> bytes:
    """A shim's record as the LD_PRELOAD library sends it: one d2h copy of `device_bytes`."""
    by_kind = [0, 0, device_bytes, 0, 0, 0, 0, 0]  # h2h, h2d, d2h, d2d, default, unused
    return struct.pack("=IHHIi128s8QQQQQ", 0x5347564B, 1, 0, 0, 0, xfer.encode(), *by_kind, 1, 0, 0, 0)


def test_a_shim_record_is_kept_read_before_its_guards_hello_or_after_it_has_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An engine's shim reports on a socket of its own, read by another thread than its guard's,
    # so the agent may read a record before the guard's hello or after the guard has gone (an
    # engine that ends a transfer and exits: a CI flake once). Both keep the engine's node;
    # a process that never had a guard is refused once the wait is over.
    monkeypatch.setattr(agent_module, "SHIM_GUARD_WAIT_S", 3.0)
    store = str(tmp_path / "audit.db")
    daemon, address = start_daemon(store)
    agent = NodeAgent(tmp_path / "agent.sock", address, tmp_path / "spool")
    threading.Thread(target=agent.serve, daemon=True).start()
    shim = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # this process plays the engine
    try:
        assert wait_for(lambda: (tmp_path / "agent.sock.shim").exists())
        shim.connect(str(tmp_path / "agent.sock.shim"))
        shim.send(shim_record("p0-x1", 4096))  # before the guard has said hello
        time.sleep(0.5)
        assert agent.counters["shim_records"] == agent.counters["shim_refused"] == 0  # waiting
        guard = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # the guard, as AgentSink speaks
        guard.connect(str(tmp_path / "agent.sock"))
        send_frame(guard, svc.AgentMessage(hello=svc.Hello(node="p0", agent_version="guard")))
        assert wait_for(lambda: agent.counters["shim_records"] == 1)
        guard.close()
        assert wait_for(lambda: not agent.engines)  # the guard has gone
        shim.send(shim_record("p0-x2", 8192))
        assert wait_for(lambda: agent.counters["shim_records"] == 2)
        monkeypatch.setattr(agent_module, "SHIM_GUARD_WAIT_S", 0.2)
        monkeypatch.setattr(agent_module, "DEPARTED_KEEP_S", 0.0)  # long gone now
        shim.send(shim_record("p0-x3", 1))
        assert wait_for(lambda: agent.counters["shim_refused"] == 1)
        assert agent.counters["shim_records"] == 2

        def wires() -> list[tuple[str, int]]:
            return [(e.wire.xfer, e.wire.bytes) for e in stored(store) if e.node == "p0/shim"]

        assert wait_for(lambda: len(wires()) == 2)
        assert wires() == [("p0-x1", 4096), ("p0-x2", 8192)]
    finally:
        shim.close()
        agent.stop()
        daemon.stop()


def test_an_engine_restarted_mid_traffic_loses_nothing_and_is_judged_afresh(
    tmp_path: Path, store_url: str
) -> None:
    # `kvguard testbed up` twice on one agent and daemon: the second engine has the same node
    # name, numbers its events from 1 again, and reuses the first one's request names, on
    # pages the first still held when it went away; its pool is smaller than its context.
    daemon, address = start_daemon(store_url)
    agent = start_agent(tmp_path, address)
    sink = AgentSink(tmp_path / "agent.sock", "d0")
    first = Guard("d0", ruleset=RULES, sink=sink, epoch=1)
    first.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
    try:
        traffic(first, 10)
        for i in range(3):  # mid-traffic: admitted, granted, written, never freed
            first.admit(f"r{i}", "acme", 32, "decode")
            first.alloc(f"r{i}", 0, [10 + i])
            first.write(f"r{i}", 0, [10 + i])
        assert sink.flush()
        second = Guard("d0", ruleset=RULES, sink=sink, epoch=2)  # the restarted engine
        second.pool(0, "decode", page_size=16, num_pages=32, context_len=1024)
        traffic(second, 12)  # pages 10-12 and names r0-r2 again
        assert [f.finding for f in second.findings] == ["config_drift"]  # its own pool, at start
        assert sink.flush()
        total = first._seq + second._seq
        assert wait_for(lambda: len(stored(store_url)) == total, timeout=30)
        with grpc.insecure_channel(address) as channel:
            fleet = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest(), timeout=10)
    finally:
        sink.close()
        agent.stop()
        daemon.stop()
    events = stored(store_url)
    assert sorted((e.epoch, e.seq) for e in events) == [(1, s) for s in range(1, first._seq + 1)] + [
        (2, s) for s in range(1, second._seq + 1)
    ]
    findings = sorted(stored_findings(store_url), key=lambda f: f.message)
    assert [(f.finding, f.node, f.seq) for f in findings] == [("config_drift", "d0", 1)] * 2
    assert "holds 512 tokens" in findings[0].message and "context length of 1024" in findings[0].message
    assert "changed since before the engine restarted: num_pages 64 -> 32" in findings[1].message
    (node,) = [n for n in fleet.nodes if n.node == "d0"]
    assert (node.epoch, node.restarts, node.last_seq) == (2, 1, second._seq)
    assert [p.report.num_pages for p in node.pools] == [32]


def test_the_guards_sink_frames_by_bytes_and_drops_only_an_event_over_the_frame_limit(
    tmp_path: Path, cluster, capfd: pytest.CaptureFixture[str]
) -> None:  # type: ignore[no-untyped-def]
    # Queued together, these events make one batch far over the agent's 16 MiB frame limit: a
    # frame of them all would be refused, resent and refused forever. Framed by bytes, every
    # one arrives but the single event no frame can carry, which is dropped alone and said.
    store, _, _, _ = cluster
    pages = 1 << 20
    step = 200_000
    log = pb_events(pages, step)
    huge = pb.Event(
        node="d0", seq=len(log) + 1, alloc=pb.Alloc(req="huge", pool=0, pages=list(range(pages)) * 6)
    )
    assert huge.ByteSize() > MAX_FRAME
    tail = pb.Event(node="d0", seq=len(log) + 2, free=pb.Free(req="r0", pool=0, pages=list(range(step))))
    sink = AgentSink(tmp_path / "agent.sock", "d0")
    assert sink.wait_ready(30)
    for event in [*log, huge, tail]:
        assert sink.put(event.SerializeToString())
    assert sink.flush()
    expected = [e.seq for e in log] + [tail.seq]
    assert wait_for(lambda: [e.seq for e in stored(store)] == expected, timeout=60)
    assert sink.oversized == 1 and sink.sent == len(expected)
    assert f"over the agent's frame limit of {MAX_FRAME}; dropped" in capfd.readouterr().err
    sink.close()


def pb_events(pages: int, step: int) -> list[pb.Event]:
    """A pool of `pages` and requests that each take `step` of them (each ~0.8 MB on the wire)."""
    events = [
        pb.Event(node="d0", seq=1, pool=pb.PoolReport(pool=0, role="decode", page_size=16, num_pages=pages))
    ]
    for i in range(pages // step):
        events.append(
            pb.Event(
                node="d0", seq=len(events) + 1, admit=pb.Admit(req=f"r{i}", tenant="acme", stage="decode")
            )
        )
        events.append(
            pb.Event(
                node="d0",
                seq=len(events) + 1,
                alloc=pb.Alloc(req=f"r{i}", pool=0, pages=range(i * step, (i + 1) * step)),
            )
        )
    return events
