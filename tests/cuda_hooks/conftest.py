"""What the witness's test files share: `bpf_ready`, which skips a test where the eBPF witness
cannot be loaded (fails it in CI; tests/conftest.py marks every test that takes it `bpf`), and
`engines`, helpers that run a Python engine process for the witness to watch and talk to it
over its pipes (test files cannot import one another)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import pytest

from kvguard.cuda_hooks.witness import BpfWitness, NullWitness, open_witness


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


@pytest.fixture(scope="session")
def engines() -> SimpleNamespace:
    """watched, closed, say, hear and wait_for, as `engines.hear(engine)`."""
    return SimpleNamespace(watched=watched, closed=closed, say=say, hear=hear, wait_for=wait_for)
