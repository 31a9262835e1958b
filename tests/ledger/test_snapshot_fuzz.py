"""Snapshot bytes from a damaged or hostile store: truncated, bit-flipped, or with absurd
numbers in its state or its arrays' headers. Every outcome is a loaded ledger or SnapshotError
(the daemon then replays its store), never another exception, and never an allocation beyond
what the bytes hold."""

from __future__ import annotations

import io
import json
import tracemalloc
import zipfile
from functools import cache
from typing import Any

import numpy as np
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvguard.ledger import snapshot
from kvguard.ledger.ledger import Ledger
from kvguard.proto.builder import EventLog

MOST_BYTES = 32 << 20  # what loading any of these may allocate: the ledger itself is ~1 MiB


@cache
def good() -> bytes:
    """A ledger with something in every part: two nodes' pools, requests that hold, share and
    read pages, a transfer waiting for its receiver, a finding reported."""
    log, ledger = EventLog(), Ledger()
    for node, role in (("p0", "prefill"), ("d0", "decode")):
        log.add(node, "pool", pool=0, role=role, page_size=16, num_pages=64, model="m", context_len=256)
    log.add("p0", "admit", req="a", tenant="acme", prompt_tokens=48, stage="prefill")
    log.add("p0", "alloc", req="a", pool=0, pages=[1, 2, 3])
    log.add("p0", "write", req="a", pool=0, pages=[1, 2, 3])
    log.add("p0", "hold", req="a", pool=0, pages=[1, 2, 3], holder="transfer_send")
    log.add("p0", "share", req="b", pool=0, pages=[1, 2], origin_req="a")
    send = {"req": "a", "xfer": "x1", "peer_node": "d0", "pool": 0, "pages": [1, 2, 3], "tokens": 48}
    log.add("p0", "xfer_send", **send, bytes=4096, status="done")
    log.add("d0", "alloc", req="c", pool=0, pages=[5, 6])
    log.add("d0", "read", reads=[{"req": "c", "pool": 0, "pages": [5, 6], "tokens": 32}])  # stale
    for e in log.events:
        ledger.apply(e)
    return snapshot.dump(ledger)


def loads_or_refuses(data: bytes) -> None:
    tracemalloc.start()
    try:
        try:
            assert isinstance(snapshot.load(data), Ledger)
        except snapshot.SnapshotError as exc:
            assert str(exc) and "\n" not in str(exc)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < MOST_BYTES, f"loading took {peak} bytes"


def members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {name: z.read(name) for name in z.namelist()}


def zipped(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for name, body in files.items():
            z.writestr(name, body)
    return out.getvalue()


ABSURD = st.sampled_from([-1, 0, 1, 255, 1 << 24, (1 << 31) + 1, 1 << 62, 10**30])


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(
    cut=st.integers(0, 1 << 20),
    flips=st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 7)), max_size=8),
)
def test_truncated_or_bit_flipped_bytes(cut: int, flips: list[tuple[int, int]]) -> None:
    data = bytearray(good()[: cut % (len(good()) + 1)])
    for at, bit in flips:
        if data:
            data[at % len(data)] ^= 1 << bit
    loads_or_refuses(bytes(data))


def numbers(value: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """The paths of every whole number in a JSON document."""
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in numbers(v, (*path, k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in numbers(v, (*path, i))]
    return [path] if type(value) is int else []


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_absurd_numbers_in_the_state(data: st.DataObject) -> None:
    files = members(good())
    raw = np.lib.format.read_array(io.BytesIO(files["state.npy"]))
    state = orjson.loads(raw.tobytes())
    paths = numbers(state)
    for path in data.draw(st.lists(st.sampled_from(paths), min_size=1, max_size=3)):
        at = state
        for key in path[:-1]:
            at = at[key]
        at[path[-1]] = data.draw(ABSURD)
    out = io.BytesIO()
    np.lib.format.write_array(out, np.frombuffer(json.dumps(state).encode(), np.uint8))
    files["state.npy"] = out.getvalue()
    loads_or_refuses(zipped(files))


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(data=st.data())
def test_absurd_shapes_and_types_in_the_arrays_headers(data: st.DataObject) -> None:
    files = members(good())
    name = data.draw(st.sampled_from(sorted(files)))
    f = io.BytesIO(files[name])
    version = np.lib.format.read_magic(f)
    fmt = np.lib.format
    read, write = (
        (fmt.read_array_header_1_0, fmt.write_array_header_1_0)
        if version == (1, 0)
        else (fmt.read_array_header_2_0, fmt.write_array_header_2_0)
    )
    shape, _, dtype = read(f)
    body = files[name][f.tell() :]
    n = data.draw(ABSURD)
    shape = data.draw(st.sampled_from([(abs(n),), (abs(n), 1 << 20), (0,), (*shape, 2), shape]))
    dtype = data.draw(st.sampled_from([dtype, np.dtype("<i8"), np.dtype("V64"), np.dtype("<U4")]))
    header = {
        "descr": np.lib.format.dtype_to_descr(dtype),
        "fortran_order": data.draw(st.booleans()),
        "shape": shape,
    }
    out = io.BytesIO()
    write(out, header)
    files[name] = out.getvalue() + body
    loads_or_refuses(zipped(files))


def test_a_compressed_member_is_refused_not_inflated() -> None:
    files = members(good())
    files["state.npy"] = files["state.npy"] + bytes(1 << 24)  # 16 MiB of zeros, a few KiB deflated
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as z:
        for name, body in files.items():
            z.writestr(name, body)
    with pytest.raises(snapshot.SnapshotError, match="'state' is compressed or larger than the snapshot"):
        snapshot.load(out.getvalue())


def test_an_empty_snapshot_is_refused_by_name() -> None:
    with pytest.raises(snapshot.SnapshotError, match=r"^the snapshot is empty \(0 bytes\)$"):
        snapshot.load(b"")
