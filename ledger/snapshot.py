"""Ledger snapshots: the whole state of a Ledger as bytes, and back, so that a daemon restarts
from its latest snapshot plus the events after it instead of replaying its whole history.

Invariant: load(dump(L)) continues exactly as L would (same findings, same state: the
property tests compare dump() of both after the same further events, byte for byte), and
dump() of equal states is equal bytes. The format is data only, never code: an uncompressed
NumPy .npz (read with allow_pickle=False) holding the page arrays, the requests' table, the
small arrays packed into one per dtype, and one JSON document for everything else; every
value read back is checked for its type and shape, and nothing is allocated beyond what its
bytes hold (each array's header is checked against its stored size first). A snapshot that
cannot be read raises SnapshotError naming the reason; the daemon then replays the store
instead.
"""

from __future__ import annotations

import base64
import contextlib
import gc
import io
import math
import zipfile
from collections import Counter, OrderedDict
from typing import Any

import numpy as np
import orjson

from kvguard.ledger.access import Shared
from kvguard.ledger.ledger import Ledger
from kvguard.ledger.pages import MAX_PAGE_SIZE, MAX_PAGES, PoolPages
from kvguard.ledger.pools import Node, Pool
from kvguard.ledger.requests import REQ, Request
from kvguard.ledger.sequence import Gaps
from kvguard.ledger.transfers import Posted, Seen, Side, Transfer
from kvguard.proto import pb

# 3: the ledger split by concept; requests' numbers in one table, grants kept by pool.
# 4: nodes' epochs; verdicts that wait and their deadlines; a fifth kind of hold
# (prefix_cache) and reserved pages in the page records; drift pairs name both pools.
# 5: the gaps in each node's sequence numbers (sequence.py).
FORMAT = 5
SETTINGS = ("dedupe", "clock_skew_ns", "retire_idle", "forget_idle")  # a ledger's constructor arguments
_PAGE_ARRAYS = (
    "gen",
    "owner",
    "use",
    "holds",
    "holder_req",
    "writer",
    "wgen",
    "valid",
    "own",
    "prior",
    "since",
    "reserved",
)


class SnapshotError(ValueError):
    """A snapshot that cannot be loaded, and why."""


class _Packer:
    """Small arrays, packed into one array per dtype; each is named by [dtype, offset, shape]."""

    def __init__(self) -> None:
        self.parts: dict[str, list[np.ndarray]] = {}
        self.sizes: dict[str, int] = {}

    def put(self, a: np.ndarray) -> list[Any]:
        kind = a.dtype.str
        offset = self.sizes.get(kind, 0)
        self.parts.setdefault(kind, []).append(a.ravel())
        self.sizes[kind] = offset + a.size
        return [kind, offset, list(a.shape)]

    def arrays(self) -> dict[str, np.ndarray]:
        return {_packed(kind): np.concatenate(parts) for kind, parts in self.parts.items()}


def _packed(kind: str) -> str:
    """The file name of a dtype's packed array ('<i8' -> 'packed_li8')."""
    return "packed_" + kind.translate(str.maketrans("<>|=", "lbnn"))


class _Arrays:
    """The arrays of a snapshot's .npz, each read when asked for and only if its header agrees
    with the bytes stored for it: uncompressed (np.savez's), plain data, its size as stored.
    Nothing is allocated beyond what the snapshot's bytes hold."""

    def __init__(self, data: bytes) -> None:
        self._size = len(data)
        self._zip = zipfile.ZipFile(io.BytesIO(data))

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            info = self._zip.getinfo(f"{name}.npy")
        except KeyError:
            raise SnapshotError(f"it holds no array {name!r}") from None
        if info.compress_type != zipfile.ZIP_STORED or info.file_size > self._size:
            raise SnapshotError(f"its array {name!r} is compressed or larger than the snapshot")
        with self._zip.open(info) as f:
            version = np.lib.format.read_magic(f)
            if version not in ((1, 0), (2, 0)):
                raise SnapshotError(f"its array {name!r} has an unknown header version {version}")
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            shape, fortran, dtype = read_header(f)
            if dtype.hasobject or fortran:
                raise SnapshotError(f"its array {name!r} is not plain data in C order")
            size = math.prod(shape) * dtype.itemsize
            stored = info.file_size - f.tell()
            if size != stored:
                raise SnapshotError(
                    f"its array {name!r} of shape {shape} needs {size} bytes, {stored} are stored"
                )
            return np.frombuffer(f.read(size), dtype).reshape(shape)


