"""The shim's launch and allocation witnesses (`make shim`), in a real engine process: a
Python process with the shim preloaded, a real Guard streaming to a real node agent and
daemon, and the stand-in CUDA driver and runtime (testbed/standin, built here) reached the
ways engines reach the real ones: the runtime dlopens the driver and asks cuGetProcAddress_v2
for what it calls, the engine dlsyms the driver's handle for launches (as Triton does).

What a user depends on: every attention launch after a guard check is clean; one with no
check before it, and a graph replay whose step no check covered, are findings that name the
kernel, the node and the step; other kernels never are; a pool is matched to the memory
under it, and freeing that memory under live requests is caught.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvguard.cli.process import start_agent, start_daemon
from kvguard.cuda_hooks.shim import LIBRARY, ShimListener
from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.testbed.standin import build

ENGINE = r"""
import json, sys, time
import numpy as np
from kvguard.daemon.store import Store
from kvguard.agents.guard import AgentSink, Guard
from kvguard.testbed.standin import StandinCuda

cuda = StandinCuda(sys.argv[1])
guard = Guard("p0", mode="monitor", sink=AgentSink(sys.argv[2], "p0"))
attention = cuda.function("_Z31kvguard_testbed_paged_attentionPfS_")
norm, gemm = cuda.function("kvguard_testbed_rmsnorm"), cuda.function("ampere_sgemm_128x64_tn")
PAGE_BYTES = 4096
guard.pool(0, "decode", 16, 64, context_len=1024)
guard.pool(1, "decode", 16, 64, context_len=1024)
kv = cuda.malloc(64 * PAGE_BYTES)                # the runtime's cudaMalloc: the whole pool
short = cuda.reserve_and_map(32 * PAGE_BYTES, 8 * PAGE_BYTES)  # mapped for half of pool 1
guard.pool_memory(0, [(kv, 64 * PAGE_BYTES)])
guard.pool_memory(1, [(short, 64 * PAGE_BYTES)])
guard.admit("r1", "acme", 32, "decode")
guard.alloc("r1", 0, [1, 2])
guard.write("r1", 0, [1, 2])
tables, lens = np.array([[1, 2]]), np.array([32])

def step(kernels):
    guard.check_attention(0, ["r1"], tables, lens)
    status = [cuda.launch(k) for k in kernels]
    guard.step_done()
    return status

status = step([norm, attention, gemm, attention])   # steps 1: guarded
status += step([attention])                          # 2: guarded
status.append(cuda.launch(norm))                     # between steps: not attention, ignored
status.append(cuda.launch(attention))                # unguarded, after step 2 ended
s = cuda.stream()
graph = cuda.capture(s, [norm, attention])           # captured: recorded, not run
guard.check_attention(0, ["r1"], tables, lens)
status.append(cuda.graph_launch(graph, s))           # 3: the graph replays a checked batch
guard.step_done()
status.append(cuda.graph_launch(graph, s))           # a stale replay: no check of its step
stub = cuda.register("_Z31kvguard_testbed_paged_attentionPfS_")
guard.check_attention(0, ["r1"], tables, lens)
status.append(cuda.runtime_launch(stub, s))          # 4: through the runtime, guarded, counted once
guard.step_done()
# The daemon judges a free against the pages as it knows them when it applies it, and the
# shim's record goes at once while the guard's events may still be on their way (another
# stream): as in an engine, whose pages were granted long before, the daemon has them first
# (ledger/witness.py; CI once applied the free first).
guard.sink.flush()
store = Store(sys.argv[3])
while len(list(store.rows(kind="event", node="p0"))) < guard._seq:
    time.sleep(0.05)
