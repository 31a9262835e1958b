"""A Prometheus endpoint (/metrics over HTTP, prometheus_client's server on its own thread)
for a collector: the daemon's (daemon/metrics.py) and the agent's (agents/metrics.py) share it.

Invariant: an address that cannot be listened on is a MetricsError naming it and why, before
anything else of the process starts serving; `stop()` closes the socket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.registry import Collector, CollectorRegistry


class MetricsError(OSError):
    """The metrics endpoint could not listen (the message names the address and why)."""


@dataclass
class MetricsServer:
    """The HTTP endpoint (/metrics) on its own thread; `port` the one it listens on, `url`
    where to scrape it."""

    port: int
    url: str
    stop: Callable[[], None]


def serve_metrics(listen: str, collector: Collector) -> MetricsServer:
    """Listen on `listen` (host:port; port 0 picks one) for scrapes of `collector`."""
    from prometheus_client.exposition import start_http_server

    host, _, port = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        number = int(port)
    except ValueError:
        raise MetricsError(f"metrics address {listen!r}: the port is not a number") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
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