class _Unpacker:
    def __init__(self, files: Any) -> None:
        self.files = files
        self.packed: dict[str, np.ndarray] = {}

    def get(self, ref: list[Any]) -> np.ndarray:
        kind, offset, shape = ref
        if (
            type(kind) is not str
            or type(offset) is not int
            or any(type(n) is not int or n < 0 for n in shape)
        ):
            raise SnapshotError(
                f"an array [{kind!r}, {offset!r}, {shape!r}] is not named by a dtype, offset and shape"
            )
        packed = self.packed.get(kind)
        if packed is None:
            packed = self.packed[kind] = self.files[_packed(kind)]
        size = math.prod(shape)
        if not 0 <= offset <= len(packed) - size:
            raise SnapshotError(f"an array [{kind}, {offset}, {shape}] lies outside the packed data")
        return packed[offset : offset + size].reshape(shape).copy()


def _fact(value: Any) -> Any:
    """A de-duplication fact (nested tuples of str and int) as JSON, and back with _tuple."""
    if isinstance(value, tuple):
        return [_fact(v) for v in value]
    if isinstance(value, np.integer):
        return int(value)
    return value


def _tuple(value: Any) -> Any:
    return tuple(_tuple(v) for v in value) if isinstance(value, list) else value


def _typed(what: str, value: Any, *types: type) -> Any:
    """`value` if it is of one of `types` (a snapshot sets data, nothing else), else SnapshotError."""
    if type(value) not in types:
        names = " or ".join(t.__name__ for t in types)
        raise SnapshotError(f"{what} = {value!r} is not a {names}")
    return value


def settings(ledger: Ledger) -> dict[str, Any]:
    """What a ledger was constructed with (a snapshot's ledger continues only under the same)."""
    return {name: getattr(ledger, name) for name in SETTINGS}


def _message(m: Any) -> str:
    return base64.b64encode(m.SerializeToString()).decode()


def _report(text: str) -> pb.PoolReport:
    return pb.PoolReport.FromString(base64.b64decode(text))


@contextlib.contextmanager
def _no_collections() -> Any:
    """Snapshots build and drop hundreds of thousands of small acyclic objects: every few
    hundred of them would otherwise start a collection that walks the whole ledger."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def dump(ledger: Ledger) -> bytes:
    """The ledger's state (between two applied events) as bytes."""
    with _no_collections():
        return _dump(ledger)


def _dump(ledger: Ledger) -> bytes:
    packer = _Packer()
    big: dict[str, np.ndarray] = {}

    def side(s: Side | None) -> Any:
        if s is None:
            return None
        fields = [s.node, s.pool, s.tokens, s.bytes, s.status, s.seq, s.peer]
        return [*fields, packer.put(s.pages), packer.put(s.checksums)]

    def posted(p: Posted) -> list[Any]:
        return [p.probe, packer.put(p.addr), packer.put(p.end), p.first_ns, p.seen_by]

    nodes = []
    for node in ledger.nodes.values():
        pools = []
        for pool in node.pools.values():
            key = f"pool{len(big)}"
            for name in _PAGE_ARRAYS:
                big[f"{key}.{name}"] = getattr(pool.pages, name)
            # Page numbers fit in int32: half the bytes of the intp arrays grants keep.
            grants = [
                [idx, [packer.put(a.astype(np.int32)) for a in runs]]
                for idx, runs in sorted(pool.grants.items())
            ]
            pools.append(
                {
                    "pool": pool.pool,
                    "report": _message(pool.report),
                    "history": [[seq, ts, _message(r)] for seq, ts, r in pool.history],
                    "live": sorted(pool.live.items()),
                    "grants": grants,
                    "regions": None if pool.regions is None else packer.put(pool.regions),
                    "shared_holds": sorted(
                        [k, p, list(h.items())] for (k, p), h in pool.pages.shared_holds.items()
                    ),
                    "pages": [key, pool.pages.num_pages, pool.pages.page_size],
                }
            )
        previous = sorted([pool_id, _message(r)] for pool_id, r in node.previous.items())
        head = [node.name, node.last_seq, node.last_ts_ns, node.agent_version, node.dropped]
        nodes.append(
            [*head, pools, node.epoch, node.restarts, previous, node.gaps.ranges(), node.handles.dump()]
        )
    book = ledger.requests
    big["requests"] = book.table[: len(book.objects)]
    requests: list[Any] = []
    for r in book.objects:
        if r is None:
            requests.append(None)
            continue
        shared = [
            [n, p, *(packer.put(a) for a in (s.pages, s.gen, s.writer, s.wgen))]
            for (n, p), s in r.shared.items()
        ]
        boot = list(r.bootstrap_nodes) if r.bootstrap_nodes is not None else None
        requests.append([r.id, r.tenant, r.reason, boot, shared, [list(k) for k in r.pools], r.xfers])
    xfers = ledger.transfers
    transfers = [
        [
            t.xfer,
            t.req,
            side(t.send),
            side(t.recv),
            [[probe, s.bytes, s.calls, s.complete, s.node, s.judged] for probe, s in t.wire.items()],
            [posted(p) for p in t.posted],
            t.closed,
        ]
        for t in xfers.by_id.values()
    ]
    stats = ledger.stats
    state = {
        "format": FORMAT,
        "config": settings(ledger),
        "counts": [book.applied, ledger.next_sweep, ledger.next_scan, ledger.last_missing],
        "stats": {
            "events": sorted(stats.events.items()),
            "bad": sorted(stats.bad.items()),
            "findings": sorted(stats.findings.items()),
            **stats.totals(),
        },
        "nodes": nodes,
        "requests": requests,
        "recent": list(book.recent),
        "retired": list(book.retired),
        "free": book.free,
        "transfers": transfers,
        "reported": sorted((_fact(f) for f in ledger.findings.reported), key=orjson.dumps),
        "drift_pairs": sorted(list(p) for p in ledger.pools.drift_pairs),
        "wire_pending": [[idx, t.xfer] for idx, t in xfers.pending.items()],
        "wire_waits": [[x, w.deadline, list(w.nodes)] for x, w in xfers.verdicts.waits.items()],
        "orphans": list(xfers.orphans.items()),
        "posted": [
            [node, [[t.xfer, posted(p)] for t, p in waiting]] for node, waiting in xfers.posted.items()
        ],
    }
    document = orjson.dumps(state, option=orjson.OPT_SORT_KEYS)
    out = io.BytesIO()
    # Plain data only, no pickles: _Arrays refuses anything else when it reads them back.
    np.savez(out, allow_pickle=False, state=np.frombuffer(document, np.uint8), **big, **packer.arrays())
    return out.getvalue()


