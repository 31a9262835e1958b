"""The agent's word on each node (NodeStatus), for real: a guard in this process, a node agent
and a daemon as processes. The daemon's fleet shows the guard connected with its engine's
process, then gone within a few seconds of the engine closing its sink (while the agent's
stream stays open: the defect of `kvguard fleet` saying CONNECTED after the engine exited), the
host's GPUs or why they cannot be read, and the agent's liveness while the engine is idle."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from agent_helpers import wait_for

from kvguard.agents.guard import AgentSink, Guard
from kvguard.agents.probes import gpu_facts
from kvguard.cli.process import start_agent, start_daemon
from kvguard.proto.channel import channel
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset import load_ruleset


def node(address: str, name: str) -> svc.NodeState | None:
    with channel(address, None) as ch:
        state = svc_grpc.FleetServiceStub(ch).State(svc.FleetRequest(), timeout=10)
    return next((n for n in state.nodes if n.node == name), None)


def guard_of(address: str, name: str) -> str:
    found = node(address, name)
    return found.status.guard if found is not None and found.HasField("status") else ""


def test_the_fleet_shows_a_guard_connected_then_gone_and_the_agents_liveness(tmp_path: Path) -> None:
    daemon = start_daemon(str(tmp_path / "audit.db"))
    agent = start_agent(str(tmp_path / "agent.sock"), daemon.address, str(tmp_path / "spool"))
    started = time.time_ns()  # before the sink: it may connect (the guard's since) as it is made
    sink = AgentSink(tmp_path / "agent.sock", "d0")
    try:
        guard = Guard("d0", mode="monitor", ruleset=load_ruleset(), sink=sink)
        guard.pool(0, "decode", page_size=16, num_pages=8, context_len=128)
        assert sink.wait_ready(20)
        assert wait_for(lambda: guard_of(daemon.address, "d0") == "connected")
        d0 = node(daemon.address, "d0")
        assert d0 is not None and d0.connected
        status = d0.status
        assert status.guard_pid == os.getpid() and status.guard_since_ns >= started
        facts = gpu_facts()
        assert (status.gpu_unavailable, status.driver) == (facts.unavailable, facts.driver)
        assert [g.name for g in status.gpus] == [g["name"] for g in facts.gpus]
        if facts.unavailable:  # this machine: no NVML
            assert status.gpu_unavailable.startswith(("NVML did not start", "pynvml is not installed"))
        assert status.agent_version.startswith("kvguard-agent ")
        assert wait_for(lambda: node(daemon.address, "d0").status.spooled == 0)  # type: ignore[union-attr]
        # Idle, the agent still speaks every few seconds: its word is never older than that.
        heard = d0.status_ns
        assert wait_for(lambda: node(daemon.address, "d0").status_ns > heard, timeout=10)  # type: ignore[union-attr]
        # The engine goes (its sink closes): the agent's stream stays open, the guard is gone.
        sink.close()
        assert wait_for(lambda: guard_of(daemon.address, "d0") == "gone", timeout=10)
        d0 = node(daemon.address, "d0")
        assert d0 is not None and d0.connected and d0.status.guard_pid == 0
        assert d0.status.guard_since_ns > status.guard_since_ns
        shown = subprocess.run(
            [sys.executable, "-m", "kvguard", "fleet", "--daemon", daemon.address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        (row,) = [line.split() for line in shown.stdout.splitlines() if line.startswith("d0 ")]
        assert row[2:4] == ["yes", "gone"], shown.stdout
    finally:
        sink.close()
        agent.stop()
        daemon.stop()
