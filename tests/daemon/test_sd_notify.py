"""systemd's notifications from the real daemon and agent (proto/sd_notify.py): a datagram
socket of the test's stands in for systemd's NOTIFY_SOCKET, and every message is checked to
come from the service's main process (NotifyAccess=main would drop any other)."""

from __future__ import annotations

import os
import signal
import socket
import struct
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from daemon_helpers import wait_for

from kvguard.cli.process import Service, start_agent, start_daemon
from kvguard.daemon.daemon import Daemon
from kvguard.daemon.store import Store
from kvguard.proto.sd_notify import Notifier, Watchdog

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


class NotifySocket:
    """What systemd listens on: an AF_UNIX datagram socket (a path, or an abstract `@` name)
    that records each message's fields and its sender's pid."""

    def __init__(self, abstract: bool) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self._dir = None
        if abstract:
            self.name = f"@kvguard-test-{uuid.uuid4().hex}"
            self.sock.bind("\0" + self.name[1:])
        else:  # short: a socket path has at most 107 bytes
            self._dir = tempfile.TemporaryDirectory(prefix="kvg-", dir="/tmp")
            self.name = f"{self._dir.name}/notify"
            self.sock.bind(self.name)
        self.sock.settimeout(20)

    def receive(self) -> tuple[dict[str, str], int]:
        """The next message's fields, and the pid that sent it."""
        data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(_CRED.size))
        pid = next(
            _CRED.unpack(body[: _CRED.size])[0]
            for level, kind, body in ancillary
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS
        )
        fields = dict(line.split("=", 1) for line in data.decode().split("\n"))
        return fields, pid

    def until(self, name: str, pid: int, log: list[dict[str, str]]) -> dict[str, str]:
        """Messages from `pid` (each appended to `log`) until one that holds `name`."""
        while True:
            fields, sender = self.receive()
            assert sender == pid, f"{fields} came from pid {sender}, not the service's {pid}"
            log.append(fields)
            if name in fields:
                return fields

    def close(self) -> None:
        self.sock.close()
        if self._dir is not None:
            self._dir.cleanup()


