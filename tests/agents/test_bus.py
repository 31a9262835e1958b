"""The agent on the bus, for real: a 3-server NATS JetStream cluster configured by `kvguard bus
config`, the agent and the daemon as processes. A guard's events reach the store exactly once
and the daemon's kill comes back over the bus; a batch stored once is never stored again, even
past JetStream's duplicate window; an agent's bus user speaks only for its own nodes."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from agent_helpers import leak, stored, wait_for
from bus_cluster import NatsCluster

from kvguard.agents.bus import BusLink, BusStream, BusUnavailable
from kvguard.agents.guard import AgentSink, Guard
from kvguard.cli import main as kvguard
from kvguard.cli.process import start_agent, start_daemon
from kvguard.proto import bus, pb
from kvguard.ruleset import load_ruleset

RULES = load_ruleset()


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsCluster]:
    cluster = NatsCluster(tmp_path / "nats", "t", {"host-a": ["d0"], "host-b": ["d1"]})
    yield cluster
    cluster.stop()


def certificate_bus(tmp_path: Path) -> NatsCluster:
    """A TLS bus that knows its clients by their certificates from `kvguard certs`: the daemon's,
    and the agents' of node d0 (`node-d0`) and of node d1 (`node-d1`); no password exists."""
    pki = tmp_path / "pki"
    assert kvguard(["certs", "init", str(pki), "--node", "d0", "--node", "d1"]) == 0
    tls = (pki / "daemon.pem", pki / "daemon.key", pki / "ca.pem")
    return NatsCluster(tmp_path / "nats", "t", {}, tls=tls, by_certificate=["node-d0", "node-d1"])


@pytest.fixture(params=["password", "certificate"])
def any_bus(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[NatsCluster, str]]:
    """A bus of either kind, and the user of node d0's agent on it."""
    if request.param == "password":
        cluster, agent = NatsCluster(tmp_path / "nats", "t", {"host-a": ["d0"], "host-b": ["d1"]}), "host-a"
    else:
        cluster, agent = certificate_bus(tmp_path), "node-d0"
    yield cluster, agent
    cluster.stop()


def events_of(i: int, n: int, node: str = "d0") -> list[pb.Event]:
    return [pb.Event(node=node, seq=s, ts_ns=s * 1000, heartbeat=pb.Heartbeat()) for s in range(i, i + n)]


def post(stream: BusStream, events: list[pb.Event]) -> None:
    stream.post([e.SerializeToString() for e in events], [(e.epoch, e.seq) for e in events])


def messages(nats: NatsCluster, subject: str) -> int:
    """How many messages the stream holds on `subject`."""

    async def count() -> int:
        nc = await nats.settings().connect("kvguard-test")
        try:
            info = await nc.jetstream().stream_info(bus.stream_name(nats.cluster), subjects_filter=subject)
            return (info.state.subjects or {}).get(subject, 0)
        finally:
            await nc.close()

    return asyncio.run(count())


def make_stream(nats: NatsCluster, duplicate_window: float = 120.0) -> None:
    """The cluster's stream, as a daemon makes it (with a shorter duplicate window, if asked)."""

    async def make() -> None:
        from nats.js.api import StreamConfig

        nc = await nats.settings().connect("kvguard-test")
        config = StreamConfig(
            name=bus.stream_name(nats.cluster),
            subjects=[f"{bus.ROOT}.{nats.cluster}.>"],
            num_replicas=3,
            allow_direct=True,
            duplicate_window=duplicate_window,
        )
        await nc.jetstream().add_stream(config)
        await nc.close()

    asyncio.run(make())


def test_a_guards_events_and_its_kill_travel_by_the_bus(
    any_bus: tuple[NatsCluster, str], pg_store_url: str, tmp_path: Path
) -> None:
    nats, user = any_bus
    daemon = start_daemon(pg_store_url, 0, *nats.args(), "--bus-lease", "2", quiet=True)
    agent = start_agent(
        str(tmp_path / "agent.sock"),
        "127.0.0.1:1",
        str(tmp_path / "spool"),
        *nats.args(user),
        "--cell",
        "c1",
    )
    kills: list[str] = []
    sink = AgentSink(tmp_path / "agent.sock", "d0")
    guard = Guard("d0", mode="monitor", ruleset=RULES, sink=sink, on_kill=lambda req, why: kills.append(req))
    try:
        guard.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
        leak(guard)  # g1 reads page 40, which holds a1's KV: the daemon's kill comes back
        assert wait_for(lambda: kills == ["g1"], timeout=30)
        assert sink.flush()
        assert wait_for(lambda: len(stored(pg_store_url)) == guard._seq, timeout=30)
        events = stored(pg_store_url)
        assert [e.seq for e in events] == list(range(1, guard._seq + 1))  # each once, in order
        assert (events[-1].kill.req, events[-1].kill.by) == ("g1", "daemon")
        assert messages(nats, bus.events_subject("t", "c1", "d0")) >= 1
    finally:
        sink.close()
        agent.stop()
        daemon.stop()


