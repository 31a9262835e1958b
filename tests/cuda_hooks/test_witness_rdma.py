"""The eBPF wire witness's RDMA probes: work requests followed from a transfer engine's
ibv_post_send to the provider's post_send (stand-in libibverbs and provider, compiled against
the real verbs.h), the remote writes the daemon judges against decode's pages, the agent's
word on posts it cannot attribute, and the offsets and entry points of the real verbs
library. `bpf_ready` and the `engines` helpers are in conftest.py."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

from kvguard.cli.process import start_agent, start_daemon
from kvguard.cuda_hooks.tcp_stream import WireReport
from kvguard.cuda_hooks.witness import RUNS_KEPT, BpfWitness, open_witness, wire_event
from kvguard.ledger.findings import Finding
from kvguard.ledger.ledger import Ledger
from kvguard.proto import pb
from kvguard.proto.builder import EventLog

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
    bpf_ready: None, tmp_path: Path, compile_c: Callable[..., Path], engines: SimpleNamespace
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
        with engines.watched(witness, RDMA_ENGINE, str(transfer), json.dumps(plan)) as engine:
            assert engines.hear(engine) == "set up"
            pid = engine.pid
            engines.wait_for(
                lambda: any(p[2] == "rdma_post_send" for p in witness.attached(pid)), "a provider's probe"
            )
            before = time.time_ns()
            engines.say(engine, "go")
            status = json.loads(engines.hear(engine))
            after = time.time_ns()
            engines.wait_for(lambda: len(reports) == 4, "four reports")
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
    bpf_ready: None, tmp_path: Path, compile_c: Callable[..., Path], engines: SimpleNamespace
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
        assert engines.hear(engine) == "ready"
        engines.wait_for(
            lambda: any("outside any named transfer" in line for line in said), "the warning", 30
        )
    finally:
        engine.kill()
        engine.wait()
        engines.closed(engine)
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


def test_the_witness_probes_every_version_of_the_real_verbs_entry_points(
    bpf_ready: None, engines: SimpleNamespace
) -> None:
    # libibverbs keeps its 1.0 entry points beside the 1.1 ones; a program may call either.
    witness = open_witness(lambda name, r: None)
    assert isinstance(witness, BpfWitness)
    program = (
        "import ctypes, sys; ctypes.CDLL('libibverbs.so.1'); print('ready', flush=True); sys.stdin.read()"
    )
    try:
        with engines.watched(witness, program) as engine:
            probes = witness.attached(engine.pid)
    finally:
        witness.close()
    verbs = {(entry, ret) for path, _, entry, ret in probes if "libibverbs" in path}
    count = sum("libibverbs" in path for path, *_ in probes)
    assert verbs == {("", "rdma_context"), ("", "rdma_created_qp"), ("rdma_modified_qp", "")}
    assert count == 6 and witness.missing_symbols == 0  # two versions of each of the three
