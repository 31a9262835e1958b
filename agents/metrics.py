"""The node agent's Prometheus metrics (`kvguard agent --metrics-listen`; the endpoint is
proto/metrics_http.py's): its counters (what it took from guards, probes and the witness,
what it refused at its door, what the daemon acknowledged), whether it reaches the daemon,
each node's spooled events and guard, and the host's GPUs as NVML told it at start.

Invariant: a scrape only reads the agent's state (copies, no lock held across a scrape); a
counter the agent adds later is still exported (kvguard_agent_other_total{name}).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from kvguard import __version__

if TYPE_CHECKING:
    from kvguard.agents.agent import Agent

# Counters with a metric of their own: name -> (metric, help).
OWN = {
    "events": ("kvguard_agent_events", "events taken from guards, probes and the witness"),
    "acked": ("kvguard_agent_acked_events", "events the daemon acknowledged as durable"),
    "commands": ("kvguard_agent_commands", "daemon commands relayed to guards"),
    "canaries": ("kvguard_agent_canaries", "self-test canaries that came back from the daemon"),
    "reconnects": ("kvguard_agent_daemon_reconnects", "streams to the daemon opened again"),
    "witnessed": ("kvguard_agent_witnessed_transfers", "KV transfers the eBPF witness saw"),
    "shim_records": ("kvguard_agent_shim_records", "records from the LD_PRELOAD shim"),
    "guards_gone": ("kvguard_agent_guards_gone", "in-engine guards that went away"),
}
# Refused, dropped or unreadable input, by reason.
REFUSED = (
    "rejected",
    "oversized",
    "malformed",
    "shim_refused",
    "frame_timeouts",
    "spool_set_aside",
    "probe_unreadable",
    "rdma_unlabelled",
)


class AgentCollector(Collector):
    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self.agent
        counters = dict(agent.counters)
        info = InfoMetricFamily("kvguard_build", "kvguard's version")
        info.add_metric([], {"version": __version__})
        yield info
        for name, (metric, doc) in OWN.items():
            family = CounterMetricFamily(metric, doc)
            family.add_metric([], counters.get(name, 0))
            yield family
        refused = CounterMetricFamily(
            "kvguard_agent_refused", "input refused, dropped or unreadable, by reason", labels=["reason"]
        )
        other = CounterMetricFamily("kvguard_agent_other", "the agent's other counts", labels=["name"])
        for name, n in sorted(counters.items()):
            if name in REFUSED:
                refused.add_metric([name], n)
            elif name not in OWN:
                other.add_metric([name], n)
        yield from (refused, other)
        reach = GaugeMetricFamily("kvguard_agent_daemon_reachable", "1 while the daemon answers")
        reach.add_metric([], 1.0 if agent.reach.reached else 0.0)
        yield reach
        spooled = GaugeMetricFamily(
            "kvguard_agent_spooled_events", "events held, not yet acknowledged, by stream", labels=["stream"]
        )
        for stream, spool in sorted(dict(agent.spools).items()):
            spooled.add_metric([stream], len(spool.pending))
        yield spooled
        guard = GaugeMetricFamily(
            "kvguard_agent_guard_connected", "1 while the in-engine guard is connected", labels=["node"]
        )
        for node, state in sorted(dict(agent.guards).items()):
            guard.add_metric([node], 1.0 if state.guard == "connected" else 0.0)
        yield guard
        back = GaugeMetricFamily(
            "kvguard_agent_canary_last_success_timestamp_seconds",
            "when the node's self-test canary last came back (guard, agent, daemon and back)",
            labels=["node"],
        )
        rtt = GaugeMetricFamily(
            "kvguard_agent_canary_round_trip_seconds", "the last canary's round trip", labels=["node"]
        )
        late = GaugeMetricFamily(
            "kvguard_agent_canary_late",
            "1 while the node's canary is overdue (said in the log)",
            labels=["node"],
        )
        for node, canary in sorted(dict(agent.canaries).items()):
            back.add_metric([node], canary.ok_ns / 1e9)
            rtt.add_metric([node], canary.rtt_s)
            late.add_metric([node], 1.0 if canary.late else 0.0)
        yield from (back, rtt, late)
        gpus = GaugeMetricFamily(
            "kvguard_agent_gpu_info", "GPUs (NVML at start)", labels=["gpu", "name", "uuid", "driver"]
        )
        memory = GaugeMetricFamily("kvguard_agent_gpu_memory_total_bytes", "GPU memory", labels=["gpu"])
        for gpu in agent.gpu.gpus:
            gpus.add_metric([str(gpu["index"]), gpu["name"], gpu["uuid"], agent.gpu.driver], 1.0)
            memory.add_metric([str(gpu["index"])], gpu["memory_total"])
        yield from (gpus, memory)
