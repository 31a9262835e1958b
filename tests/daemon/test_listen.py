"""Where the daemon listens: without TLS only on loopback (or a local socket), unless the
operator says --insecure, which it then says once at start; with mutual TLS anywhere. The
daemon runs as the process an operator starts; the address check itself is also tried with a
resolver that stands in for DNS (names that resolve beyond loopback)."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from log_lines import said as said_lines

from kvguard.cli.process import Service
from kvguard.daemon.access import ListenerError, check_listener
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc


def kvguard_daemon(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A daemon expected to refuse to start (one that starts would run until the timeout)."""
    store = str(tmp_path / "audit.db")
    return subprocess.run(
        [sys.executable, "-m", "kvguard", "daemon", "--store", store, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("listen", ["0.0.0.0:7463", "[::]:7463", ":7463"])
def test_a_plaintext_listener_beyond_loopback_is_refused_in_one_line(tmp_path: Path, listen: str) -> None:
    run = kvguard_daemon(tmp_path, "--listen", listen)
    assert run.returncode == 2 and run.stdout == ""  # never READY
    (line,) = said_lines(run.stderr)
    assert line.startswith(f"kvguard daemon: --listen {listen}: ")
    assert "anyone who reaches it could read the audit log and speak as any node" in line
    assert "--tls-ca" in line and "--insecure" in line
    assert not (tmp_path / "audit.db").exists()  # refused before the store is touched


def test_insecure_serves_beyond_loopback_and_warns_once(tmp_path: Path) -> None:
    store = str(tmp_path / "audit.db")
    daemon = Service("daemon", "--listen", "0.0.0.0:0", "--store", store, "--insecure", ready="READY ")
    port = daemon.line.split()[1]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            state = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest(), timeout=10)
        assert state.events == 0
    finally:
        said = daemon.stop()
    warnings = [line for line in said_lines(said) if "warning" in line]
    assert warnings == [
        "kvguard daemon: warning: plaintext gRPC on 0.0.0.0:0 (0.0.0.0 is every IPv4 interface), "
        "as --insecure allows: anyone who reaches it can read the audit log and speak as any node"
    ]


def test_loopback_by_name_serves_plaintext_without_a_warning(tmp_path: Path) -> None:
    daemon = Service("daemon", "--listen", "localhost:0", "--store", str(tmp_path / "a.db"), ready="READY ")
    said = daemon.stop()
    assert "warning" not in said and "listening on port" in said


# ------------------------------------------------------------------- the address check itself


def dns(table: dict[str, list[str]]) -> Callable[..., list[tuple[Any, ...]]]:
    """getaddrinfo over `table` (name -> addresses); other names do not resolve."""

    def resolve(host: str, port: object, *args: object, **kwargs: object) -> list[tuple[Any, ...]]:
        if host not in table:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (address, 0)) for address in table[host]]

    return resolve


NAMES = dns(
    {
        "db.example": ["10.0.0.5"],
        "split.example": ["127.0.0.1", "10.0.0.5"],
        "lo.example": ["127.0.0.1", "::1"],
    }
)


@pytest.mark.parametrize(
    "listen",
    [
        *("127.0.0.1:7463", "127.8.9.10:7463", "[::1]:7463", "[::ffff:127.0.0.1]:7463", "lo.example:7463"),
        *("unix:/run/kvguard/daemon.sock", "unix-abstract:kvguard"),
    ],
)
def test_loopback_and_local_sockets_need_no_tls(listen: str) -> None:
    assert check_listener(listen, tls=False, insecure=False, resolve=NAMES) is None


@pytest.mark.parametrize(
    ("listen", "reason"),
    [
        ("0.0.0.0:7463", "0.0.0.0 is every IPv4 interface"),
        ("[::]:7463", ":: is every interface"),
        (":7463", "an empty host is every interface"),
        ("10.1.2.3:7463", "10.1.2.3 is not a loopback address"),
        ("db.example:7463", "db.example resolves to 10.0.0.5, not a loopback address"),
        ("split.example:7463", "split.example resolves to 10.0.0.5, not a loopback address"),
        ("nowhere.example:7463", "cannot resolve nowhere.example (Name or service not known)"),
        ("::1:7463", "not host:port (an IPv6 address goes in brackets: [::1]:7463)"),
        ("127.0.0.1", "not host:port"),
        ("vsock:3:7463", "not host:port"),
    ],
)
def test_what_is_not_provably_local_is_refused_with_its_reason(listen: str, reason: str) -> None:
    with pytest.raises(ListenerError) as refused:
        check_listener(listen, tls=False, insecure=False, resolve=NAMES)
    assert str(refused.value).startswith(f"--listen {listen}: {reason}; ")
    warning = check_listener(listen, tls=False, insecure=True, resolve=NAMES)
    assert warning is not None and f"plaintext gRPC on {listen} ({reason}), as --insecure allows" in warning


def test_with_tls_any_address_is_fine_and_nothing_is_resolved() -> None:
    def no_dns(*args: object, **kwargs: object) -> list[tuple[Any, ...]]:
        raise AssertionError("resolved")

    for listen in ("0.0.0.0:7463", "[::]:7463", "db.example:7463"):
        assert check_listener(listen, tls=True, insecure=False, resolve=no_dns) is None


def test_an_address_in_use_stops_the_start_in_one_line(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = kvguard_daemon(tmp_path, "--listen", f"127.0.0.1:{port}")
    assert run.returncode == 2 and run.stdout == ""
    said = said_lines(run.stderr)[-1]
    assert said == f"kvguard daemon: cannot listen on 127.0.0.1:{port}: the address is in use"
    assert "Traceback" not in run.stderr