store.close()
cuda.free(kv)                                        # pool 0's memory, while r1 holds 2 pages
guard.sink.flush()
print(json.dumps({"status": status, "runs": cuda.runs(attention)}), flush=True)
"""


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert LIBRARY.exists(), f"{LIBRARY} is not built: run `make shim`"
    return build(tmp_path_factory.mktemp("standin"))


def run_engine(standin: Path, agent_sock: str, store: str) -> dict[str, list[int] | int]:
    env = {**os.environ, "LD_PRELOAD": str(LIBRARY), "KVGUARD_SHIM_SOCKET": f"{agent_sock}.shim"}
    env.pop("KVGUARD_STEPS", None)
    done = subprocess.run(
        [sys.executable, "-c", ENGINE, str(standin), agent_sock, store],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, list[int] | int] = json.loads(done.stdout.splitlines()[-1])
    return result


def stored(store: str, want: int) -> tuple[list[pb.Finding], list[pb.Event]]:
    """The daemon's findings and p0/shim's events, once `want` findings are in."""
    deadline = time.monotonic() + 30
    while True:
        s = Store(store)
        findings = [pb.Finding.FromString(b) for _, _, b in s.rows(kind="finding")]
        shim = [pb.Event.FromString(b) for _, _, b in s.rows(kind="event", node="p0/shim")]
        s.close()
        if len(findings) >= want or time.monotonic() > deadline:
            return findings, shim
        time.sleep(0.2)


def test_the_witness_catches_unguarded_attention_and_pool_memory_let_go(
    standin: Path, tmp_path: Path
) -> None:
    store = str(tmp_path / "audit.db")
    daemon = start_daemon(store)
    sock = str(tmp_path / "agent.sock")
    agent = start_agent(sock, daemon.address, str(tmp_path / "spool"))
    try:
        result = run_engine(standin, sock, store)
        findings, shim = stored(store, 4)
    finally:
        agent.stop()
        daemon.stop()
    # The shim changed nothing: every call succeeded, every launched attention kernel ran
    # (3 alone, 1 unguarded, 2 graph replays; the runtime's launch is of the same kernel).
    assert set(result["status"]) == {0} and result["runs"] == 7  # type: ignore[arg-type]

    by_kind: dict[str, list[pb.Finding]] = {}
    for f in findings:
        by_kind.setdefault(f.finding, []).append(f)
    assert sorted(by_kind) == ["anomaly", "config_drift", "unguarded_attention"], [
        f.message for f in findings
    ]

    # The launch alone, then the stale graph replay: each names the kernel, the node, the step.
    alone, replay = by_kind["unguarded_attention"]
    kernel = "_Z31kvguard_testbed_paged_attentionPfS_"
    assert (alone.node, alone.details["kernel"], alone.details["step"], alone.details["graph"]) == (
        "p0",
        kernel,
        "2",
        "0",
    )
    assert (replay.node, replay.details["kernel"], replay.details["step"], replay.details["graph"]) == (
        "p0",
        kernel,
        "3",
        "1",
    )
    assert alone.severity == "critical" and "after the guard's step 2 ended" in alone.message

    # Pool 0 lies in memory allocated for it; pool 1's pages reach past what was mapped.
    (drift,) = by_kind["config_drift"]
    assert (drift.node, drift.pool, drift.details["covered"], drift.details["bytes"]) == (
        "p0",
        1,
        str(32 * 4096),
        str(64 * 4096),
    )
    assert drift.details["call"] == "cuMemMap"
    (gone,) = by_kind["anomaly"]
    assert (gone.node, gone.pool, list(gone.pages), gone.details["requests"]) == ("p0", 0, [1, 2], "1")
    assert gone.details["call"] == "cuMemFree"  # the runtime's cudaFree, seen where it reaches the driver

    # The counts behind them: every attention launch judged once, captured ones not run.
    launches = [e.launches for e in shim if e.WhichOneof("payload") == "launches"]
    assert sum(x.attention for x in launches) == 7
    assert sum(x.checked for x in launches) == 5 and sum(x.unguarded for x in launches) == 2
    assert sum(x.captured for x in launches) == 1 and sum(x.graphs for x in launches) == 2
    assert sum(x.launches for x in launches) == 12 and all(x.judged for x in launches)
    assert not any(x.unnamed or x.unwrapped or x.unjudged for x in launches)
    memory = [e.pool_memory for e in shim if e.WhichOneof("payload") == "pool_memory"]
    assert [(m.pool, m.kind, m.covered) for m in memory] == [
        (0, "bound", 64 * 4096),
        (1, "bound", 32 * 4096),
        (0, "freed", 0),
    ]


# An engine whose model runs in a worker process (vLLM's multiprocess executor, SGLang's
# scheduler beside its tokenizer): the guard's process checks, the worker launches.
WORKER = r"""
import ctypes, sys
from kvguard.testbed.standin import StandinCuda
cuda = StandinCuda(sys.argv[1])
attention = cuda.function("_Z16flash_fwd_kernelv")
print("ready", flush=True)
for line in sys.stdin:
    launch = line.strip() == "launch"
    status = cuda.launch(attention) if launch else ctypes.CDLL(None).kvguard_launches_flush()
    print(status, flush=True)
