"""The daemon's Prometheus metrics (`kvguard daemon --metrics-listen`; the endpoint is
proto/metrics_http.py's). A scrape reads the view every other client reads, the fleet state
(Daemon.fleet(), under the ingest's lock), and the latency histograms: nothing is counted
here, so the metrics, `kvguard fleet` and the dashboard never disagree. Names and labels
follow Prometheus' conventions (base units, `_total` counters, a `kvguard_` prefix), and
`promtool check metrics` passes them. No tenant or request is named: kinds, nodes, pools.

Invariant: a scrape only reads; a counter the daemon adds later is still exported (under
kvguard_daemon_other_total{name}) until it is given a name of its own here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvguard import __version__
from kvguard.daemon.latency import BOUNDS_S, PER_OCTAVE, Latencies
from kvguard.proto.vocabulary import LEDGER_WORK, REFUSALS

if TYPE_CHECKING:
    from kvguard.proto.kvguard.v1 import services_pb2 as svc

# Daemon counters with a metric of their own: name -> (metric, label values).
COMMANDS = {"kills": "kill", "quarantines": "quarantine"}
PREFIX_ACTION = "action_"
# what the daemon refused or could not judge (access_denied_<role>: a call its caller may not make)
REFUSED_PREFIXES = ("stream_", "rejected", "ledger_", "access_denied_")
# Daemon counters that are values, not counts (a record id, what a start replayed): gauges.
GAUGES = {
    "snapshot_through": (
        "kvguard_daemon_snapshot_record",
        "the audit record the ledger's last snapshot covers",
    ),
    "rebuilt_events": (
        "kvguard_daemon_rebuilt_events",
        "events the daemon replayed into its ledger at start",
    ),
}
NAMED = {"events", "findings", *COMMANDS, *GAUGES}


class DaemonCollector(Collector):
    """What a scrape sees: the fleet state, read at scrape time, and the stages' histograms."""

    def __init__(self, fleet: Callable[[], svc.FleetState], latencies: Latencies) -> None:
        self.fleet = fleet
        self.latencies = latencies

    def collect(self) -> Iterator[Metric]:
        state = self.fleet()
        info = InfoMetricFamily("kvguard_build", "kvguard's version")
        info.add_metric([], {"version": __version__})
        yield info
        mode = GaugeMetricFamily("kvguard_daemon_enforcing", "1 when the daemon orders kills (enforce mode)")
        mode.add_metric([], 1.0 if state.mode == "enforce" else 0.0)
        yield mode
        yield from self._counters(state)
        yield from self._nodes(state)
        yield from self._store(state.store)
        yield from self._latencies()

    def _counters(self, state: svc.FleetState) -> Iterator[Metric]:
        counters = dict(state.counters)
        events = CounterMetricFamily("kvguard_daemon_events", "events the daemon applied to its ledger")
        events.add_metric([], state.events)
        yield events
        requests = GaugeMetricFamily("kvguard_ledger_requests", "requests the ledger knows now")
        requests.add_metric([], state.requests)
        yield requests
        findings = CounterMetricFamily(
            "kvguard_findings",
            "findings the rules judged (each stored and alerted, or counted on the one it repeats), "
            "by kind, rule and severity",
            labels=["kind", "rule", "severity"],
        )
        for judged in state.judged:
            findings.add_metric([judged.kind, judged.rule, judged.severity], judged.count)
        yield findings
        found = CounterMetricFamily(
            "kvguard_ledger_findings",
            "what the ledger found, by kind, before the rules judged it",
            labels=["kind"],
        )
        for kind, n in sorted(state.findings.items()):
            found.add_metric([kind], n)
        yield found
        for name, (metric, doc) in GAUGES.items():
            if name in counters:
                gauge = GaugeMetricFamily(metric, doc)
                gauge.add_metric([], counters[name])
                yield gauge
        commands = CounterMetricFamily(
            "kvguard_daemon_commands", "commands sent to nodes' engines, by kind", labels=["command"]
        )
        for name, command in COMMANDS.items():
            commands.add_metric([command], counters.get(name, 0))
        yield commands
        actions = CounterMetricFamily(
            "kvguard_operator_actions", "operator actions, by kind", labels=["action"]
        )
        transitions = CounterMetricFamily("kvguard_ledger_page_transitions", "page state changes applied")
        work = CounterMetricFamily("kvguard_ledger_work", "ledger routine work, by kind", labels=["kind"])
        refused = CounterMetricFamily(
            "kvguard_daemon_refused",
            "input the daemon refused, dropped or could not judge, by reason (counted at every door)",
            labels=["reason"],
        )
        other = CounterMetricFamily("kvguard_daemon_other", "the daemon's other counts", labels=["name"])
        for name, n in sorted(counters.items()):
            if name in NAMED:
                continue
            if name == "ledger_page_transitions":
                transitions.add_metric([], n)
            elif name in LEDGER_WORK:
                work.add_metric([name.removeprefix("ledger_")], n)
            elif name.startswith(PREFIX_ACTION):
                actions.add_metric([name.removeprefix(PREFIX_ACTION)], n)
            elif name in REFUSALS or name.startswith(REFUSED_PREFIXES):
                refused.add_metric([name], n)
            else:
                other.add_metric([name], n)
        yield from (actions, transitions, work, refused, other)

    def _nodes(self, state: svc.FleetState) -> Iterator[Metric]:
        def gauge(name: str, doc: str, *labels: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=["node", *labels])

        connected = gauge("kvguard_node_agent_connected", "1 while the node's agent streams to the daemon")
        guard = gauge("kvguard_node_guard_connected", "1 while the in-engine guard is connected")
        lag = gauge("kvguard_node_lag_seconds", "age of the newest event of the node's last batch on arrival")
        last = gauge("kvguard_node_last_received_timestamp_seconds", "when the node's last batch arrived")
        spooled = gauge("kvguard_node_spooled_events", "events the node's agent holds, not yet acknowledged")
        canary_ok = gauge(
            "kvguard_node_canary_last_success_timestamp_seconds",
            "when the node's self-test canary last came back to its agent (guard, agent, daemon, back)",
        )
        canary_late = gauge("kvguard_node_canary_late", "1 while the node's agent says its canary is overdue")
        seq = gauge("kvguard_node_last_sequence", "the sequence number of the node's last event (this epoch)")
        dropped = CounterMetricFamily(
            "kvguard_node_dropped_events", "events the node dropped", labels=["node"]
        )
        restarts = CounterMetricFamily("kvguard_node_engine_restarts", "engine restarts", labels=["node"])
        gpu_info = gauge("kvguard_node_gpu_info", "the node's GPUs (NVML)", "gpu", "name", "uuid")
        gpu_total = gauge("kvguard_node_gpu_memory_total_bytes", "GPU memory", "gpu")
        gpu_used = gauge("kvguard_node_gpu_memory_used_bytes", "GPU memory in use, last said", "gpu")
        pages = gauge("kvguard_pool_pages", "pages of the pool", "pool", "role", "engine")
        in_use = gauge("kvguard_pool_pages_in_use", "pages of the pool a request or holder has", "pool")
        capacity = gauge("kvguard_pool_capacity_tokens", "tokens the pool holds (pages x page size)", "pool")
        context = gauge("kvguard_pool_context_tokens", "the context length the engine advertises", "pool")
        for node in state.nodes:
            name = node.node
            connected.add_metric([name], 1.0 if node.connected else 0.0)
            lag.add_metric([name], node.lag_ms / 1e3)
            if node.received_ns:
                last.add_metric([name], node.received_ns / 1e9)
            seq.add_metric([name], node.last_seq)
            dropped.add_metric([name], node.dropped)
            restarts.add_metric([name], node.restarts)
            if node.HasField("status"):
                status = node.status
                guard.add_metric([name], 1.0 if status.guard == "connected" else 0.0)
                spooled.add_metric([name], status.spooled)
                if status.canary_ok_ns or status.canary_waiting_since_ns:
                    canary_ok.add_metric([name], status.canary_ok_ns / 1e9)
                    canary_late.add_metric([name], 1.0 if status.canary_late else 0.0)
                for gpu in status.gpus:
                    index = str(gpu.index)
                    gpu_info.add_metric([name, index, gpu.name, gpu.uuid], 1.0)
                    gpu_total.add_metric([name, index], gpu.memory_total)
                    gpu_used.add_metric([name, index], gpu.memory_used)
            for pool in node.pools:
                r, label = pool.report, str(pool.report.pool)
                pages.add_metric([name, label, r.role, r.engine], r.num_pages)
                in_use.add_metric([name, label], pool.pages_in_use)
                capacity.add_metric([name, label], (r.num_pages - r.reserved_pages) * r.page_size)
                if r.context_len:
                    context.add_metric([name, label], r.context_len)
        yield from (connected, guard, lag, last, spooled, canary_ok, canary_late, seq, dropped, restarts)
        yield from (gpu_info, gpu_total, gpu_used, pages, in_use, capacity, context)

    def _store(self, room: svc.StoreRoom) -> Iterator[Metric]:
        used = GaugeMetricFamily("kvguard_store_used_bytes", "what the audit store takes")
        used.add_metric([], room.used_bytes)
        yield used
        if room.free_known:
            free = GaugeMetricFamily("kvguard_store_free_bytes", "free space on the store's file system")
            free.add_metric([], room.free_bytes)
            yield free
        reserve = GaugeMetricFamily("kvguard_store_reserve_bytes", "the free space below which intake stops")
        reserve.add_metric([], room.reserve_bytes)
        growth = GaugeMetricFamily("kvguard_store_growth_bytes_per_second", "the store's growth, last minute")
        growth.add_metric([], room.growth_bytes_per_s)
        refusing = GaugeMetricFamily("kvguard_store_refusing", "1 while batches are refused for want of room")
        refusing.add_metric([], 1.0 if room.refusing else 0.0)
        yield from (reserve, growth, refusing)

    def _latencies(self) -> Iterator[Metric]:
        family = HistogramMetricFamily(
            "kvguard_daemon_stage_latency_seconds",
            "from a batch's receipt to each stage: verdict (kills sent), alert (durable, to subscribers), "
            "sent (written to a subscriber), ack",
            labels=["stage"],
        )
        for stage, histogram in list(self.latencies.stages.items()):
            counts = list(histogram.counts)  # read once: the loop may record meanwhile
            buckets, seen = [], 0
            for k, n in enumerate(counts[:-1]):
                seen += n
                if (k + 1) % PER_OCTAVE == 0:  # octave bounds: few enough buckets for a dashboard
                    buckets.append((f"{BOUNDS_S[k]:.9g}", seen))
            buckets.append(("+Inf", sum(counts)))
            family.add_metric([stage], buckets, histogram.sum_s)
        yield family
