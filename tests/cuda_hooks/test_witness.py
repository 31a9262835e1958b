"""The eBPF wire witness's real probes attached to real processes (as root, as CI runs): TCP
transfers followed across CPUs and connections, the testbed's short transfer caught by the
witness alone (with the receiving engine's own report switched off), CUDA copies counted off
the device, and what the witness says when it loses events or cannot load. Its decoder on
byte streams is in test_tcp_stream.py, the RDMA work requests in test_witness_rdma.py;
`bpf_ready` and the `engines` helpers are in conftest.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from kvguard.cli.process import start_agent, start_daemon
from kvguard.cuda_hooks.tcp_stream import WireReport
from kvguard.cuda_hooks.witness import BpfWitness, NullWitness, open_witness
from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.testbed import wire
from kvguard.testbed.cluster import Cluster

PROMPT = "acme memo: Initech deal closes Dec 14 at 4.2B, keep private. " * 2


SENDER = """
import socket, sys
from kvguard.testbed import wire
port, sizes = int(sys.argv[1]), [int(n) for n in sys.argv[2:]]
print("ready", flush=True)
sys.stdin.readline()  # watched now
for i, n in enumerate(sizes):
    with socket.create_connection(("127.0.0.1", port)) as s:
        wire.send(s, {"op": "kv", "req": "r", "xfer": f"x{i}", "bytes": n}, b"k" * n)
        wire.recv(s)
print("sent", flush=True)
"""


@pytest.fixture
def kv_server() -> Iterator[int]:
    """A KV receiver on loopback that reads each message whole and acknowledges it."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            with conn:
                wire.recv(conn)
                wire.send(conn, {"ok": True})

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()


def test_the_witness_sees_what_another_process_sends(
    bpf_ready: None, kv_server: int, engines: SimpleNamespace
) -> None:
    reports: list[tuple[str, WireReport]] = []
    witness = open_witness(lambda name, r: reports.append((name, r)))
    assert isinstance(witness, BpfWitness)
    sizes = [3_000_000, 4096, 0]
    try:
        with engines.watched(witness, SENDER, str(kv_server), *map(str, sizes)) as sender:
            assert engines.hear(sender) == "sent"
            engines.wait_for(lambda: len(reports) == 3, "three reports")
    finally:
        witness.close()
    assert [(name, r.pid, r.xfer, r.bytes, r.complete) for name, r in reports] == [
        ("p0", sender.pid, f"x{i}", n, True) for i, n in enumerate(sizes)
    ]
    assert reports[0][1].calls >= 1 and reports[2][1].calls == 0
    assert witness.lost_events == 0 and witness.lost_connections == 0


MIGRANT = r"""
import os, socket, sys
from kvguard.testbed import wire
one, other = sorted(os.sched_getaffinity(0))[:2]
server = socket.create_server(("127.0.0.1", 0))
print("ready", flush=True); sys.stdin.readline()

def transfer(xfer, here, there):
    # connect and the message's header on one CPU, its payload on another, the close back
    os.sched_setaffinity(0, {here})
    s = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    body = wire.json.dumps({"op": "kv", "req": "r", "xfer": xfer}).encode()
    s.sendall(wire.HEADER.pack(len(body), 1000) + body)
    os.sched_setaffinity(0, {there})
    s.sendall(b"k" * 1000)
    os.sched_setaffinity(0, {here})
    s.close()
    conn.close()

transfer("gate", one, one)
for i in range(int(sys.argv[1])):
    transfer(f"x{i}", *((one, other) if i % 2 else (other, one)))
print("sent", flush=True); sys.stdin.readline()
"""


