"""Reading a live daemon's audit store as an operator does (`kvguard audit ...`), and as the
tests check it (its rows), waiting for what the agent and the daemon store in their own time."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
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


def receipt_of(store: str, key: Path, req: str, tenant: str) -> dict[str, Any]:
    """What request `req`'s current receipt shows, fetched as its tenant is handed it
    (`kvguard audit receipt REQ -o json`, once signed) and checked offline as the tenant checks
    it: with the public `key` only, naming its own tenant and request."""

    def fetch() -> subprocess.CompletedProcess[bytes]:
        command = ["audit", "receipt", req, "--store", store, "-o", "json"]
        return subprocess.run([sys.executable, "-m", "kvguard", *command], capture_output=True, timeout=60)

    done = until(fetch, lambda d: d.returncode in (0, 1))
    assert done.returncode in (0, 1), done.stderr.decode()
    path = Path(store).parent / f"receipt-{req}.json"
    path.write_bytes(done.stdout)
    verify = ["verify-receipt", str(path), "--key", str(key), "--tenant", tenant, "--req", req]
    check = subprocess.run(
        [sys.executable, "-m", "kvguard", "audit", *verify], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.startswith(f"VALID: receipt of request {req} of tenant {tenant}: "), check.stdout
    shown: dict[str, Any] = json.loads(done.stdout)["shown"]
    return shown


def sources(shown: dict[str, Any]) -> dict[str, int]:
    """A receipt's pages by where their KV came from."""
    return {s["kind"]: int(s["pages"]) for s in shown.get("sources", [])}


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
