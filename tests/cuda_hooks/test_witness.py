"""The eBPF wire witness: its decoder on byte streams (no kernel needed), then the real
probes attached to real processes (as root, as CI runs), and the testbed's short transfer
caught by the witness alone, with the receiving engine's own report switched off."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from kvguard.cli.process import start_agent, start_daemon
from kvguard.cuda_hooks.tcp_stream import Streams, WireReport
from kvguard.cuda_hooks.witness import RUNS_KEPT, BpfWitness, NullWitness, open_witness, wire_event
from kvguard.daemon.store import Store
from kvguard.ledger.findings import Finding
from kvguard.ledger.ledger import Ledger
from kvguard.proto import pb
from kvguard.proto.builder import EventLog
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc
from kvguard.proto.transfer import transfer_of
from kvguard.testbed import wire
from kvguard.testbed.cluster import Cluster

PROMPT = "acme memo: Initech deal closes Dec 14 at 4.2B, keep private. " * 2


def message(obj: dict[str, object], payload: bytes) -> bytes:
    """What testbed.wire.send writes for one message (header and JSON, then the payload)."""
    body = wire.json.dumps(obj, separators=(",", ":")).encode()
    return wire.HEADER.pack(len(body), len(payload)) + body + payload


def feed(streams: Streams, data: bytes, cuts: list[int], head: int = 512) -> list[WireReport]:
    """Write `data` in pieces ending at `cuts`, capturing each write's first `head` bytes."""
    reports = []
    for start, end in zip([0, *cuts], [*cuts, len(data)], strict=True):
        reports += streams.write(7, 3, end - start, data[start:end][:head])
    return reports


class TestDecoder:
    def test_a_transfer_split_over_many_writes_counts_each_payload_byte_once(self) -> None:
        data = message({"op": "kv", "req": "r1", "xfer": "p-x1", "bytes": 5000}, b"k" * 5000)
        streams = Streams()
        streams.open(7, 3)
        # the header split in two, the JSON in two, the payload in three
        assert feed(streams, data, [5, 20, 40, 1000, 3000]) == [WireReport(7, "p-x1", 5000, 3, True)]

    def test_messages_that_are_not_transfers_are_followed_but_not_reported(self) -> None:
        data = message({"op": "bootstrap", "req": "r1"}, b"") + message({"ok": True}, b"zz")
        data += message({"op": "kv", "req": "r2", "xfer": "p-x2"}, b"k" * 10)
        streams = Streams()
        streams.open(7, 3)
        assert feed(streams, data, []) == [WireReport(7, "p-x2", 10, 1, True)]

    def test_a_transfer_cut_short_by_a_close_ends_with_what_was_written(self) -> None:
        data = message({"op": "kv", "req": "r1", "xfer": "p-x1"}, b"k" * 4096)
        streams = Streams()
        streams.open(7, 3)
        assert feed(streams, data[:1500], [700]) == []
        assert streams.close(7, 3) == [WireReport(7, "p-x1", 1500 - (len(data) - 4096), 2, True)]

    def test_a_header_beyond_the_captured_head_gives_the_connection_up(self) -> None:
        # Two messages in one write, the second's header past the first 64 bytes captured.
        first = message({"op": "noop", "pad": "x" * 80}, b"")
        data = first + message({"op": "kv", "req": "r1", "xfer": "p-x1"}, b"k" * 10)
        streams = Streams()
        streams.open(7, 3)
        assert feed(streams, data, [], head=64) == [] and streams.lost == 1
        # ... until the descriptor is opened again (a new connection).
        streams.open(7, 3)
        assert feed(streams, message({"op": "kv", "xfer": "p-x2"}, b"k"), []) == [
            WireReport(7, "p-x2", 1, 1, True)
        ]

    def test_a_connection_opened_before_it_was_watched_is_not_guessed_at(self) -> None:
        streams = Streams()
        assert streams.write(7, 9, 100, b"k" * 100) == [] and streams.lost == 1

    def test_lost_events_give_every_open_connection_up(self) -> None:
        streams = Streams()
        streams.open(7, 3)
        streams.open(7, 4)
        streams.lose_all()
        assert streams.lost == 2
        assert feed(streams, message({"op": "kv", "xfer": "p-x1"}, b"k"), []) == []

    def test_a_message_whose_name_was_not_captured_is_counted_not_guessed(self) -> None:
        # A JSON of 600 bytes in one write, its xfer past the 64 bytes captured.
        data = message({"op": "kv", "pad": "x" * 500, "xfer": "p-x1"}, b"k" * 10)
        streams = Streams()
        streams.open(7, 3)
        assert feed(streams, data, [], head=64) == [] and streams.unnamed == 1
        assert streams.lost == 0  # the stream is still followed: the next message is reported
        assert feed(streams, message({"op": "kv", "xfer": "p-x2"}, b"k"), []) == [
            WireReport(7, "p-x2", 1, 1, True)
        ]

    def test_the_transfer_is_named_by_the_captured_part_of_a_long_header(self) -> None:
        head = message({"op": "kv", "req": "r1", "xfer": "p-x9", "checksums": list(range(500))}, b"")[12:300]
        assert transfer_of(head) == "p-x9"
        assert transfer_of(b'{"op":"bootstrap","xfer":"p-x9"') == ""
        assert transfer_of(b'{"op":"kv","xfer":"p-x9","req":"r"}') == "p-x9"