def test_a_batch_stored_once_is_never_stored_again(nats: NatsCluster) -> None:
    """An agent whose PubAck was lost sends the batch again: inside JetStream's duplicate
    window it is a duplicate, past it the subject is not at the sequence the agent expects;
    either way the stream holds it once and the agent learns it is stored."""
    make_stream(nats, duplicate_window=0.5)
    link = BusLink(nats.settings("host-a"), "c1", lambda text: None)
    try:
        first = BusStream(link, "d0")
        stale = BusStream(link, "d0")  # opened before the batch was stored: a restart's view
        post(first, events_of(1, 3))
        assert first.next_ack(10).durable_seq == 3
        post(first, events_of(1, 3))  # the same batch again, within the window
        assert first.next_ack(10).repeats == 3
        asyncio.run(asyncio.sleep(1.0))  # past the window
        post(stale, events_of(1, 3))
        ack = stale.next_ack(10)
        assert (ack.durable_seq, ack.repeats) == (3, 3)
        subject = bus.events_subject("t", "c1", "d0")
        assert messages(nats, subject) == 1
        restarted = BusStream(link, "d0")  # a new stream starts where the subject stands
        assert restarted.durable == (0, 3)
        post(restarted, events_of(4, 2))
        assert restarted.next_ack(10).durable_seq == 5
        assert messages(nats, subject) == 2
        for s in (first, stale, restarted):
            s.close()
    finally:
        link.close()


def test_an_agents_user_speaks_only_for_its_own_nodes(nats: NatsCluster) -> None:
    make_stream(nats)
    link = BusLink(nats.settings("host-b"), "c1", lambda text: None)
    try:
        mine = BusStream(link, "d1")
        post(mine, events_of(1, 2, "d1"))
        assert mine.next_ack(10).durable_seq == 2
        mine.close()
        with pytest.raises(BusUnavailable, match="refused"):
            BusStream(link, "d0")  # host-a's node: not even its last message may be read
        assert messages(nats, bus.events_subject("t", "c1", "d0")) == 0
    finally:
        link.close()


def test_on_a_tls_bus_no_password_crosses_in_the_clear(tmp_path: Path) -> None:
    pki = tmp_path / "pki"
    assert kvguard(["certs", "init", str(pki)]) == 0  # a server certificate for localhost, 127.0.0.1
    nats = NatsCluster(
        tmp_path / "nats",
        "t",
        {"host-a": ["d0"]},
        tls=(pki / "daemon.pem", pki / "daemon.key", pki / "ca.pem"),
    )
    try:
        make_stream(nats)
        link = BusLink(nats.settings("host-a"), "c1", lambda text: None)
        stream = BusStream(link, "d0")
        post(stream, events_of(1, 2))
        assert stream.next_ack(10).durable_seq == 2
        stream.close()
        link.close()
        said: list[str] = []
        plain = BusLink(replace(nats.settings("host-a"), tls_ca=None), "c1", said.append)
        try:
            with pytest.raises(BusUnavailable, match="cannot reach the bus"):
                BusStream(plain, "d0")  # no TLS, or TLS without the CA: refused before a password is sent
            assert said and "cannot reach the bus" in said[0]
        finally:
            plain.close()
    finally:
        nats.stop()


def test_on_a_certificate_bus_an_agent_speaks_only_for_the_nodes_its_certificate_names(
    tmp_path: Path,
) -> None:
    """`bus config --tls-ca`: each client is the user its certificate names. Node d0's
    certificate streams d0's events and is refused d1's; a certificate of another CA naming d0,
    or none, is refused at the handshake."""
    nats = certificate_bus(tmp_path)
    try:
        assert not (tmp_path / "nats" / "passwords").exists()
        # The servers speak mutual TLS to one another too: a route port says nothing in the
        # clear, and refuses a TLS peer without a certificate of the CA.
        route = ("127.0.0.1", nats.ports[0] + nats.count)
        with socket.create_connection(route, timeout=10) as plain:
            assert plain.recv(100) == b""
        context = ssl.create_default_context(cafile=str(tmp_path / "pki" / "ca.pem"))
        with (
            pytest.raises(OSError),  # ssl.SSLError: the server's alert, certificate required
            socket.create_connection(route, timeout=10) as raw,
            context.wrap_socket(raw, server_hostname="127.0.0.1") as peer,
        ):
            peer.recv(100)
        make_stream(nats)
        link = BusLink(nats.settings("node-d0"), "c1", lambda text: None)
        try:
            stream = BusStream(link, "d0")
            post(stream, events_of(1, 2))
            assert stream.next_ack(10).durable_seq == 2
            stream.close()
            with pytest.raises(BusUnavailable, match="refused"):
                BusStream(link, "d1")
        finally:
            link.close()
        assert messages(nats, bus.events_subject("t", "c1", "d1")) == 0
        other = tmp_path / "other-ca"
        assert kvguard(["certs", "init", str(other), "--node", "d0"]) == 0
        stranger = replace(
            nats.settings("node-d0"), tls_cert=other / "node-d0.pem", tls_key=other / "node-d0.key"
        )
        for settings in (stranger, replace(stranger, tls_cert=None, tls_key=None)):
            said: list[str] = []
            rogue = BusLink(settings, "c1", said.append)
            try:
                with pytest.raises(BusUnavailable, match="cannot reach the bus"):
                    BusStream(rogue, "d0")
            finally:
                rogue.close()
        assert messages(nats, bus.events_subject("t", "c1", "d0")) == 1
    finally:
        nats.stop()


