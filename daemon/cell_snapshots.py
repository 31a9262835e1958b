"""Cells' ledger snapshots on the bus (`CellSnapshots`): each cell's latest, kept as one object
of the cluster's JetStream object store (proto/bus.py names it), so that a daemon taking a
cell starts from it and the events of its nodes stored after it, not from its whole history.

An object is `KVGCELL 1\\n`, one JSON line {through, digest, nodes, settings} and the ledger's
bytes (ledger/snapshot.py). It is built by the snapshot worker from the store alone (the
previous one loaded, its nodes' events after it applied up to the store's end), never from
the live ledger, and bound to the store's chain at the record it was taken after (the digest
a store's own snapshot has, under its audit key when it is sealed).

Invariants: a snapshot is used only if it parses, matches the chain at its record and was
taken with this daemon's ledger settings; any other is said in one line naming the cell and
why, counted, and the cell rebuilt from the store. Loading it and applying what follows goes on
as replaying the cell's whole history would (the worker and the daemon replay alike). At most
one is built at a time; the worker dies with the daemon.
"""

from __future__ import annotations

import asyncio
import io
from collections import Counter
from typing import TYPE_CHECKING, Any

import orjson

from kvguard.daemon.snapshots import worker_command, worker_input, worker_output
from kvguard.ledger import snapshot
from kvguard.proto import bus
from kvguard.proto.logs import logger

if TYPE_CHECKING:
    from kvguard.daemon.daemon import CellStart, Daemon

log = logger("daemon")

HEAD = b"KVGCELL 1\n"
MAX_HEAD = 1 << 20  # bytes of an object's JSON line: its nodes' names, the settings


class CellSnapshotError(ValueError):
    """An object that is not a cell's snapshot, and why."""


def pack(through: int, digest: bytes, nodes: list[str], settings: dict[str, Any], body: bytes) -> bytes:
    meta = {"through": through, "digest": digest.hex(), "nodes": nodes, "settings": settings}
    return HEAD + orjson.dumps(meta) + b"\n" + body


def unpack(data: bytes) -> tuple[int, bytes, list[str], dict[str, Any], bytes]:
    """(through, digest, nodes, settings, body) of an object; CellSnapshotError if it is not one."""
    if not data.startswith(HEAD):
        raise CellSnapshotError("it does not begin as a cell snapshot does")
    end = data.find(b"\n", len(HEAD), len(HEAD) + MAX_HEAD)
    if end < 0:
        raise CellSnapshotError(f"its description is not a line of at most {MAX_HEAD} bytes")
    try:
        meta = orjson.loads(data[len(HEAD) : end])
        through, digest, nodes, settings = meta["through"], meta["digest"], meta["nodes"], meta["settings"]
        if type(through) is not int or through < 0 or type(settings) is not dict:
            raise TypeError("through or settings")
        if type(nodes) is not list or not all(type(n) is str for n in nodes):
            raise TypeError("nodes")
        return through, bytes.fromhex(digest), nodes, settings, data[end + 1 :]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise CellSnapshotError(f"its description does not read ({exc})") from None


