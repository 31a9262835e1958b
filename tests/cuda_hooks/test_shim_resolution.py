"""How a process reaches the CUDA driver, and the shim with it (`make shim`): a C program
linked against the stand-in driver (testbed/standin) launches one attention kernel by every
door an engine uses (a direct call bound by name, dlsym on libcuda's handle, the per-thread
stream's name, dlsym(RTLD_DEFAULT), cuGetProcAddress of CUDA 11 and of 12, a graph
instantiated with CUDA 11's ABI). Each launch is judged exactly once, every call's result is
the driver's own, and dlsym(RTLD_NEXT) still answers relative to its real caller."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import pytest

from kvguard.cuda_hooks.shim import LIBRARY, LaunchRecord, Record, ShimListener
from kvguard.cuda_hooks.steps import StepWord
from kvguard.testbed.standin import build

PROGRAM = r"""
#include <dlfcn.h>
#include <stdio.h>
typedef int (*launch_t)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                        void **, void **);
typedef int (*gpa1_t)(const char *, void **, int, unsigned long long);
typedef int (*gpa2_t)(const char *, void **, int, unsigned long long, int *);
int cuLaunchKernel(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *,
                   void **, void **);
int cuModuleGetFunction(void **, void *, const char *);
int cuGetProcAddress(const char *, void **, int, unsigned long long);
int cuStreamCreate(void **, unsigned);
int cuStreamBeginCapture_v2(void *, int);
int cuStreamEndCapture(void *, void **);
int cuGraphLaunch(void *, void *);
int next_value(void);
#define ARGS(f) f, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL
int main(void) {
    void *f, *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    cuModuleGetFunction(&f, NULL, "_Z16flash_fwd_kernelv");
    int s[9], n = 0;
    s[n++] = cuLaunchKernel(ARGS(f));                                          /* 1 bound by name */
    s[n++] = ((launch_t)dlsym(h, "cuLaunchKernel"))(ARGS(f));                  /* 2 dlsym, handle */
    s[n++] = ((launch_t)dlsym(h, "cuLaunchKernel_ptsz"))(ARGS(f));             /* 3 per-thread name */
    s[n++] = ((launch_t)dlsym(RTLD_DEFAULT, "cuLaunchKernel"))(ARGS(f));       /* 4 the shim's own */
    launch_t v11, v12;
    gpa2_t gpa2;
    s[n++] = cuGetProcAddress("cuLaunchKernel", (void **)&v11, 11030, 0) | v11(ARGS(f));  /* 5 CUDA 11 */
    ((gpa1_t)dlsym(h, "cuGetProcAddress"))("cuGetProcAddress", (void **)&gpa2, 12000, 0);
    s[n++] = gpa2("cuLaunchKernel", (void **)&v12, 12080, 2, NULL) | v12(ARGS(f));         /* 6 CUDA 12 */
    int (*inst5)(void **, void *, void **, char *, size_t);
    void *stream, *graph, *exec;
    cuGetProcAddress("cuGraphInstantiate", (void **)&inst5, 11000, 0);
    cuStreamCreate(&stream, 0);
    cuStreamBeginCapture_v2(stream, 0);
    v12(f, 1, 1, 1, 1, 1, 1, 0, stream, NULL, NULL);                              /* captured, not run */
    cuStreamEndCapture(stream, &graph);
    s[n++] = inst5(&exec, graph, NULL, NULL, 0) | cuGraphLaunch(exec, NULL);     /* 7 CUDA 11's graph ABI */
    int bad = cuLaunchKernel(NULL, 1, 1, 1, 1, 1, 1, 0, NULL, NULL, NULL);       /* refused by the driver */
    int (*flush)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "kvguard_launches_flush");
    if (flush)
        flush();
    int failed = 0;
    for (int i = 0; i < n; i++)
        failed |= s[i];
    printf("%d %d %d\n", failed, bad, next_value());
    return 0;
}
"""
FOO = """int value = 1;
#include <dlfcn.h>
int next_value(void) { int *v = dlsym(RTLD_NEXT, "value"); return v ? *v : -1; }
"""
BAR = "int value = 2;\n"


@pytest.fixture(scope="module")
def program(tmp_path_factory: pytest.TempPathFactory) -> Path:
    assert LIBRARY.exists(), f"{LIBRARY} is not built: run `make shim`"
    out = tmp_path_factory.mktemp("resolution")
    standin = build(out / "standin")
    for name, source in (("libfoo.so", FOO), ("libbar.so", BAR)):
        (out / f"{name}.c").write_text(source)
        subprocess.run(["cc", "-shared", "-fPIC", "-o", out / name, out / f"{name}.c", "-ldl"], check=True)
    (out / "program.c").write_text(PROGRAM)
    links = [
        f"-L{standin}",
        "-l:libcuda.so.1",
        f"-Wl,-rpath,{standin}",
        f"-L{out}",
        "-Wl,--no-as-needed",
        "-lfoo",
        "-lbar",
    ]
    subprocess.run(
        ["cc", "-o", out / "program", out / "program.c", *links, f"-Wl,-rpath,{out}", "-ldl"], check=True
    )
    return out / "program"


def run(program: Path, shim: bool, env: dict[str, str]) -> list[int]:
    env = {**os.environ, **env}
    if shim:
        env["LD_PRELOAD"] = str(LIBRARY)
    done = subprocess.run([str(program)], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return [int(v) for v in done.stdout.split()]


def test_every_door_to_the_driver_is_watched_once(program: Path, tmp_path: Path) -> None:
    got: list[Record] = []
    arrived = threading.Event()

    def take(pid: int, record: Record) -> None:
        got.append(record)
        arrived.set()

    listener = ShimListener(tmp_path / "shim.sock", take, lambda pid, why: got.append(why))  # type: ignore[arg-type]
    word = StepWord(["*flash_fwd*"])
    word.checked()  # one step, open for the whole run
    try:
        shimmed = run(
            program,
            True,
            {"KVGUARD_SHIM_SOCKET": str(tmp_path / "shim.sock"), "KVGUARD_STEPS": str(word.path)},
        )
        assert arrived.wait(10)
    finally:
        listener.close()
        word.close()
    plain = run(program, False, {})
    # The same results with and without it: the calls' statuses, the driver's refusal, and
    # RTLD_NEXT from libfoo finding libbar's `value`, not libfoo's own (nor the shim's answer).
    assert shimmed == plain == [0, plain[1], 2] and plain[1] != 0
    (record,) = got
    assert isinstance(record, LaunchRecord)
    assert (record.attention, record.checked, record.unguarded, record.captured) == (7, 7, 0, 1)
    assert (record.launches, record.graphs, record.unnamed, record.unwrapped) == (8, 1, 0, 0)