def test_certificate_bus_options_that_cannot_work_are_named(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pki = tmp_path / "pki"
    assert kvguard(["certs", "init", str(pki), "--node", "d0", "--reader", "siem"]) == 0
    capsys.readouterr()
    base = ["bus", "config", "--cluster", "t", "--dir", str(tmp_path / "b"), "--tls-ca", str(pki / "ca.pem")]
    server = ["--tls-cert", str(pki / "daemon.pem"), "--tls-key", str(pki / "daemon.key")]
    daemon = ["--daemon-cert", str(pki / "daemon.pem")]
    cases = {
        (*base, *daemon): "--tls-ca needs --tls-cert and --tls-key",
        (*base, *server): "--tls-ca needs at least one --daemon-cert",
        (*base, *server, *daemon, "--agent", "h=d0"): "with --tls-ca each agent is known by its certificate",
        (*base, *server, "--daemon-cert", str(pki / "node-d0.pem")): "a node's certificate, not a daemon's",
        (
            *base,
            *server,
            *daemon,
            "--agent-cert",
            str(pki / "reader-siem.pem"),
        ): "a reader's certificate, not a node's",
        (*base, *server, *daemon, "--agent-cert", str(pki / "ca.key")): "not a PEM certificate",
    }
    for args, said in cases.items():
        assert kvguard(list(args)) == 2, args
        assert said in capsys.readouterr().err, args
    other = tmp_path / "other"
    assert kvguard(["certs", "init", str(other), "--node", "d0"]) == 0
    capsys.readouterr()
    assert kvguard([*base, *server, *daemon, "--agent-cert", str(other / "node-d0.pem")]) == 2
    assert "not signed by the --tls-ca CA" in capsys.readouterr().err
    bus_args = ["--bus", "nats://h:1", "--cell", "c1", "--socket", str(tmp_path / "s")]
    assert kvguard(["agent", *bus_args, "--bus-tls-cert", str(pki / "node-d0.pem")]) == 2
    assert "--bus-tls-cert and --bus-tls-key go together" in capsys.readouterr().err
    with_key = ["--bus-tls-cert", str(pki / "node-d0.pem"), "--bus-tls-key", str(pki / "node-d0.key")]
    assert kvguard(["agent", *bus_args, *with_key]) == 2
    assert "--bus-tls-cert needs --bus-tls-ca" in capsys.readouterr().err


def test_bus_options_that_cannot_work_are_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert kvguard(["agent", "--bus", "nats://127.0.0.1:4222", "--socket", str(tmp_path / "s")]) == 2
    assert "--bus needs --cell" in capsys.readouterr().err
    assert kvguard(["agent", "--bus", "nats://h:1", "--cell", "a.b", "--socket", str(tmp_path / "s")]) == 2
    assert "cell 'a.b'" in capsys.readouterr().err
    assert kvguard(["daemon", "--bus", "nats://h:1", "--store", str(tmp_path / "a.db")]) == 2
    assert "share one PostgreSQL audit store" in capsys.readouterr().err
    assert kvguard(["bus", "config", "--cluster", "x y", "--dir", str(tmp_path / "b")]) == 2
    assert "bus cluster 'x y'" in capsys.readouterr().err
    shared = tmp_path / "password"
    shared.write_text("secret\n")
    shared.chmod(0o644)
    bus = ["--bus", "nats://h:1", "--cell", "c1", "--bus-user", "u", "--bus-password-file", str(shared)]
    assert kvguard(["agent", *bus, "--socket", str(tmp_path / "s")]) == 2
    assert "others may read or write it (mode 644)" in capsys.readouterr().err