def test_a_thread_that_changes_cpu_mid_transfer_is_followed_in_its_order(
    bpf_ready: None, engines: SimpleNamespace
) -> None:
    # The kernel runs a thread's syscalls on whichever CPU it is on; what each CPU saw must be
    # read in the order the thread made the calls. The reader is held on the first transfer
    # until all the others are made, so that their events wait in the kernel together (as when
    # the agent is busy): read per CPU, connects came after writes and closes before payloads.
    if len(os.sched_getaffinity(0)) < 2:
        if os.environ.get("KVGUARD_REQUIRE_BPF"):
            pytest.fail("this test needs two CPUs")
        pytest.skip("one CPU: a thread cannot change CPU")
    reports: list[WireReport] = []
    made = threading.Event()

    def report(name: str, r: WireReport) -> None:
        reports.append(r)
        if r.xfer == "gate":
            made.wait(30)  # the reader waits here; the kernel keeps the events

    witness = open_witness(report, uprobes=False)
    assert isinstance(witness, BpfWitness)
    try:
        with engines.watched(witness, MIGRANT, "40") as engine:
            assert engines.hear(engine) == "sent"
            made.set()
            engines.wait_for(lambda: len(reports) >= 41, "the transfers' reports")
            time.sleep(0.3)  # and nothing more
    finally:
        made.set()
        witness.close()
    assert [(r.xfer, r.bytes, r.complete) for r in reports] == [
        (x, 1000, True) for x in ["gate", *(f"x{i}" for i in range(40))]
    ]
    assert witness.lost_events == 0 and witness.lost_connections == 0


def run_short_transfer(tmp_path: Path, *agent_args: str) -> tuple[list[pb.Finding], list[pb.Event]]:
    """The testbed with its short-transfer fault: prefill sends half the pages and reports all
    of them sent; decode runs without a guard, so the engine's own account of what arrived
    is missing. Returns the daemon's findings and stored wire events."""
    store = str(tmp_path / "audit.db")
    daemon = start_daemon(store)
    sock = str(tmp_path / "agent.sock")
    agent = start_agent(sock, daemon.address, str(tmp_path / "spool"), *agent_args)
    try:
        with Cluster(
            tmp_path / "captures",
            faults=("short_transfer",),
            guard="monitor",
            unguarded_roles="decode",
            agent_socket=sock,
        ) as c:
            status, _ = c.complete("acme", PROMPT, max_tokens=4)
            c.findings()  # flush the prefill guard's sink to the agent
        assert status == 200  # the fault: the client is answered as if nothing happened
        deadline = time.monotonic() + 20
        while True:
            s = Store(store)
            sent = [pb.Event.FromString(b) for _, _, b in s.rows(kind="event")]
            findings = [pb.Finding.FromString(b) for _, _, b in s.rows(kind="finding")]
            s.close()
            wires = [e for e in sent if e.HasField("wire")]
            claims = [e for e in sent if e.HasField("xfer_send")]
            if (claims and (wires or "--witness" not in agent_args)) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert claims, "the prefill guard's claim never reached the daemon"
        return findings, wires
    finally:
        agent.stop()
        daemon.stop()


def test_the_short_transfer_is_caught_by_the_witness_alone(bpf_ready: None, tmp_path: Path) -> None:
    findings, wires = run_short_transfer(tmp_path, "--witness")
    (seen,) = wires
    assert (seen.node, seen.wire.probe, seen.wire.complete) == ("prefill-0/ebpf", "ebpf:tcp", True)
    (mismatch,) = [f for f in findings if f.finding == "transfer_mismatch"]
    claimed, carried = int(mismatch.details["expected"]), int(mismatch.details["observed"])
    assert mismatch.details["what"] == "wire_bytes" and mismatch.details["xfer"] == seen.wire.xfer
    assert carried == seen.wire.bytes and 0 < carried == claimed // 2  # half the pages left the node
    assert mismatch.tenant == "acme" and "ebpf:tcp" in mismatch.message


QUICK_ENGINE = r"""
import socket, sys
from kvguard.agents.guard import AgentSink
from kvguard.testbed import wire
guard = AgentSink(sys.argv[1], "quick-0")  # the engine's guard, with nothing to say yet
assert guard.wait_ready(30), "the agent never took the guard's hello"
server = socket.create_server(("127.0.0.1", 0))
with socket.create_connection(server.getsockname()) as s:  # at once: no time for the agent to catch up
    conn, _ = server.accept()
    wire.send(s, {"op": "kv", "req": "r1", "xfer": "quick-x1"}, b"k" * 8192)
print("sent", flush=True)
sys.stdin.readline()
"""