class CellSnapshots:
    def __init__(self, daemon: Daemon, js: Any, cluster: str, replicas: int, every: int) -> None:
        """Snapshots of the cells `daemon` holds on the bus of `cluster` (through JetStream
        `js`), each due once `every` events of it were taken since its last (0: never)."""
        self.daemon = daemon
        self.store = daemon.store
        self.js = js
        self.cluster = cluster
        self.replicas = replicas
        self.every = every
        self.settings = snapshot.settings(daemon.fresh())
        self.counters: Counter[str] = daemon.counters
        self.building = False
        self._objects: Any = None

    async def _store(self) -> Any:
        """The object store, made if it is not there."""
        if self._objects is None:
            from nats.js.api import ObjectStoreConfig, StorageType

            name = bus.snapshots_name(self.cluster)
            try:
                self._objects = await self.js.object_store(name)
            except Exception:
                config = ObjectStoreConfig(storage=StorageType.FILE, replicas=self.replicas)
                self._objects = await self.js.create_object_store(name, config)
        return self._objects

    async def _fetch(self, cell: str) -> bytes | None:
        from nats.js.errors import ObjectNotFoundError

        objects = await self._store()
        into = io.BytesIO()  # chunk by chunk: the client's own concatenation is quadratic
        try:
            await objects.get(bus.snapshot_name(cell), writeinto=into)
        except ObjectNotFoundError:
            return None
        return into.getvalue()

    async def load(self, cell: str) -> CellStart | None:
        """The cell's latest snapshot, checked and loaded (off the loop); None if it has none
        or none that may be used (said and counted): the cell is rebuilt from the store."""
        from kvguard.daemon.daemon import CellStart

        try:
            data = await self._fetch(cell)
        except Exception as exc:  # the bus cannot say: the store can
            return self._refused(cell, f"it could not be read ({type(exc).__name__} {exc})".rstrip())
        if data is None:
            return None

        def check() -> CellStart | str:
            try:
                through, digest, nodes, settings, body = unpack(data)
            except CellSnapshotError as exc:
                return str(exc)
            if settings != self.settings:
                return "it was taken with other ledger settings"
            wrong = self.store.unbound(through, body, digest)
            if wrong is not None:
                return wrong
            try:
                return CellStart(snapshot.load(body), through, frozenset(nodes))
            except snapshot.SnapshotError as exc:
                return f"it cannot be loaded: {exc}"

        found = await asyncio.get_running_loop().run_in_executor(None, check)
        if isinstance(found, str):
            return self._refused(cell, found)
        self.counters["cell_snapshots_loaded"] += 1
        return found

    def _refused(self, cell: str, why: str) -> None:
        self.counters["cell_snapshots_refused"] += 1
        log.warning(f"bus: cell {cell}'s snapshot not used: {why}; the cell is rebuilt from the audit store")
        return None

    async def save(self, cell: str, nodes: list[str]) -> None:
        """Build the cell's next snapshot from its previous one and the store, and keep it;
        a failure is said and counted (the previous one stays)."""
        if self.building:
            return
        self.building = True
        try:
            await self._save(cell, nodes)
        except Exception as exc:
            self.counters["cell_snapshot_failures"] += 1
            log.warning(f"bus: cell {cell}'s snapshot not saved: {type(exc).__name__} {exc}".rstrip())
        finally:
            self.building = False

    async def _save(self, cell: str, nodes: list[str]) -> None:
        loop = asyncio.get_running_loop()
        previous, after, held = b"", 0, []
        data = await self._fetch(cell)
        if data is not None:
            try:
                after, digest, held, settings, body = unpack(data)
                sound = settings == self.settings and not await loop.run_in_executor(
                    None, self.store.unbound, after, body, digest
                )
                previous = body if sound else b""
            except CellSnapshotError:
                pass
            if not previous:
                after, held = 0, []
        nodes = sorted(set(nodes) | set(held))  # what it held stays in it, whatever is said of it now
        command = worker_command(
            self.store,
            self.settings,
            *("--nodes", orjson.dumps(nodes).decode(), "--after", str(after)),
            *("--held", orjson.dumps(held).decode()),
        )
        worker = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await worker.communicate(worker_input(self.store, previous))
        assert worker.returncode is not None  # communicate() waited for it
        through, body = worker_output(worker.returncode, out, err)
        if not body:
            return  # nothing of its nodes stored since the last
        digest = await loop.run_in_executor(None, self.store.bind, through, body)
        objects = await self._store()
        await objects.put(
            bus.snapshot_name(cell),
            pack(through, digest, nodes, self.settings, body),
        )
        self.counters["cell_snapshots"] += 1
        log.info(f"bus: cell {cell}'s snapshot saved after record {through} ({len(body)} bytes)")
