"""What the eBPF witness costs the engine it watches: the same work with the witness off and
on, side by side in one run.

1. TCP: a process sends testbed-framed KV messages (a header and JSON, then the payload) over
   loopback; the witness's tracepoints see each write.
2. CUDA copies: a process calls cudaMemcpy of a stand-in runtime library (named as the real
   one, returning at once) inside a named transfer; the witness's uprobe and uretprobe fire
   on each call. A stand-in, because with no GPU the real runtime only returns an error; its
   per-call figure is the probes' own cost, which a real copy (microseconds) hides.
3. Order under load: a process whose thread changes CPU between its connect, its writes and
   its close, N times, while busy loops keep every CPU loaded (so the reader lags and events
   of several CPUs wait together): how many transfers the witness followed to a right report.

    python bench/witness.py [--messages N] [--calls N] [--rounds R] [--moving N]   (as root, with bcc)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvguard.cuda_hooks.tcp_stream import WireReport
from kvguard.cuda_hooks.witness import NullWitness, open_witness

SENDER = r"""
import socket, sys, threading, time
from kvguard.testbed import wire
messages, size = int(sys.argv[1]), int(sys.argv[2])
server = socket.socket(); server.bind(("127.0.0.1", 0)); server.listen()
def drain():
    conn, _ = server.accept()
    with conn:
        while conn.recv(1 << 20):
            pass
threading.Thread(target=drain, daemon=True).start()
payload = b"k" * size
with socket.create_connection(server.getsockname()) as s:
    print("ready", flush=True); sys.stdin.readline()
    t0 = time.perf_counter()
    for i in range(messages):
        wire.send(s, {"op": "kv", "req": "r", "xfer": f"x{i}", "bytes": size}, payload)
    print((time.perf_counter() - t0) / messages * 1e6, flush=True)
"""

RUNTIME = r"""
#include <stddef.h>
int cudaMemcpy(void *dst, const void *src, size_t n, int kind) {
    (void)dst, (void)src, (void)n;
    return kind == 9;
}
"""

CALLER = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int cudaMemcpy(void *dst, const void *src, size_t n, int kind);
static char buffer[8192];
int main(int argc, char **argv) {
    long calls = atol(argv[1]);
    void *labels = dlopen(argv[2], RTLD_NOW);
    void (*begin)(const char *) = (void (*)(const char *))dlsym(labels, "kvguard_xfer_begin");
    int (*end)(void) = (int (*)(void))dlsym(labels, "kvguard_xfer_end");
    printf("ready\n"); fflush(stdout);
    getchar();
    struct timespec t0, t1;
    if (argc < 4) begin("bench");  /* a fourth argument: copies outside any named transfer */
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < calls; i++) cudaMemcpy(buffer, buffer + 4096, 4096, 2);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    end();
    printf("%.4f\n", ((t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec)) / calls / 1e3);
    return 0;
}
"""


MOVING = r"""
import os, socket, sys
from kvguard.testbed import wire
one, other = sorted(os.sched_getaffinity(0))[:2]
server = socket.create_server(("127.0.0.1", 0))
print("ready", flush=True); sys.stdin.readline()
for i in range(int(sys.argv[1])):
    here, there = (one, other) if i % 2 else (other, one)
    os.sched_setaffinity(0, {here})
    s = socket.create_connection(server.getsockname())
    conn, _ = server.accept()
    body = wire.json.dumps({"op": "kv", "req": "r", "xfer": f"x{i}"}).encode()
    s.sendall(wire.HEADER.pack(len(body), 1000) + body)
    os.sched_setaffinity(0, {there})
    s.sendall(b"k" * 1000)
    os.sched_setaffinity(0, {here})
    s.close()
    conn.close()
print("sent", flush=True); sys.stdin.readline()
"""


def moving(n: int) -> str:
    """Transfers whose thread changes CPU mid-way, with every CPU loaded: what was followed."""
    reports: list[WireReport] = []
    witness = open_witness(lambda name, r: reports.append(r), uprobes=False)
    load = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(os.cpu_count() or 1)]
    proc = subprocess.Popen(
        [sys.executable, "-c", MOVING, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == b"ready"
        witness.watch(proc.pid, "bench")
        proc.stdin.write(b"\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == b"sent"
        time.sleep(1)  # the reader catches up
    finally:
        for p in load:
            p.kill()
        proc.kill()
        witness.close()
    right = sum(r.bytes == 1000 and r.complete for r in reports)
    lost = getattr(witness, "lost_connections", 0)
    return f"{right} of {n} followed to a right report, {len(reports) - right} wrong, {lost} connections lost"


def timed(args: list[str], watched: bool) -> float:
    """Microseconds per operation that the program reports, watched by a fresh witness or not."""
    witness = open_witness(lambda name, r: None) if watched else NullWitness("off")
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    witness.watch(proc.pid, "bench")
    proc.stdin.write("\n")
    proc.stdin.flush()
    result = float(proc.stdout.readline())
    proc.wait()
    witness.close()
    return result


def compare(name: str, args: list[str], rounds: int, unit: str) -> None:
    off, on = [], []
    for _ in range(rounds):
        off.append(timed(args, False))
        on.append(timed(args, True))
    a, b = statistics.median(off), statistics.median(on)
    print(f"| {name} | {a:.3f} | {b:.3f} | {b / a:.3f} | {b - a:+.3f} {unit} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--messages", type=int, default=2000)
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--moving", type=int, default=2000, help="transfers of the order test (0: none)")
    args = parser.parse_args(argv)
    probe = open_witness(lambda name, r: None)
    probe.close()
    if isinstance(probe, NullWitness):
        print(f"no eBPF witness here: {probe.reason}", file=sys.stderr)
        return 2
    labels = Path(__file__).resolve().parent.parent / "cuda_hooks" / "shim" / "libkvguard_label.so"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        (out / "runtime.c").write_text(RUNTIME)
        (out / "caller.c").write_text(CALLER)
        subprocess.run(
            ["cc", "-O2", "-shared", "-fPIC", "-o", out / "libcudart.so.12", out / "runtime.c"], check=True
        )
        link = [f"-L{out}", "-l:libcudart.so.12", f"-Wl,-rpath,{out}", "-ldl"]
        subprocess.run(["cc", "-O2", "-o", out / "caller", out / "caller.c", *link], check=True)
        print(f"median of {args.rounds} runs each, witness off and on alternating")
        print("| work | off | on | ratio | added |\n|---|---:|---:|---:|---:|")
        for size in (64 << 10, 1 << 20):
            sender = [sys.executable, "-c", SENDER, str(args.messages), str(size)]
            compare(f"send a {size >> 10} KiB KV message (µs)", sender, args.rounds, "µs")
        caller = [str(out / "caller"), str(args.calls), str(labels)]
        compare("cudaMemcpy in a named transfer (µs)", caller, args.rounds, "µs")
        compare("cudaMemcpy, no transfer named (µs)", [*caller, "plain"], args.rounds, "µs")
    if args.moving and len(os.sched_getaffinity(0)) > 1:
        print(f"order under load, threads changing CPU: {moving(args.moving)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
