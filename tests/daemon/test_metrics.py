"""The daemon's Prometheus endpoint, scraped over real HTTP from a real daemon fed real events:
parsed by the official client's parser, its values those of the fleet state (events, findings
by kind, nodes, GPUs from the agent's status, pools, the stages' histograms), and its names
passed by promtool's linter."""

from __future__ import annotations

import itertools
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

from daemon_helpers import stale_reads, wait_for
from prometheus_client.parser import text_string_to_metric_families

from kvguard.agents.guard import AgentSink, Guard
from kvguard.agents.upstream import AgentStream
from kvguard.cli.process import start_agent, start_daemon
from kvguard.proto import pb
from kvguard.proto.channel import channel
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.ruleset import load_ruleset

GIB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return response.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_a_scrape_tells_what_the_fleet_state_tells(tmp_path: Path) -> None:
    port = free_port()
    daemon = start_daemon(str(tmp_path / "audit.db"), 0, "--metrics-listen", f"127.0.0.1:{port}")
    node = AgentStream(channel(daemon.address, None), "p0")
    try:
        events = stale_reads("p0", 3)
        node.status(
            svc.NodeStatus(
                guard="connected",
                gpus=[
                    svc.Gpu(
                        index=0, name="NVIDIA H200", uuid="GPU-1", memory_total=141 * GIB, memory_used=GIB
                    )
                ],
                spooled=7,
            )
        )
        assert node.send(events).accepted == len(events)
        wait_for(
            lambda: (
                samples(scrape(port)).get(("kvguard_ledger_findings_total", (("kind", "stale_read"),))) == 3
            )
        )
        text = scrape(port)
        got = samples(text)
        # Findings by kind, rule and severity: "critical findings a minute" is one PromQL line.
        # Every combination the rules can give is there from the start (0), the same series
        # after a restart; the three stale reads are counted under the rule that judged them.
        series = {
            (labels["kind"], labels["rule"], labels["severity"]): value
            for (name, pairs), value in got.items()
            if name == "kvguard_findings_total"
            for labels in [dict(pairs)]
        }
        rules = [r for r in load_ruleset().rules if r.enabled]
        assert set(series) == {(k, r.id, r.severity) for r in rules for k in r.kinds}
        ((kind, rule, severity),) = [key for key, value in series.items() if value]
        assert (kind, series[kind, rule, severity]) == ("stale_read", 3)
        # Values are gauges, not counters; the process's own metrics are there.
        assert not any(k[0] == "kvguard_daemon_other_total" and "snapshot" in str(k[1]) for k in got)
        assert ("kvguard_daemon_rebuilt_events", ()) in got
        assert got[("process_cpu_seconds_total", ())] > 0 and ("process_resident_memory_bytes", ()) in got
        assert got[("kvguard_daemon_events_total", ())] == len(events)
        assert got[("kvguard_build_info", (("version", "0.1.0"),))] == 1
        assert got[("kvguard_daemon_enforcing", ())] == 1
        assert got[("kvguard_node_agent_connected", (("node", "p0"),))] == 1
        assert got[("kvguard_node_guard_connected", (("node", "p0"),))] == 1
        assert got[("kvguard_node_spooled_events", (("node", "p0"),))] == 7
        assert got[("kvguard_node_gpu_memory_total_bytes", (("gpu", "0"), ("node", "p0")))] == 141 * GIB
        info = (("gpu", "0"), ("name", "NVIDIA H200"), ("node", "p0"), ("uuid", "GPU-1"))
        assert got[("kvguard_node_gpu_info", info)] == 1
        assert got[("kvguard_node_last_sequence", (("node", "p0"),))] == events[-1].seq
        pools = {k: v for k, v in got.items() if k[0] == "kvguard_pool_pages"}
        assert list(pools.values()) == [events[0].pool.num_pages], pools
        # Each stage's histogram: cumulative buckets ending in +Inf = _count, seconds in _sum.
        ack = sorted(
            (float(dict(labels)["le"]), value)
            for (name, labels), value in got.items()
            if name == "kvguard_daemon_stage_latency_seconds_bucket" and dict(labels)["stage"] == "ack"
        )
        assert ack[-1] == (
            float("inf"),
            got[("kvguard_daemon_stage_latency_seconds_count", (("stage", "ack"),))],
        )
        assert ack[-1][1] >= 1 and all(a[1] <= b[1] for a, b in itertools.pairwise(ack))
        assert 0 < got[("kvguard_daemon_stage_latency_seconds_sum", (("stage", "ack"),))] < 60
        # promtool's linter: names, units, _total suffixes, help texts.
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert (lint.returncode, lint.stdout + lint.stderr) == (0, "")
        # A refusal is counted as one, by its reason (here an event that carries nothing).
        empty = pb.Event(node="p0", seq=events[-1].seq + 1, ts_ns=events[-1].ts_ns + 1)
        assert len(node.send([empty]).rejected) == 1
        refused = ("kvguard_daemon_refused_total", (("reason", "malformed"),))
        wait_for(lambda: samples(scrape(port)).get(refused) == 1)
        # The agent gone: said at the next scrape.
        node.close()
        wait_for(lambda: samples(scrape(port))[("kvguard_node_agent_connected", (("node", "p0"),))] == 0)
    finally:
        node.close()
        daemon.stop()


