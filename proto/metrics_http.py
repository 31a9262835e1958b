"""A Prometheus endpoint (/metrics over HTTP, prometheus_client's server on its own thread)
for a collector: the daemon's (daemon/metrics.py) and the agent's (agents/metrics.py) share it.

Invariant: an address that cannot be listened on is a MetricsError naming it and why, before
anything else of the process starts serving; `stop()` closes the socket.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from kvguard.proto.channel import Tls


class MetricsError(OSError):
    """The metrics endpoint could not listen (the message names the address and why)."""


@dataclass
class MetricsServer:
    """The HTTP endpoint (/metrics) on its own thread; `port` the one it listens on, `url`
    where to scrape it."""

    port: int
    url: str
    stop: Callable[[], None]


class CertificateExpiry(Collector):
    """When the process's own TLS certificate and its CA expire (read once: a new certificate
    takes a restart), for an alert before the day mutual TLS stops working."""

    def __init__(self, tls: Tls) -> None:
        from cryptography import x509

        self.expiry = {
            name: x509.load_pem_x509_certificate(pem).not_valid_after_utc.timestamp()
            for name, pem in (("own", tls.cert), ("ca", tls.ca))
        }

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "kvguard_tls_certificate_expiry_timestamp_seconds",
            "when this process's TLS certificate (own) and the CA it trusts (ca) expire",
            labels=["certificate"],
        )
        for name, at in self.expiry.items():
            gauge.add_metric([name], at)
        yield gauge


def serve_metrics(listen: str, collector: Collector, tls: Tls | None = None) -> MetricsServer:
    """Listen on `listen` (host:port; port 0 picks one) for scrapes of `collector` (and of
    the expiry of `tls`'s certificates, where the process has them)."""
    from prometheus_client.exposition import start_http_server

    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise MetricsError(f"metrics address {listen!r}: the port is not a number") from None
    from prometheus_client import PlatformCollector, ProcessCollector

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ProcessCollector(registry=registry)  # process_*: CPU, memory, open files, start time
    PlatformCollector(registry=registry)  # python_info
    if tls is not None:
        registry.register(CertificateExpiry(tls))
    try:
        server, thread = start_http_server(number, addr=host, registry=registry)
    except OSError as exc:
        raise MetricsError(f"metrics address {listen!r}: {exc.strerror or exc}") from None

    def stop() -> None:
        server.shutdown()
        server.server_close()
        thread.join(5)

    bound = server.server_address[1]
    return MetricsServer(bound, f"http://{listen.rsplit(':', 1)[0]}:{bound}/metrics", stop)