def load(data: bytes) -> Ledger:
    """A ledger in the state `data` holds (SnapshotError if it cannot be read)."""
    if not data:
        raise SnapshotError("the snapshot is empty (0 bytes)")
    try:
        with _no_collections():
            files = _Arrays(data)
            state = orjson.loads(files["state"].tobytes())
            if type(state) is not dict:
                raise SnapshotError("its state is not a JSON object")
            if state.get("format") != FORMAT:
                raise SnapshotError(f"snapshot format {state.get('format')!r}, this kvguard reads {FORMAT}")
            return _restore(state, files)
    except SnapshotError:
        raise
    except (
        ValueError,
        KeyError,
        TypeError,
        IndexError,
        AttributeError,
        OSError,
        EOFError,
        OverflowError,
        RecursionError,  # nested lists deeper than Python recurses
        NotImplementedError,  # a zip member's feature zipfile does not read
        zipfile.BadZipFile,
        orjson.JSONDecodeError,
    ) as exc:
        raise SnapshotError(f"the snapshot cannot be read: {type(exc).__name__}: {exc}") from exc


def _restore(state: dict[str, Any], files: Any) -> Ledger:
    unpack = _Unpacker(files)
    ledger = Ledger(**state["config"])
    book = ledger.requests
    book.applied, ledger.next_sweep, ledger.next_scan, ledger.last_missing = state["counts"]
    stats, saved = ledger.stats, state["stats"]
    for name in ("events", "bad", "findings"):
        setattr(stats, name, Counter(dict(saved[name])))
    for name, value in saved.items():
        if name not in ("events", "bad", "findings"):
            setattr(stats, name, _typed(f"stats {name}", value, int))
    for name, last_seq, last_ts, version, dropped, pools, epoch, restarts, previous, gaps, *handles in state[
        "nodes"
    ]:
        node = ledger.nodes[name] = Node(
            name,
            last_seq=last_seq,
            gaps=Gaps(gaps),
            last_ts_ns=last_ts,
            epoch=epoch,
            restarts=restarts,
            previous={k: _report(r) for k, r in previous},
            agent_version=version,
            dropped=dropped,
        )
        if handles:  # a snapshot of before handles has none
            rows = handles[0]
            if not isinstance(rows, list) or not all(
                isinstance(row, list) and len(row) == 4 and all(type(v) is int for v in row[:3])
                for row in rows
            ):
                raise SnapshotError(f"the handles of {name} are not [slot, handle, request, name] rows")
            node.handles.restore(epoch, rows)
        for p in pools:
            key, num_pages, page_size = p["pages"]
            owner = files[f"{key}.owner"]  # its pages' records are made only as large as what is stored
            if type(num_pages) is not int or not 1 <= num_pages <= MAX_PAGES or owner.shape != (num_pages,):
                raise SnapshotError(f"pool {p['pool']} of {name}: {num_pages!r} pages, {owner.shape} stored")
            if type(page_size) is not int or not 1 <= page_size <= MAX_PAGE_SIZE:
                raise SnapshotError(f"pool {p['pool']} of {name}: page size {page_size!r}")
            pages = PoolPages(num_pages, page_size)
            for array in _PAGE_ARRAYS:
                value = files[f"{key}.{array}"]
                if value.shape != getattr(pages, array).shape or value.dtype != getattr(pages, array).dtype:
                    raise SnapshotError(
                        f"pool {p['pool']} of {name}: its {array} array does not fit the pool"
                    )
                getattr(pages, array)[...] = value  # into the pool's records: the fields are views of them
            pages.shared_holds = {(k, page): dict(holders) for k, page, holders in p["shared_holds"]}
            pool = node.pools[p["pool"]] = Pool(name, p["pool"], _report(p["report"]), pages)
            pool.history = [(seq, ts, _report(r)) for seq, ts, r in p["history"]]
            pool.restore(
                {_typed("a live count's request", idx, int): n for idx, n in p["live"]},
                {idx: [unpack.get(a) for a in runs] for idx, runs in p["grants"]},
            )
            pool.reset(pages, None if p["regions"] is None else unpack.get(p["regions"]))
            node.views[pool.pool] = pool.view

    def side(s: Any) -> Side | None:
        if s is None:
            return None
        node, pool, tokens, nbytes, status, seq, peer, pages, checksums = s
        return Side(node, pool, unpack.get(pages), tokens, nbytes, unpack.get(checksums), status, seq, peer)

    def posted(p: list[Any]) -> Posted:
        probe, addr, end, first_ns, seen_by = p
        return Posted(probe, unpack.get(addr), unpack.get(end), first_ns, seen_by)

    table = files["requests"]
    if table.dtype != REQ or table.ndim != 1 or len(table) != len(state["requests"]):
        raise SnapshotError("the requests' table does not fit the requests")
    book.reserve(len(table))
    book.table[: len(table)] = table
    book.objects = []
    for entry in state["requests"]:
        if entry is None:
            book.objects.append(None)
            continue
        rid, tenant, reason, boot, shared, pools, xfers = entry
        r = Request(book, _typed("a request's id", rid, str), len(book.objects))
        r.tenant = _typed(f"request {rid}'s tenant", tenant, str)
        r.reason = _typed(f"request {rid}'s reason", reason, str)
        if boot is not None:
            if [type(v) for v in boot] != [str, str]:
                raise SnapshotError(
                    f"request {rid}'s bootstrap = {boot!r} is not (prefill node, decode node)"
                )
            r.bootstrap_nodes = (boot[0], boot[1])
        r.shared = {(n, p): Shared(*(unpack.get(a) for a in arrays)) for n, p, *arrays in shared}
        r.pools = [(_typed("a pool's node", n, str), _typed("a pool's id", p, int)) for n, p in pools]
        r.xfers = [_typed(f"request {rid}'s transfer", x, str) for x in xfers]
        book.objects.append(r)
        book.index[r.id] = r.idx
    objects = book.objects
    book.recent = OrderedDict((idx, objects[idx]) for idx in state["recent"])
    book.retired = {idx: objects[idx] for idx in state["retired"]}
    book.free = list(state["free"])
    xfers = ledger.transfers
    for xfer, req, send, recv, wire, waiting, closed in state["transfers"]:
        t = xfers.by_id[xfer] = Transfer(xfer, req, side(send), side(recv), closed=closed)
        t.wire = {probe: Seen(*seen) for probe, *seen in wire}
        t.posted = [posted(p) for p in waiting]
    ledger.findings.reported = {_tuple(f) for f in state["reported"]}
    ledger.pools.drift_pairs = {tuple(p) for p in state["drift_pairs"]}
    xfers.pending.update((idx, xfers.by_id[xfer]) for idx, xfer in state["wire_pending"])
    waits = state["wire_waits"]
    xfers.verdicts.restore([(xfers.by_id[x], deadline, tuple(nodes)) for x, deadline, nodes in waits])
    xfers.orphans = {xfer: last for xfer, last in state["orphans"]}
    xfers.posted = {
        node: [(xfers.by_id[xfer], posted(p)) for xfer, p in waiting] for node, waiting in state["posted"]
    }
    return ledger