def test_a_metrics_address_in_use_stops_the_start_and_says_so(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                *(sys.executable, "-m", "kvguard", "daemon", "--listen", "127.0.0.1:0"),
                *("--store", str(tmp_path / "audit.db"), "--metrics-listen", f"127.0.0.1:{port}"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert f"kvguard daemon: metrics address '127.0.0.1:{port}': Address already in use" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_agents_scrape_tells_what_it_took_and_whether_it_reaches_the_daemon(tmp_path: Path) -> None:
    port = free_port()
    daemon = start_daemon(str(tmp_path / "audit.db"))
    sock = tmp_path / "agent.sock"
    agent = start_agent(
        str(sock), daemon.address, str(tmp_path / "spool"), "--metrics-listen", f"127.0.0.1:{port}"
    )
    sink = AgentSink(sock, "d0")
    guard = Guard("d0", mode="monitor", ruleset=load_ruleset(), sink=sink)
    try:
        guard.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
        guard.admit("r1", "acme", 16, "decode")
        guard.alloc("r1", 0, [5, 6])
        sink.flush()

        def acked() -> bool:
            got = samples(scrape(port))
            return got.get(("kvguard_agent_acked_events_total", ()), 0) >= 3

        wait_for(acked, timeout=20)
        text = scrape(port)
        got = samples(text)
        assert got[("kvguard_agent_events_total", ())] == 3
        assert got[("kvguard_agent_daemon_reachable", ())] == 1
        assert got[("kvguard_agent_guard_connected", (("node", "d0"),))] == 1
        assert got[("kvguard_agent_spooled_events", (("stream", "d0"),))] == 0
        assert got[("kvguard_agent_refused_total", (("reason", "malformed"),))] == 0
        lint = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True)
        assert (lint.returncode, lint.stdout + lint.stderr) == (0, "")
        # The daemon gone: the agent says it cannot reach it, and holds what comes.
        daemon.stop()
        guard.admit("r2", "acme", 16, "decode")
        sink.flush()
        wait_for(lambda: samples(scrape(port))[("kvguard_agent_daemon_reachable", ())] == 0, timeout=20)
        wait_for(lambda: samples(scrape(port))[("kvguard_agent_spooled_events", (("stream", "d0"),))] == 1)
    finally:
        sink.close()
        agent.stop()
        daemon.stop()


def test_a_daemon_with_tls_says_when_its_certificate_and_ca_expire(tmp_path: Path) -> None:
    from certificates import make_pki, tls_args
    from cryptography import x509

    pki = make_pki(tmp_path)
    port = free_port()
    daemon = start_daemon(
        str(tmp_path / "audit.db"), 0, *tls_args(pki, "daemon"), "--metrics-listen", f"127.0.0.1:{port}"
    )
    try:
        got = samples(scrape(port))
    finally:
        daemon.stop()
    for certificate, pem in (("own", "daemon.pem"), ("ca", "ca.pem")):
        expiry = x509.load_pem_x509_certificate((pki / pem).read_bytes()).not_valid_after_utc.timestamp()
        assert (
            got[("kvguard_tls_certificate_expiry_timestamp_seconds", (("certificate", certificate),))]
            == expiry
        )