def test_a_connection_opened_as_soon_as_the_agent_welcomes_the_guard_is_witnessed(
    bpf_ready: None, tmp_path: Path, engines: SimpleNamespace
) -> None:
    # The agent answers a guard's hello only once its witness watches the engine, so an engine
    # that waits for the answer has every transfer connection followed from its first byte.
    store = str(tmp_path / "audit.db")
    daemon = start_daemon(store)
    sock = str(tmp_path / "agent.sock")
    agent = start_agent(sock, daemon.address, str(tmp_path / "spool"), "--witness")
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    engine = subprocess.Popen([sys.executable, "-c", QUICK_ENGINE, sock], **pipes)
    wires: list[pb.Event] = []

    def witnessed() -> bool:
        s = Store(store)
        events = [pb.Event.FromString(b) for _, _, b in s.rows(kind="event")]
        s.close()
        wires[:] = [e for e in events if e.HasField("wire")]
        return bool(wires)

    try:
        assert engines.hear(engine) == "sent"
        engines.wait_for(witnessed, "the transfer's wire event", seconds=20)
    finally:
        engines.say(engine, "")
        engine.wait(timeout=10)
        engines.closed(engine)
        agent.stop()
        daemon.stop()
    ((node, xfer, carried, complete),) = [(e.node, e.wire.xfer, e.wire.bytes, e.wire.complete) for e in wires]
    assert (node, xfer, carried, complete) == ("quick-0/ebpf", "quick-x1", 8192, True)


def test_without_the_witness_nobody_sees_it(tmp_path: Path) -> None:
    # The control: the same run without the witness reports nothing at all, which is what
    # makes the finding above the witness's alone.
    findings, wires = run_short_transfer(tmp_path)
    assert wires == [] and [f.finding for f in findings] == []


# ---------------------------------------------------------------------------- CUDA copies

# Stand-ins for the CUDA runtime and driver (named as they are, so the witness probes them):
# the runtime's device-to-host copy calls the driver's, as the real runtime does; kind 9 is
# refused, as an invalid kind is.
STUB_DRIVER = r"""
#include <stddef.h>
int cuMemcpyDtoH_v2(void *dst, unsigned long long src, size_t n) { (void)dst; (void)src; (void)n; return 0; }
"""
STUB_RUNTIME = r"""
#include <stddef.h>
int cuMemcpyDtoH_v2(void *dst, unsigned long long src, size_t n);
int cudaMemcpy(void *dst, const void *src, size_t n, int kind) {
    (void)src;
    return kind == 2 ? cuMemcpyDtoH_v2(dst, 0, n) : kind == 9 ? 1 : 0;
}
int cudaMemcpyAsync(void *dst, const void *src, size_t n, int kind, void *stream) {
    (void)stream;
    return cudaMemcpy(dst, src, n, kind);
}
"""
ENGINE = r"""
import ctypes, json, sys
from kvguard.cuda_hooks.shim import CopyLabel
copier, label = ctypes.CDLL(sys.argv[1]), CopyLabel()  # RTLD_LOCAL, as torch's CUDA is loaded
print("ready", flush=True)
sys.stdin.readline()  # watched now
with label.transfer("p0-x1"):
    status = [copier.copy(n, kind, async_) for n, kind, async_ in json.loads(sys.argv[2])]
status.append(copier.copy(77, 2, 0))  # after the transfer: not part of it
print(json.dumps(status), flush=True)
"""


def copies_seen(
    engines: SimpleNamespace, copier: Path, plan: list[list[int]]
) -> tuple[list[WireReport], list[int], int]:
    """Run an engine that names one transfer around `plan`'s copies, watched by the witness:
    (its reports, the calls' results, the probed symbols the libraries lacked)."""
    reports: list[WireReport] = []
    witness = open_witness(lambda name, r: reports.append(r))
    assert isinstance(witness, BpfWitness)
    try:
        with engines.watched(witness, ENGINE, str(copier), json.dumps(plan)) as engine:
            status = json.loads(engines.hear(engine))
            engines.wait_for(lambda: bool(reports), "a report")
    finally:
        witness.close()
    return reports, status, witness.missing_symbols


Build = Callable[[Path, Path], Path]  # the build_copier fixture


