"""The dashboard's tests' fleet: a real daemon process fed a fixed sequence of events (fixed
ts_ns) by nodes that stream as agents do (AgentStream), with their agents' statuses, so that
what the dashboard shows is the same on every run; and the dashboard on it, its volatile
fields (the daemon's clock, rates, ages, the store's size) pinned by the client's test hook.

The fleet: p0 and d0 replay the 2026 incident (p0's pool cannot hold its context; d0's guard
is gone); c0, a colocated vLLM node, has pages in every state (owned by four tenants, shared,
held by offload, transfer, prefix cache and abort, reserved, quarantined by the daemon after a
double free) and a live request that globex shares from acme against policy (an alert, not a
kill: the operator's to kill); n3's agent came and went. One alert is acknowledged.
"""

from __future__ import annotations

import asyncio
import io
import itertools
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC
from pathlib import Path

import pytest
from daemon_helpers import INCIDENT, wait_for
from rich.console import Console
from textual.app import App
from textual.pilot import Pilot

from kvguard.agents.upstream import AgentStream
from kvguard.cli.process import Service, start_daemon
from kvguard.proto import pb
from kvguard.proto.builder import EventLog
from kvguard.proto.capture import read_capture
from kvguard.proto.channel import channel
from kvguard.proto.client import DaemonClient
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.tui.app import TopApp

BASE_NS = 1_767_258_000 * 10**9  # 2026-01-01 09:00:00 UTC
NOW_NS = BASE_NS + 90 * 10**9  # the daemon's clock, as pinned
OPERATOR = "operator"  # the OS user the dashboard claims (kvguard-user)
C0_EPOCH = BASE_NS - 3600 * 10**9  # c0's engine started an hour before
GIB = 1 << 30


def incident() -> list[pb.Event]:
    """The incident capture, its clock moved to BASE_NS (100 µs a capture tick)."""
    events = [e for _, e in read_capture(INCIDENT) if isinstance(e, pb.Event)]
    for e in events:
        e.ts_ns = BASE_NS + e.ts_ns * 100_000
    return events


def colocated() -> list[pb.Event]:
    """c0's pool: 256 pages, page 0 reserved, every state of a page in it."""
    clock = itertools.count(BASE_NS + 2 * 10**9, 3_000_000)
    log = EventLog(clock=lambda: next(clock))
    log.restart("c0", C0_EPOCH)
    add = log.add
    add(
        "c0",
        "pool",
        pool=0,
        role="colocated",
        engine="vllm",
        engine_version="0.11.0",
        model="llama-3-8b",
        page_size=16,
        num_pages=256,
        reserved_pages=1,
        context_len=2048,
        kv_dtype="bf16",
        tp_size=1,
    )

    def request(req: str, tenant: str, pages: list[int]) -> None:
        add("c0", "admit", req=req, tenant=tenant, prompt_tokens=16 * len(pages), stage="prefill")
        add("c0", "alloc", req=req, pool=0, pages=pages)
        add("c0", "write", req=req, pool=0, pages=pages)
        add("c0", "read", reads=[{"req": req, "pool": 0, "pages": pages, "tokens": 16 * len(pages)}])

    def ended(req: str, pages: list[int], holder: str) -> None:  # its pages held after it ends
        add("c0", "hold", req=req, pool=0, pages=pages, holder=holder)
        add("c0", "finish", req=req, output_tokens=4)
        add("c0", "free", req=req, pool=0, pages=pages)

    request("a11", "acme", list(range(1, 41)))  # live: owned, and shared below
    request("i11", "initech", list(range(41, 71)))  # live
    request("u11", "umbrella", list(range(71, 96)))  # live
    request("a12", "acme", list(range(96, 106)))
    ended("a12", list(range(96, 106)), "offload")
    request("i12", "initech", list(range(106, 114)))
    ended("i12", list(range(106, 114)), "transfer_send")
    request("a13", "acme", list(range(114, 130)))
    ended("a13", list(range(114, 130)), "prefix_cache")
    request("u12", "umbrella", list(range(130, 136)))
    add("c0", "abort", req="u12", reason="client gone")
    add("c0", "hold", req="u12", pool=0, pages=list(range(130, 136)), holder="abort")
    add("c0", "free", req="u12", pool=0, pages=list(range(130, 136)))
    # globex reads acme's live prefix (against the default policy: an alert, the request lives on)
    add("c0", "admit", req="g12", tenant="globex", prompt_tokens=200, stage="prefill")
    add("c0", "share", req="g12", pool=0, pages=list(range(1, 9)), origin_req="a11")
    add("c0", "alloc", req="g12", pool=0, pages=list(range(136, 141)))
    add("c0", "write", req="g12", pool=0, pages=list(range(136, 141)))
    add(
        "c0",
        "read",
        reads=[{"req": "g12", "pool": 0, "pages": [*range(1, 9), *range(136, 141)], "tokens": 200}],
    )
    # an error path frees i13's pages twice: the daemon quarantines them
    request("i13", "initech", list(range(141, 145)))
    add("c0", "finish", req="i13", output_tokens=2)
    add("c0", "free", req="i13", pool=0, pages=list(range(141, 145)))
    add("c0", "free", req="i13", pool=0, pages=list(range(141, 145)))
    return log.events


