"""Reading a live daemon's audit store as an operator does (`kvguard audit ...`), and as the
tests check it (its rows), waiting for what the agent and the daemon store in their own time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from kvguard.daemon.store import Store
from kvguard.proto import pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc


def until(read: Callable[[], Any], done: Callable[[Any], bool], timeout: float = 20) -> Any:
    """What `read` returns once `done` holds of it, or after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = read()
        if done(got) or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def audit(*args: str, ok: tuple[int, ...] = (0,)) -> list[dict[str, Any]]:
    """`kvguard audit ARGS -o json`: the JSON lines it prints (its exit status one of `ok`)."""
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", "audit", *args, "-o", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode in ok, f"kvguard audit {' '.join(args)} exited {done.returncode}: {done.stderr}"
    return [json.loads(line) for line in done.stdout.splitlines() if line.strip()]


def query(store: str, *args: str) -> list[dict[str, Any]]:
    """`kvguard audit query --store STORE ARGS -o json`: the records, as the operator reads them."""
    return audit("query", "--store", store, *args)


def events(store: str) -> list[pb.Event]:
    s = Store(store)
    try:
        return [pb.Event.FromString(body) for _, _, body in s.rows(kind="event")]
    finally:
        s.close()


def commands(store: str) -> list[svc.Command]:
    s = Store(store)
    try:
        return [svc.Command.FromString(body) for _, _, body in s.rows(kind="command")]
    finally:
        s.close()
