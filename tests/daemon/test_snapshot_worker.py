"""The periodic snapshot without fork(): built by a process of its own (started by exec) from
the store. What it builds is the live ledger to the byte; a daemon serving gRPC streams under
load takes many and loses none (and gRPC never warns of a fork); a restart after SIGKILL
replays only what came after the newest; a worker that fails or is killed is counted and said,
and none outlives its daemon."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
from daemon_helpers import clean_requests, ingest, stale_reads, wait_for
from log_lines import said as said_lines

from kvguard.agents.upstream import AgentStream
from kvguard.cli.process import start_daemon
from kvguard.daemon.daemon import Daemon
from kvguard.daemon.snapshot_worker import build
from kvguard.daemon.snapshots import Snapshots
from kvguard.daemon.store import Store
from kvguard.ledger import snapshot
from kvguard.proto.channel import channel
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc


def counters_of(address: str) -> dict[str, int]:
    with channel(address, None) as ch:
        return dict(svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10).counters)


def test_the_workers_snapshot_is_the_live_ledger_to_the_byte(tmp_path: Path) -> None:
    store = Store(str(tmp_path / "audit.db"))
    daemon = Daemon(store, snapshot_every=0)
    batches = [
        ("c1", clean_requests("c1", 40)),
        ("s1", stale_reads("s1", 5)),
        ("c2", clean_requests("c2", 3)),
    ]
    try:
        for node, events in batches:
            ingest(daemon, node, events, lambda msg: None)
        wait_for(lambda: daemon.counters["events"] == sum(len(e) for _, e in batches))
        daemon.close()
        live = snapshot.dump(daemon.ledger)
        through, built = build(store.url, [], store.head_file, snapshot.settings(daemon.ledger))
        assert through == store.count() and built == live
        # Taken after that one, the next replays only what came after it: nothing new, nothing built.
        store.save_snapshot(built, through)
        assert build(store.url, [], store.head_file, snapshot.settings(daemon.ledger)) == (through, b"")
    finally:
        store.close()


def test_a_daemon_under_load_takes_many_snapshots_loses_none_and_never_forks(tmp_path: Path) -> None:
    url = str(tmp_path / "audit.db")
    daemon = start_daemon(url, 0, "--snapshot-every", "300")
    nodes = [f"n{i}" for i in range(8)]
    sent = 0
    try:
        streams = {n: AgentStream(channel(daemon.address, None), n) for n in nodes}
        events = {n: stale_reads(n, 150) for n in nodes}  # 150 findings a node
        taken_while_streaming = 0
        for start in range(0, 601, 25):  # batches of 25 events from every node in turn, for ~8 s
            for n in nodes:
                chunk = events[n][start : start + 25]
                if chunk:
                    assert streams[n].send(chunk).accepted == len(chunk)
                    sent += len(chunk)
            time.sleep(0.3)
            taken_while_streaming = counters_of(daemon.address).get("snapshots", 0)
        for stream in streams.values():
            stream.close()
        assert taken_while_streaming >= 2, "snapshots were not taken while the streams went on"
        wait_for(lambda: counters_of(daemon.address)["events"] == sent, timeout=60)
        counters = counters_of(daemon.address)
        assert counters.get("snapshot_failures", 0) == 0
        store = Store(url)
        newest = store.latest_snapshot()
        assert not isinstance(newest, str), newest
        through = newest[0]
        assert 0 < through <= store.count()  # a record id: events, findings, commands alike
        store.close()
    finally:
        daemon.kill()  # SIGKILL: no snapshot of its own at a clean stop
    again = start_daemon(url)
    try:
        counters = counters_of(again.address)
        assert counters["snapshot_through"] >= through and counters["rebuilt_events"] < sent
        assert counters.get("events", 0) == 0  # nothing new: the rest is rebuilt, not received
    finally:
        err = "\n".join(said_lines(again.stop()))
    assert "fork" not in err
    store = Store(url)
    findings = [r for r in store.rows(kind="finding")]
    assert len(findings) == 8 * 150  # each stale read judged once, none lost or doubled
    store.close()


def test_a_worker_that_fails_is_counted_and_said_and_the_next_is_due_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    store = Store(str(tmp_path / "audit.db"))
    counters: Counter[str] = Counter()
    snaps = Snapshots(store, 1, 0, counters)
    crash = "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"
    monkeypatch.setattr(snaps, "command", lambda: [sys.executable, "-c", crash])
    snaps.start(1)
    snaps.join(timeout=60)
    assert counters["snapshot_failures"] == 1 and counters["snapshots"] == 0
    assert "periodic ledger snapshot not saved: the process building it was killed by SIGSEGV" in (
        capsys.readouterr().err
    )
    assert not snaps.due(1) and snaps.saving is None  # the next is due `every` later, as usual
    monkeypatch.setattr(snaps, "command", lambda: [sys.executable, "-c", "print('not a snapshot')"])
    snaps.start(2)
    snaps.join(timeout=60)
    assert counters["snapshot_failures"] == 2
    assert "that are not one" in capsys.readouterr().err
    store.close()


def test_a_worker_at_work_is_killed_when_its_daemon_stops_or_dies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = Store(str(tmp_path / "audit.db"))
    counters: Counter[str] = Counter()
    snaps = Snapshots(store, 1, 0, counters)
    monkeypatch.setattr(snaps, "command", lambda: [sys.executable, "-c", "import time; time.sleep(60)"])
    snaps.start(1)
    wait_for(lambda: snaps._worker is not None, timeout=30)
    started = time.monotonic()
    snaps.close()  # the daemon stops: killed at once and reaped; superseded, not a failure
    snaps.join(timeout=10)
    assert time.monotonic() - started < 5 and snaps.saving is None
    assert (counters["snapshot_failures"], counters["snapshots"]) == (0, 0)
    store.close()
    # A daemon that dies (SIGKILL) takes its worker with it (PR_SET_PDEATHSIG, set by the worker).
    script = textwrap.dedent(
        f"""
        import subprocess, sys, time
        worker = subprocess.Popen(
            [sys.executable, "-m", "kvguard.daemon.snapshot_worker", "--store", {str(tmp_path / "x.db")!r},
             "--settings", "{{}}"],
            stdin=subprocess.PIPE,
        )
        print(worker.pid, flush=True)
        time.sleep(60)  # the worker waits for its keys on stdin meanwhile
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline()) if parent.stdout else 0
    time.sleep(1.0)  # the worker has set its death signal
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    if parent.stdout:
        parent.stdout.close()
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid), f"the worker {pid} outlived its daemon"


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for init to reap it does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_the_daemon_has_no_fork_of_itself() -> None:
    import kvguard.ledger as ledger_part

    assert not (Path(ledger_part.__file__).parent / "forked.py").exists()
    os_fork_users = subprocess.run(
        ["grep", "-rln", r"os\.fork\b", str(Path(ledger_part.__file__).parents[1] / "daemon")],
        capture_output=True,
        text=True,
    ).stdout
    assert os_fork_users == ""