def statuses() -> dict[str, svc.NodeStatus]:
    h200 = svc.Gpu(index=0, name="NVIDIA H200", uuid="GPU-0", memory_total=141 * GIB, memory_used=118 * GIB)
    return {
        "p0": svc.NodeStatus(
            guard="connected",
            guard_since_ns=BASE_NS - 600 * 10**9,
            guard_pid=4101,
            gpus=[h200],
            driver="570.86.15",
            agent_version="kvguard-agent 0.1.0",
        ),
        "d0": svc.NodeStatus(
            guard="gone",
            guard_since_ns=BASE_NS + 60 * 10**9,
            gpus=[h200],
            agent_version="kvguard-agent 0.1.0",
        ),
        "c0": svc.NodeStatus(
            guard="connected",
            guard_since_ns=BASE_NS - 3600 * 10**9,
            guard_pid=7007,
            gpu_unavailable="NVML: libnvidia-ml.so.1 not found",
            spooled=12,
            agent_version="kvguard-agent 0.1.0",
        ),
    }


def pin(state: svc.FleetState) -> None:
    """The client's test hook: the fields that change by themselves, fixed."""
    state.now_ns = NOW_NS
    for i, node in enumerate(state.nodes):
        node.connected_ns = BASE_NS + (80 if not node.connected else i) * 10**9
        node.received_ns = BASE_NS + (80 + i) * 10**9 if node.received_ns else 0
        node.status_ns = BASE_NS + 88 * 10**9 if node.status_ns else 0
        node.events_per_s = 0.0 if not node.connected else 2.5 * (i + 1)
        node.lag_ms = 0.0 if not node.connected else 1.5 + i
    state.store.used_bytes = 3 << 20
    state.store.free_bytes = 40 * GIB
    state.store.growth_bytes_per_s = 0
    state.store.full_in_s = 0
    state.ClearField("latencies")