"""
GUARD_PROCESS = r"""
import subprocess, sys
import numpy as np
from kvguard.agents.guard import AgentSink, Guard
guard = Guard("p0", mode="monitor", sink=AgentSink(sys.argv[2], "p0"))
guard.pool(0, "decode", 16, 64, context_len=1024)
guard.sink.flush()
# Started after the guard: it inherits its step word.
worker = subprocess.Popen([sys.executable, "-c", sys.argv[3], sys.argv[1]], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
assert worker.stdout.readline() == "ready\n"
def say(line):
    worker.stdin.write(line + "\n"); worker.stdin.flush()
    return int(worker.stdout.readline())
guard.check_attention(0, [], np.zeros((0, 1), np.int64), np.zeros(0, np.int64))
first = say("launch")      # checked in the guard's process, launched in the worker
guard.step_done()
second = say("launch")     # no check since the step ended
say("flush")
worker.stdin.close()
worker.wait()
print(first, second, flush=True)
"""


def test_a_workers_launches_are_judged_by_its_engines_guard(standin: Path, tmp_path: Path) -> None:
    store = str(tmp_path / "audit.db")
    daemon = start_daemon(store)
    sock = str(tmp_path / "agent.sock")
    agent = start_agent(sock, daemon.address, str(tmp_path / "spool"))
    env = {**os.environ, "LD_PRELOAD": str(LIBRARY), "KVGUARD_SHIM_SOCKET": f"{sock}.shim"}
    env.pop("KVGUARD_STEPS", None)
    try:
        done = subprocess.run(
            [sys.executable, "-c", GUARD_PROCESS, str(standin), sock, WORKER],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        findings, shim = stored(store, 1)
    finally:
        agent.stop()
        daemon.stop()
    assert done.stdout.split() == ["0", "0"]
    (found,) = findings  # the worker's record, sent from its own process, speaks for p0
    assert (found.finding, found.node, found.details["kernel"], found.details["step"]) == (
        "unguarded_attention",
        "p0",
        "_Z16flash_fwd_kernelv",
        "1",
    )
    launches = [e.launches for e in shim if e.WhichOneof("payload") == "launches"]
    assert (sum(x.checked for x in launches), sum(x.unguarded for x in launches)) == (1, 1)


ALLOCATOR = r"""
import json, sys
from kvguard.cuda_hooks.steps import bind_pool
from kvguard.testbed.standin import StandinCuda
cuda = StandinCuda(sys.argv[1])
regions = {
    "cudaMalloc": cuda.malloc(1 << 16),
    "cuMemAlloc": cuda.mem_alloc(1 << 16),
    "cuMemAllocFromPoolAsync": cuda.pool_alloc(1 << 16),
    "cuMemMap": cuda.reserve_and_map(1 << 16, 1 << 14),
}
covered = [bind_pool(i, [(base, 1 << 16)])[0] for i, base in enumerate(regions.values())]
cuda.unmap(regions["cuMemMap"] + (1 << 14), 1 << 14)  # one chunk of pool 3 goes
print(json.dumps(covered), flush=True)
"""


def test_every_allocator_is_matched_to_its_pool(standin: Path, tmp_path: Path) -> None:
    got: list[object] = []
    listener = ShimListener(
        tmp_path / "shim.sock", lambda pid, r: got.append(r), lambda pid, why: got.append(why)
    )
    env = {**os.environ, "LD_PRELOAD": str(LIBRARY), "KVGUARD_SHIM_SOCKET": str(tmp_path / "shim.sock")}
    try:
        done = subprocess.run(
            [sys.executable, "-c", ALLOCATOR, str(standin)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        deadline = time.monotonic() + 10
        while len(got) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        listener.close()
    assert json.loads(done.stdout) == [1 << 16] * 4
    calls = [(r.pool, r.kind, r.call, r.covered) for r in got]  # type: ignore[attr-defined]
    assert calls == [
        (
            0,
            "bound",
            "cuMemAlloc",
            1 << 16,
        ),  # the runtime's cudaMalloc, reached by its handle: seen at the driver
        (1, "bound", "cuMemAlloc", 1 << 16),
        (2, "bound", "cuMemAllocFromPoolAsync", 1 << 16),
        (3, "bound", "cuMemMap", 1 << 16),
        (3, "unmapped", "cuMemUnmap", 0),
    ]
    lo, hi = got[4].lo - got[4].base, got[4].hi - got[4].base  # type: ignore[attr-defined]
    assert (lo, hi) == (1 << 14, 1 << 15)
