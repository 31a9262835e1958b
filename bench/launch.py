"""What the CUDA shim's launch witness adds to a kernel launch on the host (goal: <= 1 µs).

A small C program finds cuLaunchKernel and cuGraphLaunch the way the CUDA runtime does
(dlopen libcuda.so.1, dlsym cuGetProcAddress_v2, ask it) and launches one kernel in a tight
loop, reporting nanoseconds a launch. The driver is the stand-in (testbed/standin): its
launch only counts, far cheaper than a real driver's few microseconds, so the shim's share is
the largest it can be. Variants, alternating so drift on this shared machine hits all alike:

- without shim;
- shim, an ordinary kernel (its class cached: one lookup, one counter);
- shim, an attention kernel inside a checked step (the guard's step word read, the capture
  state asked of the driver, counters);
- the same as a graph launch (a graph holding the attention kernel, instantiated under the shim).

    python bench/launch.py [--launches N] [--rounds R]
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
from kvguard.cuda_hooks.steps import StepWord
from kvguard.testbed.standin import build as build_standin

PROGRAM = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
typedef int (*gpa_t)(const char *, void **, int, unsigned long long, int *);
typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                        void **, void **);
typedef int (*get_t)(void **, void *, const char *);
typedef int (*graph_launch_t)(void *, void *);
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    const char *kernel = argv[2];
    int graph = argc > 3;
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    gpa_t gpa = (gpa_t)dlsym(cuda, "cuGetProcAddress_v2");
    launch_t launch; get_t get; graph_launch_t graph_launch;
    gpa("cuLaunchKernel", (void **)&launch, 12080, 0, NULL);
    gpa("cuModuleGetFunction", (void **)&get, 12080, 0, NULL);
    gpa("cuGraphLaunch", (void **)&graph_launch, 12080, 0, NULL);
    void *f, *exec = NULL;
    get(&f, NULL, kernel);
    if (graph) {  /* a graph holding the kernel: captured on a stream, instantiated */
        void *stream, *g;
        int (*create)(void **, unsigned) = dlsym(cuda, "cuStreamCreate");
        int (*begin)(void *, int) = dlsym(cuda, "cuStreamBeginCapture_v2");
        int (*end)(void *, void **) = dlsym(cuda, "cuStreamEndCapture");
        int (*inst)(void **, void *, unsigned long long);
        gpa("cuGraphInstantiate", (void **)&inst, 12080, 0, NULL);
        create(&stream, 0); begin(stream, 0);
        launch(f, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);
        end(stream, &g); inst(&exec, g, 0);
    }
    int status = 0;
    for (int i = 0; i < 1000; i++)  /* warm: the kernel's class, the step word */
        status |= graph ? graph_launch(exec, NULL) : launch(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++)
        status |= graph ? graph_launch(exec, NULL) : launch(f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ns = (t1.tv_sec - t0.tv_sec) * 1e9 + (t1.tv_nsec - t0.tv_nsec);
    printf("%.3f %d\n", ns / n, status);
    return status != 0;
}
"""
ATTENTION = "_ZN10flashinfer28BatchDecodeWithPagedKVCacheKernel"
ORDINARY = "ampere_sgemm_128x64_tn"
VARIANTS = {
    "without shim": (False, ORDINARY, False),
    "without shim, graph": (False, ATTENTION, True),
    "shim, ordinary kernel": (True, ORDINARY, False),
    "shim, attention in a checked step": (True, ATTENTION, False),
    "shim, attention graph in a checked step": (True, ATTENTION, True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--launches", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    if not LIBRARY.exists():
        print(f"{LIBRARY} is not built: run `make shim`", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        standin = build_standin(Path(tmp) / "standin")
        source = Path(tmp) / "launch.c"
        source.write_text(PROGRAM)
        program = Path(tmp) / "launch"
        subprocess.run(["cc", "-O2", "-o", str(program), str(source), "-ldl"], check=True)
        # The guard's side: a word with the default patterns, one step checked and open.
        word = StepWord(["*BatchDecodeWithPagedKVCache*", "*flash_fwd*"])
        word.checked()
        env = dict(os.environ, LD_LIBRARY_PATH=str(standin), KVGUARD_SHIM_SOCKET="/nonexistent")
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        try:
            for _ in range(args.rounds):
                for name, (shim, kernel, graph) in VARIANTS.items():
                    run_env = dict(env, LD_PRELOAD=str(LIBRARY)) if shim else env
                    cmd = [str(program), str(args.launches), kernel] + (["graph"] if graph else [])
                    out = subprocess.run(cmd, env=run_env, capture_output=True, text=True, check=True)
                    times[name].append(float(out.stdout.split()[0]))
        finally:
            word.close()
    bases = {graph: statistics.median(times[n]) for n, (shim, _, graph) in VARIANTS.items() if not shim}
    print(
        f"cuLaunchKernel / cuGraphLaunch on the stand-in driver, {args.launches:,} launches, "
        f"median of {args.rounds}"
    )
    print("| variant | ns/launch | ratio | added ns |\n|---|---:|---:|---:|")
    for name, values in times.items():
        med, base = statistics.median(values), bases[VARIANTS[name][2]]
        print(f"| {name} | {med:.1f} | {med / base:.2f} | {med - base:+.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
