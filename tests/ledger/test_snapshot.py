"""Ledger snapshots: a ledger dumped and loaded at any point goes on as the ledger would, a
snapshot sets data only, and a bad one is refused by name."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvguard.ledger.ledger import Ledger
from kvguard.proto import pb


def test_a_snapshot_at_any_point_goes_on_as_the_ledger_would(remote: Any) -> None:
    # What the property tests' lifecycles do not reach: RDMA writes waiting for the receiver
    # (registered regions, page times), a short wire report waiting for the request's next
    # event, retired and forgotten requests. Cut anywhere, restored, the same findings follow.
    from kvguard.ledger import snapshot

    # conftest.py's RemoteWrites scenario: a late RDMA write into b's pages, judged when
    # decode's clock passes the post
    remote.add("d0", "heartbeat", 1500)
    remote.wire([4, 5, 6], posted_ms=2500)
    remote.add("d0", "heartbeat", 1600)
    remote.abort_and_regrant(at_ms=2000)
    remote.add("d0", "heartbeat", 2700)
    log = remote.log  # and a transfer the witness saw only half of, judged at w's next read
    log.add("q0", "pool", pool=0, role="prefill", page_size=16, num_pages=16)
    log.add("q0", "alloc", req="w", pool=0, pages=[1, 2])
    log.add("q0", "write", req="w", pool=0, pages=[1, 2])
    claim = {"req": "w", "xfer": "x9", "peer_node": "d9", "pool": 0, "pages": [1, 2], "tokens": 32}
    log.add("q0", "xfer_send", **claim, bytes=8192, status="done")
    log.add("q0/ebpf", "wire", xfer="x9", probe="ebpf:tcp", bytes=4096, calls=1)
    log.add("d9", "pool", pool=0, role="decode", page_size=16, num_pages=16)
    log.add("d9", "alloc", req="w", pool=0, pages=[3, 4])
    log.add("d9", "xfer_recv", req="w", xfer="x9", pool=0, pages=[3, 4], tokens=32, bytes=8192, status="done")
    log.add("d9", "read", reads=[{"req": "w", "pool": 0, "pages": [3, 4], "tokens": 32}])
    log.add("q0/ebpf", "wire", xfer="stray", probe="ebpf:tcp", bytes=1, calls=1)  # never claimed
    for _ in range(8):
        log.add("q0", "heartbeat")
    stream = log.events
    retiring = {"retire_idle": 2, "forget_idle": 6}
    whole = Ledger(**retiring)
    expected = [(f.finding, f.node, f.seq) for e in stream for f in whole.apply(e)]
    assert {"late_write", "transfer_mismatch"} <= {kind for kind, _, _ in expected}
    for k in range(len(stream) + 1):
        part = Ledger(**retiring)
        found = [(f.finding, f.node, f.seq) for e in stream[:k] for f in part.apply(e)]
        resumed = snapshot.load(snapshot.dump(part))
        found += [(f.finding, f.node, f.seq) for e in stream[k:] for f in resumed.apply(e)]
        assert found == expected, f"cut at {k}"
        assert snapshot.dump(resumed) == snapshot.dump(whole), f"cut at {k}"


def test_a_snapshot_sets_data_only_and_a_bad_one_is_refused_by_name(
    witnessed_transfer: Callable[..., list[pb.Event]],
) -> None:
    import io

    import orjson

    from kvguard.ledger import snapshot

    ledger = Ledger()
    for e in witnessed_transfer({"bytes": 8192, "complete": True}, wire_first=False):
        ledger.apply(e)
    good = snapshot.dump(ledger)
    assert snapshot.dump(snapshot.load(good)) == good

    def altered(change: object, arrays_changed: dict[str, np.ndarray] | None = None) -> bytes:
        files = np.load(io.BytesIO(good), allow_pickle=False)
        arrays = {name: files[name] for name in files.files} | (arrays_changed or {})
        state = orjson.loads(bytes(arrays["state"]))
        change(state)  # type: ignore[operator]
        arrays["state"] = np.frombuffer(orjson.dumps(state), np.uint8)
        out = io.BytesIO()
        np.savez(out, **arrays)
        return out.getvalue()

    def tenant(state: dict) -> None:  # type: ignore[type-arg]
        state["requests"][1][1] = ["not", "a", "name"]

    def bootstrap(state: dict) -> None:  # type: ignore[type-arg]
        state["requests"][1][3] = ["p0", 3]

    def newer(state: dict) -> None:  # type: ignore[type-arg]
        state["format"] = 99

    def older(state: dict) -> None:  # type: ignore[type-arg]
        state["format"] = snapshot.FORMAT - 1  # 3: four kinds of hold a page, no reserved pages

    for change, reason in (
        (tenant, r"tenant = \['not', 'a', 'name'\] is not a str"),
        (bootstrap, r"bootstrap = \['p0', 3\] is not \(prefill node, decode node\)"),
        (newer, f"snapshot format 99, this kvguard reads {snapshot.FORMAT}"),
        (older, f"snapshot format {snapshot.FORMAT - 1}, this kvguard reads {snapshot.FORMAT}"),
    ):
        with pytest.raises(snapshot.SnapshotError, match=reason):
            snapshot.load(altered(change))
    with pytest.raises(snapshot.SnapshotError, match="cannot be read"):
        snapshot.load(good[: len(good) // 2])
    # Format 3's page records held four kinds of hold: such holds, however labelled, do not fit.
    holds = np.load(io.BytesIO(good), allow_pickle=False)["pool0.holds"]
    with pytest.raises(snapshot.SnapshotError, match="its holds array does not fit the pool"):
        snapshot.load(altered(lambda state: None, {"pool0.holds": holds[:4]}))
