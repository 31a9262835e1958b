"""The LD_PRELOAD shim (`make shim`): it intercepts real calls into the CUDA runtime library
present here (with no GPU they fail, which changes nothing: the interception is what is
tested), counts a named transfer's copies, and its record reaches the daemon through the
node agent as a wire event that contradicts a sender's claim of more."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvguard.cli.process import start_agent, start_daemon
from kvguard.cuda_hooks import steps
from kvguard.cuda_hooks.shim import (
    LAUNCH_RECORD,
    LIBRARY,
    MEMORY_RECORD,
    SHIM_RECORD,
    LaunchRecord,
    MemoryRecord,
    ShimListener,
    ShimRecord,
    parse_any,
    parse_record,
)
from kvguard.daemon.store import Store
from kvguard.proto import pb

KINDS = {"h2d": 1, "d2h": 2, "d2d": 3}

# The engine side: a guard that claims, copies under the transfer's name, in one process.
ENGINE = r"""
import ctypes, json, sys
from kvguard.cuda_hooks.shim import CopyLabel
copier, plan, agent = ctypes.CDLL(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
guard = None
if agent:
    from kvguard.agents.guard import Guard
    from kvguard.agents.guard import AgentSink
    guard = Guard("p0", mode="monitor", sink=AgentSink(agent, "p0"))
    guard.pool(0, "prefill", 16, 64, context_len=1024)
    guard.admit("r1", "acme", 32, "prefill")
    guard.alloc("r1", 0, [1, 2])
    guard.write("r1", 0, [1, 2])
    guard.sink.flush()
label = CopyLabel()
status = [copier.copy(n, kind, 0) for n, kind in plan["before"]]  # not part of the transfer
with label.transfer("p0-x1"):
    status += [copier.copy(n, kind, async_) for n, kind, async_ in plan["during"]]
with label.transfer("p0-x2"):
    pass  # a transfer that made no CUDA copy: nothing observed, nothing reported
if guard is not None:
    guard.xfer_send("r1", "p0-x1", "d0", 0, [1, 2], 32, plan["claimed"], [], "done")
    guard.sink.flush()
print(json.dumps({"shim": label.active, "status": status}), flush=True)
"""


@pytest.fixture(scope="module")
def copier(
    tmp_path_factory: pytest.TempPathFactory, build_copier: Callable[[Path, Path], Path], cuda_runtime: Path
) -> Path:
    assert LIBRARY.exists(), f"{LIBRARY} is not built: run `make shim`"
    return build_copier(tmp_path_factory.mktemp("copier"), cuda_runtime)


def run_engine(copier: Path, plan: dict, shim: str = "", agent: str = "", preload: bool = True) -> dict:
    env = dict(os.environ, KVGUARD_SHIM_SOCKET=shim)
    if preload:
        env["LD_PRELOAD"] = str(LIBRARY)
    out = subprocess.run(
        [sys.executable, "-c", ENGINE, str(copier), json.dumps(plan), agent],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(out.stdout)


def test_the_record_layout_is_the_shims() -> None:
    shim = ctypes.CDLL(str(LIBRARY))
    assert ctypes.c_size_t.in_dll(shim, "kvguard_shim_record_size").value == SHIM_RECORD.size
    assert ctypes.c_size_t.in_dll(shim, "kvguard_launch_record_size").value == LAUNCH_RECORD.size
    assert ctypes.c_size_t.in_dll(shim, "kvguard_memory_record_size").value == MEMORY_RECORD.size
    assert ctypes.c_size_t.in_dll(shim, "kvguard_steps_size").value == steps.SIZE


def test_bad_launch_and_memory_records_are_refused_with_the_reason() -> None:
    launch = LAUNCH_RECORD.pack(0x4C47564B, 1, 0, 7, 3, *range(1, 15), b"flash_fwd_kernel")
    parsed = parse_any(launch)
    assert isinstance(parsed, LaunchRecord) and parsed.steps_seen and parsed.kernel_in_graph
    assert (parsed.launches, parsed.quiet_steps, parsed.dropped, parsed.kernel) == (
        1,
        13,
        14,
        "flash_fwd_kernel",
    )
    memory = MEMORY_RECORD.pack(0x4D47564B, 1, 0, 7, 2, 3, 0, *range(8), b"cuMemUnmap")
    assert parse_any(memory) == MemoryRecord(2, "unmapped", 0, 1, 2, 3, 4, 5, 6, 7, "cuMemUnmap")
    for data, reason in [
        (launch[:-1], "launch record of 319 bytes (expected 320)"),
        (launch[:4] + b"\x02\0" + launch[6:], "launch record version 2 (this agent reads 1)"),
        (memory + b"\0", "memory record of 121 bytes (expected 120)"),
        (MEMORY_RECORD.pack(0x4D47564B, 1, 0, 7, 2, 9, 0, *range(8), b""), "memory record of kind 9"),
        (b"KV", "shim record of 2 bytes"),
    ]:
        with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
            parse_any(data)


def test_bad_records_are_refused_with_the_reason() -> None:
    good = SHIM_RECORD.pack(0x5347564B, 1, 0, 7, 0, b"x1", *([0] * 12))
    assert parse_record(good).xfer == "x1"
    for data, reason in [
        (good[:-1], "shim record of 239 bytes (expected 240)"),
        (b"\0" * 4 + good[4:], "magic 0x0 is not 0x5347564b"),
        (good[:4] + b"\x02\0" + good[6:], "version 2 (this agent reads 1)"),
        (SHIM_RECORD.pack(0x5347564B, 1, 0, 7, 0, b"", *([0] * 12)), "names no transfer"),
    ]:
        with pytest.raises(ValueError, match=reason.replace("(", r"\(").replace(")", r"\)")):
            parse_record(data)


def test_the_shim_counts_real_cuda_runtime_calls_of_a_named_transfer(copier: Path, tmp_path: Path) -> None:
    got: list[tuple[int, ShimRecord]] = []
    arrived = threading.Event()

    def take(pid: int, record: ShimRecord) -> None:
        got.append((pid, record))
        if len(got) == 2:
            arrived.set()

    listener = ShimListener(tmp_path / "shim.sock", take, print)
    plan = {
        "before": [[10, KINDS["h2d"]]],
        "during": [[4096, KINDS["d2h"], 0], [4096, KINDS["d2h"], 1], [1000, KINDS["d2d"], 1]],
    }
    try:
        shimmed = run_engine(copier, plan, str(tmp_path / "shim.sock"))
        assert arrived.wait(10)
    finally:
        listener.close()
    plain = run_engine(copier, plan, preload=False)
    # The shim passes every call through: the caller sees what the runtime returned.
    assert shimmed["status"] == plain["status"] and shimmed["shim"] and not plain["shim"]
    status = shimmed["status"][1:]
    (pid, record), (_, empty) = got
    assert pid > 0 and record.xfer == "p0-x1" and record.calls == 3
    assert (empty.xfer, empty.calls, sum(empty.bytes.values())) == ("p0-x2", 0, 0)  # the agent drops it
    calls = list(zip(plan["during"], status, strict=True))
    copied = {name: sum(n for (n, k, _), s in calls if s == 0 and k == KINDS[name]) for name in KINDS}
    assert {name: record.bytes[name] for name in KINDS} == copied  # the h2d before it is not in it
    failed = [n for (n, _, _), s in calls if s != 0]
    assert (record.failed, record.failed_bytes) == (len(failed), sum(failed))
    assert record.last_error == (next((s for s in reversed(status) if s), 0))
    assert record.dropped == 0


def test_the_shim_alone_contradicts_a_sender_that_claims_more(copier: Path, tmp_path: Path) -> None:
    # The engine copies half of a transfer off its GPU and claims all of it sent; the shim's
    # count reaches the daemon through the node agent as p0/shim's wire event.
    store = str(tmp_path / "audit.db")
    daemon = start_daemon(store)
    sock = str(tmp_path / "agent.sock")
    agent = start_agent(sock, daemon.address, str(tmp_path / "spool"))
    plan = {"before": [], "during": [[4096, KINDS["d2h"], 0]], "claimed": 8192}
    try:
        result = run_engine(copier, plan, f"{sock}.shim", sock)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            s = Store(store)
            findings = [pb.Finding.FromString(b) for _, _, b in s.rows(kind="finding")]
            wires = [pb.Event.FromString(b) for _, _, b in s.rows(kind="event", node="p0/shim")]
            s.close()
            if findings and wires:
                break
            time.sleep(0.2)
    finally:
        agent.stop()
        daemon.stop()
    (seen,) = wires
    copied = 4096 if result["status"] == [0] else 0
    assert (seen.wire.xfer, seen.wire.bytes, seen.wire.probe, seen.wire.complete) == (
        "p0-x1",
        copied,
        "shim:cuda",
        True,
    )
    (mismatch,) = findings
    assert (mismatch.finding, mismatch.req, mismatch.tenant) == ("transfer_mismatch", "r1", "acme")
    assert dict(mismatch.details) == {
        "xfer": "p0-x1",
        "what": "wire_bytes",
        "expected": "8192",
        "observed": str(copied),
        "probe": "shim:cuda",
    }