# ---------------------------------------------------------------------------- real probes


@pytest.fixture(scope="module")
def bpf_ready() -> None:
    """Loading the witness needs root, bcc and kernel headers; CI has them (`.ci/run` sets
    KVGUARD_REQUIRE_BPF, so there a missing piece fails instead of skipping)."""
    probe = open_witness(lambda name, r: None)
    probe.close()
    if isinstance(probe, NullWitness):
        if os.environ.get("KVGUARD_REQUIRE_BPF"):
            pytest.fail(f"the eBPF witness is required here: {probe.reason}")
        pytest.skip(probe.reason)


@contextlib.contextmanager
def watched(witness: BpfWitness, program: str, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A Python process running `program`, which prints "ready" and waits for a line: it is
    watched as node p0, then told to go. It ends (its input closed) with the block."""
    engine = subprocess.Popen(
        [sys.executable, "-c", program, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert engine.stdout is not None and engine.stdout.readline() == "ready\n"
        witness.watch(engine.pid, "p0")
        say(engine, "go")
        yield engine
    finally:
        with contextlib.suppress(OSError):
            assert engine.stdin is not None
            engine.stdin.close()
        engine.wait(timeout=10)
        closed(engine)


def closed(*procs: subprocess.Popen[str]) -> None:
    """Let go of ended processes' pipes."""
    for proc in procs:
        for pipe in (proc.stdin, proc.stdout, proc.stderr):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


def say(engine: subprocess.Popen[str], line: str) -> None:
    assert engine.stdin is not None
    engine.stdin.write(line + "\n")
    engine.stdin.flush()


def hear(engine: subprocess.Popen[str]) -> str:
    assert engine.stdout is not None
    return engine.stdout.readline().rstrip("\n")


def wait_for(condition: Callable[[], bool], what: str, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen in {seconds} s"
        time.sleep(0.05)


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


def test_the_witness_sees_what_another_process_sends(bpf_ready: None, kv_server: int) -> None:
    reports: list[tuple[str, WireReport]] = []
    witness = open_witness(lambda name, r: reports.append((name, r)))
    assert isinstance(witness, BpfWitness)
    sizes = [3_000_000, 4096, 0]
    try:
        with watched(witness, SENDER, str(kv_server), *map(str, sizes)) as sender:
            assert hear(sender) == "sent"
            wait_for(lambda: len(reports) == 3, "three reports")
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


def test_a_thread_that_changes_cpu_mid_transfer_is_followed_in_its_order(bpf_ready: None) -> None:
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
        with watched(witness, MIGRANT, "40") as engine:
            assert hear(engine) == "sent"
            made.set()
            wait_for(lambda: len(reports) >= 41, "the transfers' reports")
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
    bpf_ready: None, tmp_path: Path
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
        assert hear(engine) == "sent"
        wait_for(witnessed, "the transfer's wire event", seconds=20)
    finally:
        say(engine, "")
        engine.wait(timeout=10)
        closed(engine)
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


def copies_seen(copier: Path, plan: list[list[int]]) -> tuple[list[WireReport], list[int], int]:
    """Run an engine that names one transfer around `plan`'s copies, watched by the witness:
    (its reports, the calls' results, the probed symbols the libraries lacked)."""
    reports: list[WireReport] = []
    witness = open_witness(lambda name, r: reports.append(r))
    assert isinstance(witness, BpfWitness)
    try:
        with watched(witness, ENGINE, str(copier), json.dumps(plan)) as engine:
            status = json.loads(hear(engine))
            wait_for(lambda: bool(reports), "a report")
    finally:
        witness.close()
    return reports, status, witness.missing_symbols


Build = Callable[[Path, Path], Path]  # the build_copier fixture


def test_the_witness_counts_a_named_transfers_cuda_copies(
    bpf_ready: None,
    tmp_path: Path,
    compile_c: Callable[..., Path],
    build_copier: Build,
) -> None:
    compile_c(tmp_path, "libcuda.so.1", STUB_DRIVER)
    compile_c(tmp_path, "libcudart.so.12", STUB_RUNTIME, (tmp_path, "libcuda.so.1"))
    copier = build_copier(tmp_path, tmp_path)
    plan = [[4096, 2, 0], [1000, 3, 1], [10, 1, 0], [7, 9, 0]]  # d2h, d2d async, h2d, refused
    reports, status, missing = copies_seen(copier, plan)
    assert status == [0, 0, 0, 1, 0]
    (report,) = reports
    # Off the device: the d2h and d2d copies; not the h2d, not the refused call, not the copy
    # after the transfer, and the d2h once although the runtime's call ran the driver's.
    assert (report.xfer, report.bytes, report.calls, report.complete) == ("p0-x1", 4096 + 1000, 4, True)
    assert report.probe == "ebpf:cuda"
    assert missing == 2 + 9  # the stand-ins define 2 of the runtime's 4 copy calls, 1 of the driver's 10


def test_the_witness_probes_the_real_cuda_runtime(
    bpf_ready: None, tmp_path: Path, build_copier: Build, cuda_runtime: Path
) -> None:
    copier = build_copier(tmp_path, cuda_runtime)
    reports, status, missing = copies_seen(copier, [[4096, 2, 0], [1000, 3, 1]])
    (report,) = reports
    # No GPU here: the runtime refuses every call, so nothing left a device; both calls were seen.
    assert all(s != 0 for s in status) and (report.xfer, report.calls, report.bytes) == ("p0-x1", 2, 0)
    assert missing == 0  # every copy call the witness probes is in the real runtime


# ---------------------------------------------------------------------------- RDMA work requests

# Stand-ins for libibverbs and a provider, compiled against the real verbs.h: the provider's
# post_send is a static function (as libmlx5's is: no symbol), reached only through the
# context's ops table, as the real ibv_post_send inline reaches it. It refuses a post whose
# first work request carries immediate data 13.
STUB_PROVIDER = r"""
#include <infiniband/verbs.h>
static int post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
    (void)qp;
    *bad = wr->imm_data == 13 ? wr : 0;
    return wr->imm_data == 13 ? 22 : 0;
}
void *fake_provider_post_send(void) { return (void *)post_send; }
"""
STUB_VERBS = r"""
#include <stdlib.h>
#include <infiniband/verbs.h>
void *fake_provider_post_send(void);
struct ibv_context *ibv_open_device(struct ibv_device *device) {
    (void)device;
    struct ibv_context *context = calloc(1, sizeof(*context));
    typedef int (*post_send_fn)(struct ibv_qp *, struct ibv_send_wr *, struct ibv_send_wr **);
    context->ops.post_send = (post_send_fn)fake_provider_post_send();
    return context;
}
struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *attr) {
    (void)attr;
    struct ibv_qp *qp = calloc(1, sizeof(*qp));
    qp->context = pd->context;
    return qp;
}
int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask) {
    (void)qp, (void)attr, (void)mask;
    return 0;
}
"""
# A transfer engine in miniature: opens the device, creates a queue pair, posts chains of work
# requests with the real ibv_post_send inline of verbs.h.
TRANSFER = r"""
#include <stdlib.h>
#include <infiniband/verbs.h>
static struct ibv_qp *qp;
void setup(void) {
    struct ibv_pd pd = {.context = ibv_open_device(NULL)};
    qp = ibv_create_qp(&pd, NULL);
}
int post(int wrs, int sges, unsigned length, int opcode, int imm, unsigned long long offset,
         unsigned long long stride) {
    struct ibv_send_wr *wr = calloc(wrs, sizeof(*wr)), *bad = NULL;
    struct ibv_sge *sge = calloc(wrs * sges, sizeof(*sge));
    for (int i = 0; i < wrs; i++) {
        for (int j = 0; j < sges; j++)
            sge[i * sges + j].length = length;
        wr[i] = (struct ibv_send_wr){.next = i + 1 < wrs ? &wr[i + 1] : NULL, .sg_list = &sge[i * sges],
                                     .num_sge = sges, .opcode = opcode, .imm_data = imm};
        wr[i].wr.rdma.remote_addr = 0x7f0000000000ull + offset + i * stride;
    }
    int status = ibv_post_send(qp, wr, &bad);
    free(wr);
    free(sge);
    return status;
}
"""
RDMA_ENGINE = r"""
import ctypes, json, sys
from kvguard.cuda_hooks.shim import CopyLabel
transfer, label = ctypes.CDLL(sys.argv[1]), CopyLabel()
print("ready", flush=True)
sys.stdin.readline()  # watched now
transfer.setup()
print("set up", flush=True)
sys.stdin.readline()  # the provider's post_send is probed now
status = {}
for xfer, posts in json.loads(sys.argv[2]).items():
    with label.transfer(xfer):
        status[xfer] = [transfer.post(*p[:5], *map(ctypes.c_ulonglong, p[5:])) for p in posts]
status["unlabelled"] = [transfer.post(1, 1, 10, 0, 0, ctypes.c_ulonglong(0), ctypes.c_ulonglong(0))]
print(json.dumps(status), flush=True)
"""


def verbs_stack(tmp_path: Path, compile_c: Callable[..., Path]) -> Path:
    """The stand-in RDMA stack: a provider, libibverbs over it, and the transfer library an
    engine links against that; returns the last."""
    compile_c(tmp_path, "libfake-rdmav34.so", STUB_PROVIDER)
    compile_c(tmp_path, "libibverbs.so.1", STUB_VERBS, (tmp_path, "libfake-rdmav34.so"))
    return compile_c(tmp_path, "libtransfer.so", TRANSFER, (tmp_path, "libibverbs.so.1"))


def test_the_witness_follows_work_requests_to_a_providers_post_send(
    bpf_ready: None, tmp_path: Path, compile_c: Callable[..., Path]
) -> None:
    transfer = verbs_stack(tmp_path, compile_c)
    write, send, compare_swap = 0, 2, 5  # IBV_WR_RDMA_WRITE, IBV_WR_SEND, IBV_WR_ATOMIC_CMP_AND_SWP
    # Each post: work requests, SGEs each, bytes per SGE, opcode, immediate (13: refused), the
    # first remote address's offset from base, the step between work requests' addresses.
    # x1: 3 writes of 2 x 4 KiB 4 KiB apart (overlapping), a 100-byte send, an atomic (no
    # data), a post the provider refuses; x2: a chain longer than the probe follows (32 work
    # requests); x3: 4 adjacent writes, then 2 more right after them in a second post (one
    # run), and one elsewhere; x4: more separate writes than the probe keeps runs of.
    k4 = 4096
    x1 = [[3, 2, k4, write, 0, 0, k4], [1, 1, 100, send, 0, 0, 0], [1, 1, 8, compare_swap, 0, 0, 0]]
    x1.append([2, 1, 50, write, 13, 0, k4])
    x3 = [[4, 1, k4, write, 0, 0, k4], [2, 1, k4, write, 0, 4 * k4, k4], [1, 1, 10, write, 0, 100 * k4, 0]]
    x4 = [[1, 1, 10, write, 0, i * k4, 0] for i in range(RUNS_KEPT + 44)]
    plan = {"p0-x1": x1, "p0-x2": [[40, 1, 10, write, 0, 0, k4]], "p0-x3": x3, "p0-x4": x4}
    reports: list[WireReport] = []
    witness = open_witness(lambda name, r: reports.append(r))
    assert isinstance(witness, BpfWitness)
    try:
        with watched(witness, RDMA_ENGINE, str(transfer), json.dumps(plan)) as engine:
            assert hear(engine) == "set up"
            pid = engine.pid
            wait_for(
                lambda: any(p[2] == "rdma_post_send" for p in witness.attached(pid)), "a provider's probe"
            )
            before = time.time_ns()
            say(engine, "go")
            status = json.loads(hear(engine))
            after = time.time_ns()
            wait_for(lambda: len(reports) == 4, "four reports")
            unlabelled = witness.unlabelled_posts
    finally:
        witness.close()
    assert status == {
        "p0-x1": [0, 0, 0, 22],
        "p0-x2": [0],
        "p0-x3": [0, 0, 0],
        "p0-x4": [0] * len(x4),
        "unlabelled": [0],
    }
    assert unlabelled == 1  # a post outside any named transfer: not reported, but counted
    provider = [p for p in witness.attached(engine.pid) if p[2] == "rdma_post_send"]
    assert len(provider) == 1 and provider[0][0].endswith("libfake-rdmav34.so")  # found by address
    by_xfer = {r.xfer: r for r in reports}
    counts = {x: (r.bytes, r.calls, r.complete, r.probe) for x, r in by_xfer.items()}
    # x1: the writes and the send (the atomic moves no data, the refused post moved nothing);
    # x2: a lower bound, and said to be one.
    assert counts == {
        "p0-x1": (3 * 2 * k4 + 100, 4, True, "ebpf:rdma"),
        "p0-x2": (32 * 10, 32, False, "ebpf:rdma"),
        "p0-x3": (6 * k4 + 10, 7, True, "ebpf:rdma"),
        "p0-x4": (10 * len(x4), len(x4), True, "ebpf:rdma"),
    }
    # Where the writes went (the send's remote address means nothing: not counted), and when.
    base = 0x7F0000000000
    remote = {x: r.remote for x, r in by_xfer.items()}
    assert all(w is not None and before <= w.first_ns <= w.last_ns <= after for w in remote.values())
    where = {x: (w.lo, w.hi, w.runs, w.lost) for x, w in remote.items() if w is not None}
    assert where == {
        "p0-x1": (base, base + 4 * k4, tuple((base + i * k4, 2 * k4) for i in range(3)), 0),
        "p0-x2": (base, base + 31 * k4 + 10, tuple((base + i * k4, 10) for i in range(32)), 0),
        "p0-x3": (base, base + 100 * k4 + 10, ((base, 6 * k4), (base + 100 * k4, 10)), 0),
        "p0-x4": (
            base,
            base + (len(x4) - 1) * k4 + 10,
            tuple((base + i * k4, 10) for i in range(RUNS_KEPT)),
            44,
        ),
    }
    # And what the daemon makes of x3 when decode had aborted its request and granted the
    # pages it wrote to another tenant before it was posted: a late write into their pages.
    late, stray = aborted_and_regranted(by_xfer["p0-x3"], base)
    assert (late.finding, late.req, late.victim_req, late.victim_tenant) == (
        "late_write",
        "a",
        "b",
        "initech",
    )
    assert (late.node, late.pages, late.details["probe"]) == ("d0", tuple(range(6)), "ebpf:rdma")
    assert (stray.finding, stray.pages) == ("use_after_free", (100,))  # page 100 was nobody's


def aborted_and_regranted(report: WireReport, base: int) -> list[Finding]:
    """The ledger's findings on `report` (a transfer of request a), where decode (d0) had
    registered its pool at `base`, and, a second before the writes were posted, had aborted a
    and granted its pages 0..7 to initech's b."""
    assert report.remote is not None
    now = report.remote.first_ns - 1_000_000_000
    log = EventLog(clock=lambda: now)
    region = {"base": base, "stride": 4096}
    log.add("p0", "pool", pool=0, role="prefill", page_size=16, num_pages=128)
    log.add("d0", "pool", pool=0, role="decode", page_size=16, num_pages=128, regions=[region])
    log.add("p0", "bootstrap", req="a", prefill_node="p0", decode_node="d0", prompt_tokens=96, tenant="acme")
    log.add("p0", "xfer_send", req="a", xfer=report.xfer, peer_node="d0", pool=0, status="failed")
    for req, tenant in (("a", "acme"), ("b", "initech")):
        log.add("d0", "admit", req=req, tenant=tenant, prompt_tokens=96, stage="decode")
        log.add("d0", "alloc", req=req, pool=0, pages=list(range(8)))
        if req == "a":
            log.add("d0", "abort", req="a", reason="client went away")
            log.add("d0", "free", req="a", pool=0, pages=list(range(8)))
    log.lines.append(pb.Event(node="p0/ebpf", seq=1, ts_ns=now, wire=wire_event(report)))
    now += 2_000_000_000
    log.add("d0", "heartbeat")  # decode's events pass the time of the writes: they are judged
    ledger = Ledger()
    return [f for e in log.events for f in ledger.apply(e)]


UNLABELLED_ENGINE = r"""
import ctypes, sys, time
from kvguard.agents.guard import AgentSink
guard = AgentSink(sys.argv[2], "rdma-0")  # its guard: the agent watches this process
assert guard.wait_ready(30)
transfer = ctypes.CDLL(sys.argv[1])
print("ready", flush=True)
while True:  # a transfer engine's own thread: connects (a new queue pair) and posts, unnamed
    transfer.setup()
    transfer.post(1, 1, 4096, 0, 0, ctypes.c_ulonglong(0), ctypes.c_ulonglong(4096))
    time.sleep(0.05)
"""


def test_the_agent_says_when_an_engines_rdma_posts_cannot_be_attributed(
    bpf_ready: None, tmp_path: Path, compile_c: Callable[..., Path]
) -> None:
    transfer = verbs_stack(tmp_path, compile_c)
    daemon = start_daemon(str(tmp_path / "audit.db"))
    sock = str(tmp_path / "agent.sock")
    agent = start_agent(sock, daemon.address, str(tmp_path / "spool"), "--witness-uprobes")
    said: list[str] = []
    assert agent.proc.stderr is not None
    stderr = agent.proc.stderr

    def read_stderr() -> None:  # until agent.stop() takes the rest of the pipe and closes it
        with contextlib.suppress(ValueError, OSError):
            said.extend(iter(stderr.readline, ""))

    threading.Thread(target=read_stderr, daemon=True).start()
    engine = subprocess.Popen(
        [sys.executable, "-c", UNLABELLED_ENGINE, str(transfer), sock], stdout=subprocess.PIPE, text=True
    )
    try:
        assert hear(engine) == "ready"
        wait_for(lambda: any("outside any named transfer" in line for line in said), "the warning", 30)
    finally:
        engine.kill()
        engine.wait()
        closed(engine)
        said += agent.stop().splitlines()
        daemon.stop()
    warnings = [line for line in said if "RDMA" in line]
    assert len(warnings) == 1 and "the RDMA witness cannot attribute them" in warnings[0]  # once


def test_the_verbs_offsets_are_the_real_headers(tmp_path: Path) -> None:
    # witness.bpf.c reads struct ibv_context, ibv_send_wr and ibv_sge at fixed offsets.
    fields = {
        "POST_SEND_OFFSET": "offsetof(struct ibv_context, ops.post_send)",
        "WR_NEXT": "offsetof(struct ibv_send_wr, next)",
        "WR_SG_LIST": "offsetof(struct ibv_send_wr, sg_list)",
        "WR_NUM_SGE": "offsetof(struct ibv_send_wr, num_sge)",
        "WR_OPCODE": "offsetof(struct ibv_send_wr, opcode)",
        "WR_REMOTE_ADDR": "offsetof(struct ibv_send_wr, wr.rdma.remote_addr)",
        "SGE_LENGTH": "offsetof(struct ibv_sge, length)",
        "SGE_SIZE": "sizeof(struct ibv_sge)",
    }
    prints = "".join(f'printf("%zu\\n", {expression});' for expression in fields.values())
    source = tmp_path / "offsets.c"
    headers = "#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\n"
    source.write_text(f"{headers}int main(void) {{ {prints} }}\n")
    subprocess.run(["cc", "-o", tmp_path / "offsets", source], check=True)
    real = subprocess.run([tmp_path / "offsets"], capture_output=True, text=True, check=True).stdout.split()
    program = (Path(__file__).parents[2] / "cuda_hooks" / "witness.bpf.c").read_text()
    ours = [program.split(f"#define {name} ")[1].split()[0] for name in fields]
    assert ours == real


def test_the_witness_probes_every_version_of_the_real_verbs_entry_points(bpf_ready: None) -> None:
    # libibverbs keeps its 1.0 entry points beside the 1.1 ones; a program may call either.
    witness = open_witness(lambda name, r: None)
    assert isinstance(witness, BpfWitness)
    program = (
        "import ctypes, sys; ctypes.CDLL('libibverbs.so.1'); print('ready', flush=True); sys.stdin.read()"
    )
    try:
        with watched(witness, program) as engine:
            probes = witness.attached(engine.pid)
    finally:
        witness.close()
    verbs = {(entry, ret) for path, _, entry, ret in probes if "libibverbs" in path}
    count = sum("libibverbs" in path for path, *_ in probes)
    assert verbs == {("", "rdma_context"), ("", "rdma_created_qp"), ("rdma_modified_qp", "")}
    assert count == 6 and witness.missing_symbols == 0  # two versions of each of the three


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


def test_events_the_kernel_drops_are_counted_and_nothing_is_guessed(bpf_ready: None) -> None:
    # A one-page buffer per CPU, and a writer far faster than the reader: the kernel drops
    # events. The witness says how many, and reports nothing for the connection it lost.
    lost: list[int] = []
    reports: list[WireReport] = []
    witness = open_witness(lambda name, r: reports.append(r), lost.append, uprobes=False, buffer_pages=1)
    assert isinstance(witness, BpfWitness)
    try:
        with watched(witness, FLOOD) as engine:
            assert hear(engine) == "sent"
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


def test_the_agent_reports_what_its_witness_lost_to_the_daemon(bpf_ready: None, tmp_path: Path) -> None:
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
        assert hear(engine) == "ready"  # and watched: the agent has welcomed its guard
        say(engine, "go")
        assert hear(engine) == "sent"
        wait_for(lambda: nodes().get("flood-0/ebpf", svc.NodeState()).dropped > 0, "the loss", seconds=20)
    finally:
        say(engine, "")
        engine.wait(timeout=10)
        closed(engine)
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


def test_kvguard_witness_prints_a_capture_that_replay_takes(bpf_ready: None, kv_server: int) -> None:
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    sender = subprocess.Popen([sys.executable, "-c", SENDER, str(kv_server), "65536"], **pipes)
    assert hear(sender) == "ready"
    command = ["witness", "-p", str(sender.pid), "--node", "p0/ebpf", "--seconds", "60"]
    witness = subprocess.Popen(
        [sys.executable, "-m", "kvguard", *command], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert witness.stderr is not None and witness.stdout is not None
        assert witness.stderr.readline().startswith("kvguard witness: watching")
        say(sender, "go")
        assert hear(sender) == "sent"
        line = witness.stdout.readline()
    finally:
        witness.terminate()
        witness.wait(timeout=20)
        sender.wait(timeout=10)
        closed(witness, sender)
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