@dataclass
class Fleet:
    """A daemon fed the fixed sequence, its nodes' streams kept open (n3's closed)."""

    daemon: Service
    store: str
    streams: dict[str, AgentStream] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return self.daemon.address

    def stream(self, node: str) -> AgentStream:
        if node not in self.streams:
            self.streams[node] = AgentStream(channel(self.address, None), node, "kvguard-agent")
        return self.streams[node]

    def feed(self, events: list[pb.Event]) -> None:
        """Each run of one node's events as a batch, in order, each acknowledged (durable)
        before the next: the global order, and so every record id, is the same on each run."""
        for _, run in itertools.groupby(events, key=lambda e: e.node):
            batch = list(run)
            ack = self.stream(batch[0].node).send(batch)
            assert ack.accepted == len(batch) and not ack.rejected, ack

    def client(self) -> DaemonClient:
        client = DaemonClient(self.address, user=OPERATOR)
        client.pin_fleet = pin
        return client

    def app(self, **options: object) -> TopApp:
        return TopApp(self.client(), tz=UTC, label="daemon", **options)  # type: ignore[arg-type]

    def findings(self) -> list[tuple[int, pb.Finding]]:
        client = DaemonClient(self.address, user=OPERATOR)
        try:
            return [(r.id, r.finding) for r in client.query(Filter(kind="finding"))]
        finally:
            client.close()

    def close(self) -> None:
        for stream in self.streams.values():
            stream.close()
        self.streams.clear()


def build_fleet(store: str) -> Fleet:
    fleet = Fleet(start_daemon(store), store)
    try:
        fleet.feed(incident())
        fleet.feed(colocated())
        for node, status in statuses().items():
            fleet.stream(node).status(status)
        gone = fleet.stream("n3")
        gone.send(
            [
                pb.Event(
                    node="n3",
                    seq=1,
                    ts_ns=BASE_NS + 10**9,
                    pool=pb.PoolReport(
                        pool=0,
                        role="decode",
                        engine="sglang",
                        engine_version="0.5.2",
                        page_size=64,
                        num_pages=1024,
                        context_len=65536,
                    ),
                )
            ]
        )
        gone.close()
        del fleet.streams["n3"]
        client = fleet.client()
        findings = fleet.findings()
        drift = next(cursor for cursor, f in findings if f.rule == "config_drift")
        client.act(svc.Action(acknowledge=svc.Acknowledge(cursor=drift), reason="known: pool too small"))

        def settled() -> bool:
            state = client.state()
            nodes = {n.node: n for n in state.nodes}
            return (
                set(nodes) == {"c0", "d0", "n3", "p0"}
                and not nodes["n3"].connected
                and all(nodes[n].HasField("status") for n in ("p0", "d0", "c0"))
                and "double_free" in state.findings
                and "cross_tenant_share" in state.findings
            )

        wait_for(settled, timeout=20)
        client.close()
    except BaseException:
        fleet.close()
        fleet.daemon.stop()
        raise
    return fleet


@pytest.fixture(scope="module")
def shared_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """One fed daemon for a test file's readers (nothing they do changes it)."""
    fleet = build_fleet(str(tmp_path_factory.mktemp("tui") / "audit.db"))
    yield fleet
    fleet.close()
    fleet.daemon.stop()


@pytest.fixture
def own_fleet(tmp_path: Path) -> Iterator[Fleet]:
    """A fed daemon of the test's own (it acts on it, or stops it)."""
    fleet = build_fleet(str(tmp_path / "audit.db"))
    yield fleet
    fleet.close()
    fleet.daemon.stop()


@pytest.fixture
def until() -> Callable[..., Awaitable[None]]:
    """`await until(pilot, done)`: let the app run until `done()` holds (the daemon's answers
    are in), or fail after `timeout` seconds."""

    async def wait(pilot: Pilot, done: Callable[[], bool], timeout: float = 15) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done():
            assert loop.time() < deadline, "timed out waiting for the dashboard"
            await pilot.pause(0.05)

    return wait


@pytest.fixture
def screen_text() -> Callable[[App], str]:
    """The app's screen as plain text, as a terminal shows it (modal screens over the rest):
    what the tests read, as an operator would."""

    def text(app: App) -> str:
        width, height = app.size
        console = Console(width=width, height=height, file=io.StringIO(), record=True, color_system=None)
        console.print(app.screen._compositor.render_update(full=True, screen_stack=app._background_screens))
        return "\n".join(line.rstrip() for line in console.export_text().splitlines())

    return text