def test_the_witness_counts_a_named_transfers_cuda_copies(
    bpf_ready: None,
    tmp_path: Path,
    compile_c: Callable[..., Path],
    build_copier: Build,
    engines: SimpleNamespace,
) -> None:
    compile_c(tmp_path, "libcuda.so.1", STUB_DRIVER)
    compile_c(tmp_path, "libcudart.so.12", STUB_RUNTIME, (tmp_path, "libcuda.so.1"))
    copier = build_copier(tmp_path, tmp_path)
    plan = [[4096, 2, 0], [1000, 3, 1], [10, 1, 0], [7, 9, 0]]  # d2h, d2d async, h2d, refused
    reports, status, missing = copies_seen(engines, copier, plan)
    assert status == [0, 0, 0, 1, 0]
    (report,) = reports
    # Off the device: the d2h and d2d copies; not the h2d, not the refused call, not the copy
    # after the transfer, and the d2h once although the runtime's call ran the driver's.
    assert (report.xfer, report.bytes, report.calls, report.complete) == ("p0-x1", 4096 + 1000, 4, True)
    assert report.probe == "ebpf:cuda"
    assert missing == 2 + 9  # the stand-ins define 2 of the runtime's 4 copy calls, 1 of the driver's 10


def test_the_witness_probes_the_real_cuda_runtime(
    bpf_ready: None, tmp_path: Path, build_copier: Build, cuda_runtime: Path, engines: SimpleNamespace
) -> None:
    copier = build_copier(tmp_path, cuda_runtime)
    reports, status, missing = copies_seen(engines, copier, [[4096, 2, 0], [1000, 3, 1]])
    (report,) = reports
    # No GPU here: the runtime refuses every call, so nothing left a device; both calls were seen.
    assert all(s != 0 for s in status) and (report.xfer, report.calls, report.bytes) == ("p0-x1", 2, 0)
    assert missing == 0  # every copy call the witness probes is in the real runtime


FLOOD = r"""
import json, socket, sys
from kvguard.testbed import wire
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen()
print("ready", flush=True); sys.stdin.readline()
with socket.create_connection(server.getsockname()) as s:
    conn, _ = server.accept()
    body = json.dumps({"op": "kv", "req": "r", "xfer": "x-big", "bytes": 20000 * 100}).encode()
    s.sendall(wire.HEADER.pack(len(body), 20000 * 100) + body)  # the message's header and JSON
    for _ in range(20000):
        s.send(b"k" * 100)  # its payload, in more writes than a one-page buffer holds
    print("sent", flush=True)
    sys.stdin.readline()
"""


def test_events_the_kernel_drops_are_counted_and_nothing_is_guessed(
    bpf_ready: None, engines: SimpleNamespace
) -> None:
    # A one-page buffer per CPU, and a writer far faster than the reader: the kernel drops
    # events. The witness says how many, and reports nothing for the connection it lost.
    lost: list[int] = []
    reports: list[WireReport] = []
    witness = open_witness(lambda name, r: reports.append(r), lost.append, uprobes=False, buffer_pages=1)
    assert isinstance(witness, BpfWitness)
    try:
        with engines.watched(witness, FLOOD) as engine:
            assert engines.hear(engine) == "sent"
            time.sleep(0.5)  # the reader catches up with what is left
        time.sleep(0.3)
    finally:
        witness.close()
    assert lost and lost[-1] == witness.lost_events > 0
    assert witness.lost_connections >= 1 and reports == []


GUARDED_FLOOD = (
    r"""
import sys
from kvguard.agents.guard import AgentSink
guard = AgentSink(sys.argv[1], "flood-0")  # the engine's guard: the agent watches this process
assert guard.wait_ready(30)
"""
    + FLOOD
)


