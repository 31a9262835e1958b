"""The audit store's room: the daemon measures it and says it in the fleet state, takes no more
events while the store's file system has less free than its reserve (the agent keeps them),
and takes them again once there is room, every event stored once. The full disk is real: a
small tmpfs that the test fills (root, as CI runs)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from kvguard.agents.guard import AgentSink, Guard
from kvguard.cli.options import byte_count
from kvguard.cli.process import start_agent, start_daemon
from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc

MiB = 1 << 20


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 64 MiB tmpfs of the test's own, to fill."""
    if os.geteuid() != 0:
        if os.environ.get("CI"):
            pytest.fail("mounting a tmpfs takes root, which CI has")
        pytest.skip("mounting a tmpfs takes root")
    where = tmp_path / "disk"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,mode=0700", "tmpfs", str(where)], check=True)
    try:
        yield where
    finally:
        subprocess.run(["umount", "--lazy", str(where)], check=False)


def test_kvguard_fleet_names_a_daemon_it_cannot_reach() -> None:
    shown = kvguard_fleet("127.0.0.1:1", "--timeout", "2")
    assert shown.returncode == 2 and shown.stdout == ""
    assert shown.stderr.startswith("kvguard fleet: daemon 127.0.0.1:1: the daemon cannot be reached")


def fleet(address: str) -> svc.FleetState:
    with grpc.insecure_channel(address) as channel:
        return svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest(), timeout=10)


def stored_seqs(store: str) -> list[int]:
    s = Store(store)
    try:
        return [pb.Event.FromString(body).seq for _, _, body in s.rows(kind="event")]
    finally:
        s.close()


def free_bytes(path: Path) -> int:
    room = os.statvfs(path)
    return room.f_bavail * room.f_frsize


def wait_for(condition: Callable[[], object], what: str, seconds: float = 30) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {seconds} s"
        time.sleep(0.1)


def kvguard_fleet(address: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvguard", "fleet", "--daemon", address, *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def traffic(guard: Guard, start: int, n: int) -> None:
    for i in range(start, start + n):
        pages = [i % 64]
        guard.admit(f"r{i}", "acme", 16, "decode")
        guard.alloc(f"r{i}", 0, pages)
        guard.write(f"r{i}", 0, pages)
        guard.check_attention(0, [f"r{i}"], np.array([pages]), np.array([16]))
        guard.free(f"r{i}", 0, pages)


def test_under_its_reserve_the_daemon_takes_no_events_until_there_is_room(
    small_disk: Path, tmp_path: Path
) -> None:
    store = str(small_disk / "audit.db")
    daemon = start_daemon(store, 0, "--store-reserve", "24M")
    agent = start_agent(str(tmp_path / "agent.sock"), daemon.address, str(tmp_path / "spool"))
    sink = AgentSink(tmp_path / "agent.sock", "d0")
    guard = Guard("d0", mode="monitor", sink=sink)
    guard.pool(0, "decode", page_size=16, num_pages=64, context_len=1024)
    said = ""
    try:
        traffic(guard, 0, 20)
        wait_for(lambda: len(stored_seqs(store)) == guard._seq, "the first events stored")
        room = fleet(daemon.address).store
        assert room.free_known and room.used_bytes > 0 and room.refusing == ""
        assert room.reserve_bytes == 24 * MiB
        assert abs(room.free_bytes - free_bytes(small_disk)) < 4 * MiB

        # Another tenant of the disk leaves it with 16 MiB free: under the reserve.
        ballast = small_disk / "ballast"
        with ballast.open("wb") as f:
            os.posix_fallocate(f.fileno(), 0, free_bytes(small_disk) - 16 * MiB)
        wait_for(lambda: fleet(daemon.address).store.refusing, "the refusal")
        refusing = fleet(daemon.address).store.refusing
        assert "under its reserve of 24.0 MiB" in refusing and store in refusing
        before = len(stored_seqs(store))
        traffic(guard, 20, 20)  # the engine goes on; its events wait in the agent's spool
        assert sink.flush()
        wait_for(lambda: fleet(daemon.address).counters["stream_store_full"] > 0, "a refused batch")
        assert len(stored_seqs(store)) == before
        shown = kvguard_fleet(daemon.address)  # what an operator runs: it says so, and exits 1
        assert shown.returncode == 1 and f"REFUSING EVENTS: {refusing}" in shown.stdout

        ballast.unlink()  # room again: the spooled events come in, each once
        wait_for(lambda: len(stored_seqs(store)) == guard._seq, "the spooled events stored")
        assert stored_seqs(store) == list(range(1, guard._seq + 1))
        assert fleet(daemon.address).store.refusing == ""
        shown = kvguard_fleet(daemon.address)
        assert shown.returncode == 0 and "REFUSING" not in shown.stdout
        (row,) = [line.split() for line in shown.stdout.splitlines() if line.startswith("d0 ")]
        assert row[:4] == ["d0", str(guard._seq), "yes", "connected"] and row[-3:] == [
            "0",
            "0:decode",
            "0/64",
        ]
        as_json = json.loads(kvguard_fleet(daemon.address, "-o", "json").stdout)
        assert int(as_json["store"]["used_bytes"]) > 0 and as_json["store"]["reserve_bytes"] == 24 * MiB
    finally:
        sink.close()
        agent.stop()
        said = daemon.stop()
    assert "under its reserve of 24.0 MiB: no events are taken until there is room" in said
    assert "the audit store has room again" in said


def test_the_store_says_what_it_takes_and_whether_its_free_space_is_seen(store_url: str) -> None:
    s = Store(store_url)
    try:
        used, free = s.space()
    finally:
        s.close()
    assert used > 0
    # A PostgreSQL server's disk is not the daemon's to see; an SQLite file's is.
    assert (free is None) == store_url.startswith("postgresql")


def test_store_reserve_sizes_read_as_bytes() -> None:
    assert [byte_count(t) for t in ("0", "4096", "256M", "1.5G", "2GiB", "1t")] == [
        0,
        4096,
        256 * MiB,
        1536 * MiB,
        2048 * MiB,
        1 << 40,
    ]
    for bad in ("-1M", "lots", "", "nanG"):
        with pytest.raises(argparse.ArgumentTypeError, match="size"):
            byte_count(bad)
