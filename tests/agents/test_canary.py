"""The self-test canary (issue 29): the agent asks its guard for one, and it must come back from
the daemon on the command path; health then means events and commands both get through. Real
daemon and agent processes, a real guard on the agent's socket.

- it comes back: the node's status at the daemon says when and how fast, the guard saw it,
  `kvguard fleet` and the metrics show it;
- a daemon whose port is open but whose process is stopped gets no canary back: the agent says
  once that it is late, and once again when it comes back.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
from agent_helpers import Lines, wait_for
from prometheus_client.parser import text_string_to_metric_families

from kvguard.agents.guard import AgentSink, Guard
from kvguard.cli.process import start_agent, start_daemon
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.ruleset import load_ruleset

INTERVAL = "0.3"


def status_of(address: str, node: str) -> svc.NodeStatus | None:
    with grpc.insecure_channel(address) as channel:
        state = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest(), timeout=10)
    found = [n.status for n in state.nodes if n.node == node and n.HasField("status")]
    return found[0] if found else None


def test_the_canary_comes_back_and_a_stopped_daemon_is_told_from_a_slow_one(tmp_path: Path) -> None:
    daemon = start_daemon(str(tmp_path / "audit.db"))
    agent = start_agent(
        str(tmp_path / "agent.sock"),
        daemon.address,
        str(tmp_path / "spool"),
        "--canary-interval",
        INTERVAL,
        "--metrics-listen",
        "127.0.0.1:0",
    )
    said = Lines(agent)
    sink = AgentSink(tmp_path / "agent.sock", "c0")
    guard = Guard("c0", ruleset=load_ruleset(), sink=sink)
    try:
        guard.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
        assert sink.flush()

        def came_back() -> bool:
            status = status_of(daemon.address, "c0")
            return status is not None and status.canary_ok_ns > 0 and not status.canary_late

        assert wait_for(came_back, timeout=60), said.lines
        status = status_of(daemon.address, "c0")
        assert status is not None and status.canary_rtt_us > 0
        assert guard.canary_ok_ns > 0  # the echo reached the guard too
        shown = subprocess.run(
            [sys.executable, "-m", "kvguard", "fleet", "--daemon", daemon.address],
            capture_output=True,
            text=True,
            timeout=60,
        )
        (row,) = [line for line in shown.stdout.splitlines() if line.startswith("c0 ")]
        assert re.search(r" connected +ok \d+ms ", row), row  # GUARD, then CANARY

        metrics_line = next(line for line in said.lines if "metrics on http://" in line)
        url = metrics_line.split("metrics on ", 1)[1]
        text = urllib.request.urlopen(url, timeout=10).read().decode()
        samples = {
            s.name: s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.labels.get("node") == "c0" or s.name == "kvguard_agent_canaries_total"
        }
        assert samples["kvguard_agent_canaries_total"] >= 1
        assert (
            samples["kvguard_agent_canary_late"] == 0
            and samples["kvguard_agent_canary_round_trip_seconds"] > 0
        )

        # Its port still open, its process stopped: no canary comes back, and the agent says so.
        daemon.proc.send_signal(signal.SIGSTOP)
        late = "the canary of c0 has not come back"
        try:
            assert wait_for(lambda: said.having(late), timeout=60), said.lines
        finally:
            daemon.proc.send_signal(signal.SIGCONT)
        back = "the canary of c0 came back"
        assert wait_for(lambda: said.having(back), timeout=60), said.lines
        assert len(said.having(late)) == 1  # said once, not at every interval
        assert "the daemon's commands are not getting through" in said.having(late)[0]
        assert wait_for(came_back, timeout=60)
    finally:
        sink.close()
        agent.stop()
        daemon.stop()
