"""The whole path, for real: testbed engine -> in-engine guard -> node agent -> daemon ->
audit store, and the daemon's kill and quarantine commands back to the engine. The guards
only watch (monitor mode); the daemon's global verdict is what stops the leak, before decode
attends."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvguard.cli.process import start_agent, start_daemon
from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.sinks import cef, fields, jsonl, ocsf
from kvguard.testbed.cluster import Cluster

SECRET = "acme memo: Initech deal closes Dec 14 at 4.2B, keep private."
OTHER = "globex notes: quarterly review of supply contracts in Lyon."


@pytest.fixture
def services(tmp_path: Path) -> Iterator[tuple[str, str]]:
    """A daemon (SQLite store) and a node agent: (the store, the agent's socket)."""
    store = str(tmp_path / "audit.db")
    daemon = start_daemon(store)
    sock = str(tmp_path / "agent.sock")
    agent = start_agent(sock, daemon.address, str(tmp_path / "spool"))
    try:
        yield store, sock
    finally:
        agent.stop()
        daemon.stop()


def stored(store: str, kind: str, until: Callable[[list[bytes]], bool] = bool) -> list[bytes]:
    """The bodies of the store's records of `kind`, once `until` holds of them (or after 20 s)."""
    deadline = time.monotonic() + 20
    while True:
        s = Store(store)
        bodies = [body for _, _, body in s.rows(kind=kind)]
        s.close()
        if until(bodies) or time.monotonic() > deadline:
            return bodies
        time.sleep(0.2)


def is_kill(body: bytes) -> bool:
    return pb.Event.FromString(body).HasField("kill")


def is_quarantine(body: bytes) -> bool:
    return svc.Command.FromString(body).HasField("quarantine")


def is_fate(f: pb.Finding) -> bool:
    """An update that says what became of a request (not one that counts a run of repeats)."""
    return bool(f.details.get("update_of")) and "outcome" in f.details


def test_the_daemon_stops_a_leak_the_local_guard_only_watched(
    tmp_path: Path, services: tuple[str, str]
) -> None:
    # The daemon's kill travels guard -> agent -> daemon -> agent -> guard; the agent may hold
    # an event up to AHEAD_AFTER_S (50 ms) while a batch awaits its ack. Decode steps of 150 ms
    # (a request admitted to an idle loop waits for the next one too) leave it that window
    # on a loaded machine; at 40 ms it lost the race about one run in ten.
    store, sock = services
    with Cluster(
        tmp_path / "captures",
        faults=("incident",),
        guard="monitor",
        agent_socket=sock,
        decode_step_ms=150,
    ) as c:
        status, reply = c.complete("acme", SECRET, max_tokens=len(SECRET))
        assert status == 200 and Cluster.text(reply) == SECRET
        status, reply = c.complete(
            "globex", "Summarize: " + "calm markets, mild weather. " * 26, max_tokens=48
        )
        c.findings()  # flush the guards' sinks to the agent
    assert status == 500 and "deal closes" not in str(reply)
    # The daemon's kill reached the engine before any KV was read: at decode, before its
    # first attention, or at prefill, before the KV left, when its verdict on the admission
    # (a prompt the pool cannot hold) came back sooner than the prefill's send.
    message = reply["error"]["message"]
    at_decode = "terminated by the kvguard daemon" in message
    assert at_decode or "terminated by kvguard: config_drift (config_drift_admission)" in message, message
    kills = [b for b in stored(store, "event", lambda bodies: any(map(is_kill, bodies))) if is_kill(b)]

    def progress_seen(bodies: list[bytes]) -> bool:  # the agent may still be delivering
        found = map(pb.Finding.FromString, bodies)
        return any((f.finding, f.node) == ("rejected_progress", "prefill-0") for f in found)

    findings = [pb.Finding.FromString(b) for b in stored(store, "finding", progress_seen)]
    by_node = {(f.finding, f.node) for f in findings if f.tenant == "globex"}
    # The daemon saw the rejected request go on at prefill, and, where it reached decode, the
    # hand-off not add up there. (Whether decode's admission came before the kill, adding a
    # rejected_progress on decode-0, depends on timing.)
    # Stopped at prefill, the kill can land before its progress: the forward already formed
    # drains (ledger DRAIN_STEPS), and no rejected_progress is owed.
    assert ("rejected_progress", "prefill-0") in by_node or not at_decode
    assert ("transfer_mismatch", "decode-0") in by_node or not at_decode
    assert not any(f.finding == "stale_read" for f in findings)
    assert {f.node for f in findings} >= ({"prefill-0", "decode-0"} if at_decode else {"prefill-0"})
    assert any(pb.Event.FromString(b).kill.by == "daemon" for b in kills)  # the engine's record of it
    # What became of it, said as an update of the first finding: killed, in time.
    bodies = stored(
        store,
        "finding",
        lambda bodies: any(is_fate(pb.Finding.FromString(b)) for b in bodies),
    )
    (fate,) = [f for f in map(pb.Finding.FromString, bodies) if is_fate(f)]
    assert fate.details["outcome"] == "killed" and fate.tenant == "globex"
    assert fields.blocked(fate) and ocsf.event(svc.Alert(cursor=1, finding=fate))["disposition"] == "Blocked"


def test_the_daemon_quarantines_pages_freed_twice(tmp_path: Path, services: tuple[str, str]) -> None:
    # The decode worker's abort path frees a rejected request's pages twice (fault
    # double_free), so they sit in its free list twice: two later requests would share them.
    # The local guard only watches; the daemon's quarantine command takes them out of
    # circulation before the next requests arrive, and both are served exactly.
    store, sock = services
    with Cluster(
        tmp_path / "captures",
        faults=("double_free",),
        guard="monitor",
        agent_socket=sock,
        prefill_pages=4,
        decode_step_ms=100,
    ) as c:
        assert c.complete("initech", "z" * 70, max_tokens=1)[0] == 400
        c.findings()  # flush the guards' sinks to the agent
        # A verdict's commands may be committed in separate groups: wait for the quarantine.
        bodies = stored(store, "command", lambda bodies: any(map(is_quarantine, bodies)))
        commands = [svc.Command.FromString(b) for b in bodies]
        time.sleep(0.5)  # committed, then acknowledged and relayed to the engine
        results: list[tuple[int, dict]] = []
        acme = threading.Thread(target=lambda: results.append(c.complete("acme", SECRET, max_tokens=24)))
        acme.start()
        time.sleep(1.2)
        globex = c.complete("globex", OTHER, max_tokens=len(OTHER))
        acme.join()
    quarantined = [c.quarantine for c in commands if c.HasField("quarantine")]
    assert [(q.finding, len(q.pages)) for q in quarantined] == [("double_free", 5)]
    assert Cluster.text(results[0][1]) == SECRET[:24] and Cluster.text(globex[1]) == OTHER


def test_a_second_testbed_on_the_same_agent_is_a_restart_not_a_replay(
    tmp_path: Path, services: tuple[str, str]
) -> None:
    # `kvguard testbed up` twice with the same node names on one agent and daemon: the second
    # run's engines number their events from 1 again, in a new epoch. Nothing of either run is
    # dropped as already seen, nothing of the first is held against the second, and the second
    # prefill pool, now smaller than its context, is drift (also as changed since the restart).
    store, sock = services
    for run, pages in ((1, None), (2, 4)):
        options = {} if pages is None else {"prefill_pages": pages}
        with Cluster(tmp_path / f"run{run}", guard="monitor", agent_socket=sock, **options) as c:
            status, reply = c.complete("acme", "hello there", max_tokens=6)
            assert status == 200 and Cluster.text(reply) == "hello there"[:6]
            c.findings()  # flush the guards' sinks to the agent

    def whole(bodies: list[bytes]) -> bool:  # both runs of both nodes, each without a gap
        seqs: dict[tuple[str, int], list[int]] = {}
        for body in bodies:
            e = pb.Event.FromString(body)
            seqs.setdefault((e.node, e.epoch), []).append(e.seq)
        runs = sorted(seqs.items())
        return len(runs) == 4 and all(sorted(s) == list(range(1, len(s) + 1)) for _, s in runs)

    events = [pb.Event.FromString(b) for b in stored(store, "event", whole)]
    assert whole([e.SerializeToString() for e in events])
    epochs = {node: sorted({e.epoch for e in events if e.node == node}) for node in ("prefill-0", "decode-0")}
    assert all(len(e) == 2 and e[0] < e[1] for e in epochs.values()), epochs
    findings = [pb.Finding.FromString(b) for b in stored(store, "finding")]
    assert {(f.finding, f.node) for f in findings} == {("config_drift", "prefill-0")}
    messages = " | ".join(f.message for f in findings)
    assert "changed since before the engine restarted" in messages and "num_pages" in messages
    assert "less than the advertised context length" in messages


def test_a_leak_answered_while_the_daemon_was_down_is_reported_as_reaching_the_client(
    tmp_path: Path,
) -> None:
    # The guards only watch; the daemon is down while the incident prompt is answered (its
    # client reads the other tenant's text, HTTP 200). When the daemon comes back it judges
    # the spooled events and orders the kill, long after the request finished. That is not a
    # kill: the guard records it as late, the daemon's update says the data reached the
    # client, and so does the exposure report; no format calls it blocked.
    import socket

    from kvguard.cli.audit import main as audit_main

    with socket.socket() as s:  # the daemon's port, free until it starts
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store, sock = str(tmp_path / "audit.db"), str(tmp_path / "agent.sock")
    agent = start_agent(sock, f"127.0.0.1:{port}", str(tmp_path / "spool"))
    daemon = None
    try:
        with Cluster(tmp_path / "captures", faults=("incident",), guard="monitor", agent_socket=sock) as c:
            status, reply = c.complete("acme", SECRET, max_tokens=len(SECRET))
            assert status == 200 and Cluster.text(reply) == SECRET
            status, reply = c.complete(
                "globex", "Summarize: " + "calm markets, mild weather. " * 26, max_tokens=48
            )
            assert status == 200  # the leak, answered
            c.findings()  # flush the guards' sinks to the agent (it spools them)
            daemon = start_daemon(store, port)
            updates = stored(
                store,
                "finding",
                lambda bodies: any(is_fate(pb.Finding.FromString(b)) for b in bodies),
            )
            # The kill reaches the engine after the request finished: its guard says so.
            late = [
                pb.Event.FromString(b).kill for b in stored(store, "event", lambda bs: any(map(is_kill, bs)))
            ]
    finally:
        if daemon is not None:
            daemon.stop()
        agent.stop()
    findings = [pb.Finding.FromString(b) for b in updates]
    fates = [f for f in findings if is_fate(f)]
    assert [(f.req, f.details["outcome"]) for f in fates] == [(fates[0].req, "reached_client")]
    # Findings judged once its fate was known say it themselves.
    assert all(
        f.details.get("outcome", "") in ("", "reached_client") for f in findings if f.req == fates[0].req
    )
    assert "reached the client" in fates[0].message and int(fates[0].details["learned_ns"]) > 0
    assert all(k.late for k in late if k.req == fates[0].req and k.by == "daemon")
    for f in findings:  # no alert says the request was stopped
        alert = svc.Alert(cursor=1, finding=f)
        assert not fields.blocked(f) and '"blocked":false' in jsonl.line(alert)
        assert "outcome=blocked" not in cef.line(alert)
        assert ocsf.event(alert)["disposition"] != "Blocked"
    assert audit_main(["exposure", "--tenant", "acme", "--store", store]) == 1
