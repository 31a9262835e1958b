"""What the LD_PRELOAD shim adds to a CUDA copy call.

A small C program, linked against the CUDA runtime library as an engine's CUDA code is,
calls cudaMemcpy in a tight loop and reports nanoseconds per call. It runs without the shim,
with it (no transfer named: the shim passes the call through and checks its thread's label),
and with it inside a named transfer (the call is also counted); the three alternate, so
drift on this shared machine hits all alike. With no GPU the runtime returns its error at
once, the cheapest call it has, so the shim's share is the largest it can be; a real copy
takes microseconds.

    python bench/shim.py [--calls N] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvguard.cuda_hooks.shim import LIBRARY

PROGRAM = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int cudaMemcpy(void *dst, const void *src, size_t n, int kind);
static char buffer[8192];
int main(int argc, char **argv) {
    long calls = atol(argv[1]);
    if (argc > 2) {  /* name a transfer, if the shim is there */
        void (*begin)(const char *) = (void (*)(const char *))dlsym(RTLD_DEFAULT, "kvguard_xfer_begin");
        if (begin) begin("bench");
    }
    cudaMemcpy(buffer, buffer + 4096, 4096, 2);  /* the runtime's one-time start */
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    int sink = 0;
    for (long i = 0; i < calls; i++) sink += cudaMemcpy(buffer, buffer + 4096, 4096, 2);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
    printf("%.3f %d\n", ns / calls, sink != 0);
    return 0;
}
"""


def build(out: Path) -> Path:
    import nvidia.cuda_runtime

    lib = Path(next(iter(nvidia.cuda_runtime.__path__))) / "lib"
    (out / "bench.c").write_text(PROGRAM)
    target = out / "bench_shim"
    cmd = [
        "cc",
        "-O2",
        "-o",
        target,
        out / "bench.c",
        f"-L{lib}",
        "-l:libcudart.so.12",
        f"-Wl,-rpath,{lib}",
        "-ldl",
    ]
    subprocess.run(cmd, check=True)
    return target


def run(program: Path, calls: int, shim: bool, named: bool) -> float:
    env = dict(os.environ, KVGUARD_SHIM_SOCKET="/nonexistent")
    if shim:
        env["LD_PRELOAD"] = str(LIBRARY)
    args = [str(program), str(calls)] + (["named"] if named else [])
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True).stdout.split()
    return float(out[0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--calls", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if not LIBRARY.exists():
        print(f"{LIBRARY} is not built: run `make shim`", file=sys.stderr)
        return 2
    variants = {"without shim": (False, False), "shim": (True, False), "shim, transfer named": (True, True)}
    with tempfile.TemporaryDirectory() as tmp:
        program = build(Path(tmp))
        times: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, (shim, named) in variants.items():
                times[name].append(run(program, args.calls, shim, named))
    base = statistics.median(times["without shim"])
    print(
        f"cudaMemcpy (the runtime's error return, no GPU), {args.calls:,} calls, median of {args.rounds} runs"
    )
    print("| variant | ns/call | ratio | added ns |\n|---|---:|---:|---:|")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.1f} | {med / base:.3f} | {med - base:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
