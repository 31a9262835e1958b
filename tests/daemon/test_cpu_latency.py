"""`kvguard daemon --cpu-latency-us`: the machine's CPU wake-up bound (Linux PM QoS) is held
exactly while the daemon runs, however it ends, and a bound it cannot hold stops it at start
with the reason."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvguard import cli
from kvguard.cli.process import start_daemon
from kvguard.cli.send import send_capture
from kvguard.daemon import cpu_latency
from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR

INCIDENT = (DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl").read_text().splitlines()


def back_to(value: int, timeout: float = 10) -> int:
    """The bound in force once it is `value` again (or the timeout ran out)."""
    deadline = time.monotonic() + timeout
    while cpu_latency.current() != value and time.monotonic() < deadline:
        time.sleep(0.02)
    return cpu_latency.current()


def test_the_daemon_holds_the_bound_while_it_serves_and_drops_it_when_it_stops(tmp_path: Path) -> None:
    before = cpu_latency.current()
    store = str(tmp_path / "audit.db")
    daemon = start_daemon(store, 0, "--cpu-latency-us", "7")
    try:
        assert cpu_latency.current() == min(before, 7)
        # It serves as it would without the bound: the incident's findings are stored.
        summary = send_capture(INCIDENT, daemon.address)
        assert (summary.events, summary.accepted, summary.rejected) == (39, 39, [])
    finally:
        said = daemon.stop()
    assert "idle CPUs wake within 7 µs" in said
    assert back_to(before) == before
    s = Store(store)
    try:
        findings = [pb.Finding.FromString(b) for _, _, b in s.rows(kind="finding")]
    finally:
        s.close()
    assert len([f for f in findings if not f.details.get("update_of")]) == 11


def test_a_killed_daemon_leaves_no_bound_behind(tmp_path: Path) -> None:
    before = cpu_latency.current()
    daemon = start_daemon(str(tmp_path / "audit.db"), 0, "--cpu-latency-us", "0")
    assert cpu_latency.current() == 0
    daemon.kill()  # SIGKILL: the kernel drops the request with the process
    assert back_to(before) == before


def test_a_bound_the_daemon_may_not_set_stops_it_at_start_with_the_reason(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # A device it may not write (as where the daemon does not run as root; a read-only sysfs
    # file refuses root too), the daemon's own start in this process.
    monkeypatch.setattr(cpu_latency, "DEVICE", Path("/sys/devices/system/cpu/online"))
    store = tmp_path / "audit.db"
    assert (
        cli.main(["daemon", "--listen", "127.0.0.1:0", "--store", str(store), "--cpu-latency-us", "0"]) == 2
    )
    said = capsys.readouterr()
    assert "kvguard daemon: --cpu-latency-us: CPU wake-up latency 0 µs: cannot open /sys/devices" in said.err
    assert "Permission denied (it takes root" in said.err
    assert "READY" not in said.out and not store.exists()  # stopped before it opened the store


@pytest.mark.parametrize(("given", "why"), [("-1", "-1 µs is not between 0 and"), ("soon", "soon")])
def test_a_bound_that_is_not_one_is_refused_by_name(given: str, why: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", "daemon", f"--cpu-latency-us={given}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--cpu-latency-us" in done.stderr and why in done.stderr


def test_the_request_is_the_kernels_binary_form(tmp_path: Path) -> None:
    # What the kernel reads: one native 32-bit integer of microseconds (a file stands in here).
    device = tmp_path / "cpu_dma_latency"
    device.write_bytes(b"")
    fd = cpu_latency.hold(250, device)
    os.close(fd)
    assert device.read_bytes() == struct.pack("=i", 250)
    with pytest.raises(cpu_latency.CpuLatencyError, match=r"cannot open .*nowhere: No such file"):
        cpu_latency.hold(0, tmp_path / "nowhere")
    with pytest.raises(cpu_latency.CpuLatencyError, match="is not between 0 and"):
        cpu_latency.hold(cpu_latency.MAX_US + 1, device)