def test_a_cells_snapshot_built_on_its_previous_one_is_the_one_built_from_its_whole_history(
    tmp_path: Path,
) -> None:
    """On the bus: a cell's snapshot holds its nodes only, and built from the one before it
    and what came after is, byte for byte, the one built from everything its nodes stored."""
    from kvguard.daemon.snapshot_worker import build_cell
    from kvguard.testbed.fleet import fleet

    f = fleet(2, ticks=12, length=3, fault_every=4)
    half = len(f.batches) // 2
    store = Store(str(tmp_path / "audit.db"))
    nodes = f.cells["cell000"]
    try:
        built_first = []
        for i, part in enumerate((f.batches[:half], f.batches[half:])):
            daemon = Daemon(store, snapshot_every=0)
            for node, events in part:
                ingest(daemon, node, events, lambda msg: None)
            wait_for(lambda d=daemon, p=part: d.counters["events"] == sum(len(e) for _, e in p))
            daemon.close()
            settings = snapshot.settings(daemon.ledger)
            if i == 0:
                built_first.append(build_cell(store.url, [], store.head_file, settings, nodes, b"", 0, []))
        [(after, previous)] = built_first
        assert 0 < after < store.count()
        assert set(snapshot.load(previous).nodes) == set(nodes)  # the other cell's are not in it
        built = build_cell(store.url, [], store.head_file, settings, nodes, previous, after, nodes)
        whole = build_cell(store.url, [], store.head_file, settings, nodes, b"", 0, [])
        assert built[0] == whole[0] == store.count() and built[1] == whole[1]
        # Nothing of its nodes after the newest: nothing built.
        assert build_cell(store.url, [], store.head_file, settings, nodes, whole[1], whole[0], nodes) == (
            whole[0],
            b"",
        )
    finally:
        store.close()