@pytest.fixture(params=[False, True], ids=["path", "abstract"])
def notify(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[NotifySocket]:
    sock = NotifySocket(abstract=request.param)
    # What systemd sets for a Type=notify service with WatchdogSec=1 (the children inherit it).
    monkeypatch.setenv("NOTIFY_SOCKET", sock.name)
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    yield sock
    sock.close()


def _said(log: list[dict[str, str]]) -> list[str]:
    """The states the messages announced, in order, the watchdog's pings left out."""
    states = ("READY", "RELOADING", "STOPPING", "STATUS")
    return [next(k for k in states if k in m) for m in log if "WATCHDOG" not in m]


def _ready_pings_reload_stop(service: Service, notify: NotifySocket) -> tuple[list[dict[str, str]], str]:
    pid, log = service.proc.pid, []
    try:
        ready = notify.until("READY", pid, log)
        assert ready["READY"] == "1"
        for _ in range(3):  # pinged again and again while it runs
            assert notify.until("WATCHDOG", pid, log)["WATCHDOG"] == "1"
        service.proc.send_signal(signal.SIGHUP)
        reloading = notify.until("RELOADING", pid, log)
        assert reloading["RELOADING"] == "1" and int(reloading["MONOTONIC_USEC"]) > 0
        assert notify.until("READY", pid, log)["READY"] == "1"
    finally:
        err = service.stop()
    assert notify.until("STOPPING", pid, log)["STOPPING"] == "1"
    assert _said(log) == ["READY", "RELOADING", "READY", "STOPPING"]
    return log, err


def test_the_daemon_says_ready_pings_the_watchdog_and_says_its_reload_and_stop(
    tmp_path: Path, notify: NotifySocket
) -> None:
    daemon = start_daemon(str(tmp_path / "audit.db"))
    port = daemon.address.rsplit(":", 1)[1]
    log, err = _ready_pings_reload_stop(daemon, notify)
    ready, reloading, reloaded, stopping = [m for m in log if "WATCHDOG" not in m]
    assert ready["STATUS"] == f"serving on port {port}"
    assert reloading["STATUS"] == "reloading (SIGHUP)"
    assert reloaded["STATUS"].startswith(f"serving on port {port}; reloaded (SIGHUP): rules ")
    assert "0 added, 0 removed, 0 changed" in reloaded["STATUS"]
    assert stopping["STATUS"].startswith("stopping")
    assert "rules reloaded from the bundled rules" in err and "cannot notify" not in err


def test_the_agent_says_ready_pings_the_watchdog_and_answers_a_reload(
    tmp_path: Path, notify: NotifySocket
) -> None:
    sock = tmp_path / "agent.sock"
    agent = start_agent(str(sock), "127.0.0.1:1", str(tmp_path / "spool"))  # no daemon needed
    log, err = _ready_pings_reload_stop(agent, notify)
    ready = log[0]
    assert ready["STATUS"] == f"guards connect to {sock}; daemon 127.0.0.1:1"
    assert "log settings reloaded: level info, format text" in err


def test_the_watchdog_goes_quiet_while_the_daemon_loop_is_stuck(tmp_path: Path) -> None:
    # The real daemon's loop, held by a callback that waits: its heartbeat stops, so do the
    # pings; they start again once it goes round.
    store = Store(str(tmp_path / "audit.db"))
    daemon = Daemon(store, mode="monitor")
    sock = NotifySocket(abstract=True)
    notifier = Notifier({"NOTIFY_SOCKET": sock.name, "WATCHDOG_USEC": "400000"})
    daemon.start_heartbeat(0.1)
    watchdog = Watchdog(notifier, lambda: daemon.heartbeat_at, "the daemon's loop").start()
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        held.set()
        release.wait(30)

    try:
        log: list[dict[str, str]] = []
        sock.until("WATCHDOG", os.getpid(), log)
        daemon.loop.call_soon_threadsafe(hold)
        assert held.wait(10)
        wait_for(lambda: watchdog.withheld >= 1)
        pinged = watchdog.pinged
        wait_for(lambda: watchdog.withheld >= 3)
        assert watchdog.pinged == pinged  # nothing sent while the loop stood still
        release.set()
        wait_for(lambda: watchdog.pinged > pinged)
        sock.sock.settimeout(0)
        while True:  # every ping sent arrived, and none other
            try:
                fields, _ = sock.receive()
            except BlockingIOError:
                break
            log.append(fields)
        assert log == [{"WATCHDOG": "1"}] * watchdog.pinged and notifier.sent == watchdog.pinged
    finally:
        release.set()
        watchdog.stop()
        notifier.close()
        daemon.close()
        store.close()
        sock.close()


def test_without_notify_socket_nothing_is_sent_and_a_watchdog_for_another_pid_is_not_ours() -> None:
    quiet = Notifier({})
    assert not quiet.enabled and not quiet.ready("x") and quiet.sent == quiet.failed == 0
    assert quiet.watchdog_s is None
    env = {"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "5000000"}
    theirs = Notifier({**env, "WATCHDOG_PID": str(os.getpid() + 1)})  # meant for our parent
    assert theirs.watchdog_s is None
    ours = Notifier({**env, "WATCHDOG_PID": str(os.getpid())})
    assert ours.watchdog_s == 5.0
    with pytest.raises(ValueError, match="WATCHDOG_USEC is not set"):
        Watchdog(quiet, lambda: 0.0)


def test_a_notify_socket_that_is_gone_is_counted_and_said_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "no-such-socket")}, component="test")
    assert not gone.ready() and not gone.watchdog()
    assert gone.failed == 2 and gone.sent == 0
    err = capsys.readouterr().err
    assert err.count("kvguard test: cannot notify systemd at NOTIFY_SOCKET=") == 1
    assert "no-such-socket" in err
    gone.close()