def test_the_agent_reports_what_its_witness_lost_to_the_daemon(
    bpf_ready: None, tmp_path: Path, engines: SimpleNamespace
) -> None:
    # The same flood through a real agent with a one-page buffer: the loss reaches the daemon
    # in-band, as the heartbeat of the engine node's witness source, and no transfer is guessed.
    store = str(tmp_path / "audit.db")
    daemon = start_daemon(store)
    sock = str(tmp_path / "agent.sock")
    agent = start_agent(
        sock, daemon.address, str(tmp_path / "spool"), "--witness", "--witness-buffer-pages", "1"
    )

    def nodes() -> dict[str, svc.NodeState]:
        with grpc.insecure_channel(daemon.address) as channel:
            state = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest(), timeout=10)
        return {n.node: n for n in state.nodes}

    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    engine = subprocess.Popen([sys.executable, "-c", GUARDED_FLOOD, sock], **pipes)
    try:
        assert engines.hear(engine) == "ready"  # and watched: the agent has welcomed its guard
        engines.say(engine, "go")
        assert engines.hear(engine) == "sent"
        engines.wait_for(
            lambda: nodes().get("flood-0/ebpf", svc.NodeState()).dropped > 0, "the loss", seconds=20
        )
    finally:
        engines.say(engine, "")
        engine.wait(timeout=10)
        engines.closed(engine)
        agent.stop()
        daemon.stop()
    s = Store(store)
    witnessed = [e for e in (pb.Event.FromString(b) for _, _, b in s.rows(kind="event")) if "/" in e.node]
    s.close()
    beats = [e.heartbeat.dropped for e in witnessed]
    assert {e.node for e in witnessed} == {"flood-0/ebpf"} and all(e.HasField("heartbeat") for e in witnessed)
    assert beats == sorted(beats) and beats[0] > 0  # a running total, never a guess of what was in it
    assert [e.seq for e in witnessed] == list(range(1, len(witnessed) + 1))


def test_without_privilege_the_witness_says_why_and_watches_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    # As an unprivileged user: no exception, a reason, a witness that watches nothing.
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    witness = open_witness(lambda name, r: None)
    witness.watch(1, "p0")
    witness.unwatch(1)
    witness.close()
    assert isinstance(witness, NullWitness) and not witness.available
    assert witness.reason.startswith("eBPF needs root (or CAP_BPF and CAP_PERFMON)")


def test_kvguard_witness_prints_a_capture_that_replay_takes(
    bpf_ready: None, kv_server: int, engines: SimpleNamespace
) -> None:
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(kv_server), "65536"], **pipes)
    assert engines.hear(sender) == "ready"
    command = ["witness", "-p", str(sender.pid), "--node", "p0/ebpf", "--seconds", "60"]
    witness = subprocess.Popen(
        [sys.executable, "-m", "kvguard", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert witness.stderr is not None and witness.stdout is not None
        assert witness.stderr.readline().startswith("kvguard witness: watching")
        engines.say(sender, "go")
        assert engines.hear(sender) == "sent"
        line = witness.stdout.readline()
    finally:
        witness.terminate()
        witness.wait(timeout=20)
        sender.wait(timeout=10)
        engines.closed(witness, sender)
    event = json.loads(line)
    wire = event["wire"]
    assert (event["node"], event["seq"], wire["xfer"], wire["bytes"]) == ("p0/ebpf", 1, "x0", 65536)
    assert (wire["probe"], wire["complete"]) == ("ebpf:tcp", True)
    replay = subprocess.run(
        [sys.executable, "-m", "kvguard", "replay", "-"], input=line, capture_output=True, text=True
    )
    assert replay.returncode == 0, replay.stderr  # one event, applied, no finding


def test_a_program_bccs_llvm_cannot_build_leaves_the_caller_running(
    bpf_ready: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An error in the back end of bcc's LLVM ends the process that meets it (no exception):
    # here, zeroing a struct too large for it to inline. The witness meets it in a child
    # process and says why; the agent (this test) goes on.
    from kvguard.cuda_hooks import witness as module

    broken = tmp_path / "broken.bpf.c"
    broken.write_text(
        module.PROGRAM.read_text()
        + "\nstruct big { char b[8192]; };\nBPF_PERCPU_ARRAY(bigs, struct big, 1);\n"
        + "int broken(void *ctx) { int z = 0; struct big *b = bigs.lookup(&z); "
        + "if (b) __builtin_memset(b, 0, sizeof(*b)); return 0; }\n"
    )
    monkeypatch.setattr(module, "PROGRAM", broken)
    witness = open_witness(lambda name, r: None)
    assert isinstance(witness, NullWitness)
    assert witness.reason.startswith("the eBPF witness could not be compiled:")
    assert "memset" in witness.reason
