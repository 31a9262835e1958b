"""The head of the audit chain (how many records it has and its last hash), kept in a file
outside the database, so that the chain's end can be proven: a store whose last records were
deleted still chains, but no longer reaches its head.

Invariants: the head is written by the store's writer only, after each commit is durable, so
it never claims a record the database may not hold (after a crash it may lag: it then proves
completeness up to the record it names, and says so); it is sealed, like the chain, with the
current audit key (HMAC-SHA256), so without the key it cannot be forged, only deleted or an
old one put back; the file is one fixed-size line, created atomically (write, fsync, rename)
and then overwritten in place (one sector: after a crash it holds the old head or the new).
"""

from __future__ import annotations

import hmac
import os
import time
from pathlib import Path
from typing import NamedTuple

from sqlalchemy.engine import make_url

from kvguard.daemon.store.chain import digest

MAGIC = b"kvguard-audit-head 1 "
SUFFIX = ".head"  # a SQLite store's head: its database file's name and this, beside it
SYNC_EVERY_S = 1.0  # the head is made durable at most this often (Store.sync_head, when idle)
_LINE = len(MAGIC) + 20 + 1 + 64 + 1 + 64 + 1
_READS = 3  # a read torn by the writer's overwrite is read again


class HeadError(ValueError):
    """A head file that cannot be read: which file, and why."""


class Head(NamedTuple):
    count: int  # the chain's records (ids 1..count)
    last_hash: bytes  # record `count`'s hash (GENESIS for none)
    tag: bytes


def default_path(url: str) -> str | None:
    """Where a store's head lies unless it is given: beside a SQLite database file (its name +
    ".head"); for a server's database, in the daemon's state directory ($STATE_DIRECTORY, set
    by systemd's StateDirectory=; else the working directory), named after the database. None
    for an in-memory SQLite store (nothing outside the process can edit it)."""
    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite":
        database = parsed.database or ""
        if database in ("", ":memory:") or "mode=memory" in database:
            return None
        if database.startswith("file:"):
            database = database[len("file:") :].split("?")[0]
        return str(Path(database).resolve()) + SUFFIX
    state = os.environ.get("STATE_DIRECTORY", "").split(":")[0] or "."
    return str(Path(state).resolve() / f"kvguard-audit-{parsed.database or 'store'}{SUFFIX}")


def tag(count: int, last_hash: bytes, key: bytes | None) -> bytes:
    """What seals a head: HMAC-SHA256 under the audit key, or (a store not sealed) SHA-256,
    which shows damage only: anyone may recompute it."""
    return digest(b"kvguard audit head %d " % count + last_hash, key)


def _line(count: int, last_hash: bytes, key: bytes | None) -> bytes:
    return MAGIC + b"%020d %s %s\n" % (
        count,
        last_hash.hex().encode(),
        tag(count, last_hash, key).hex().encode(),
    )


def create(path: str, count: int, last_hash: bytes, key: bytes | None) -> None:
    """Write the head anew, atomically and durably: a temporary file, fsync, rename over the
    old one, fsync of the folder (a seal, a key rotation, a head adopted on purpose)."""
    folder = os.path.dirname(path) or "."
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, _line(count, last_hash, key))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dirfd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dirfd)
    finally:
        os.close(dirfd)


def write(path: str, count: int, last_hash: bytes, key: bytes | None) -> None:
    """After a commit: overwrite the head in place, without waiting for the disk (the commit
    itself was fsynced; `sync` makes the head durable later, off the commit's path). A head
    file gone or replaced is written anew."""
    try:
        fd = os.open(path, os.O_WRONLY)
    except FileNotFoundError:
        create(path, count, last_hash, key)
        return
    try:
        os.pwrite(fd, _line(count, last_hash, key), 0)
    finally:
        os.close(fd)


def sync(path: str) -> None:
    """Make what `write` left in the page cache durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def read(path: str) -> Head | None:
    """The head in `path`; None if there is no such file; HeadError if it is not a head."""
    problem = ""
    for attempt in range(_READS):
        try:
            with open(path, "rb") as f:
                data = f.read(_LINE)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HeadError(f"head file {path}: {exc.strerror}") from None
        parts = data[len(MAGIC) :].split()
        if data.startswith(MAGIC) and len(data) == _LINE and data.endswith(b"\n") and len(parts) == 3:
            try:
                count, last_hash, sealed = (
                    int(parts[0]),
                    bytes.fromhex(parts[1].decode()),
                    bytes.fromhex(parts[2].decode()),
                )
            except ValueError:
                problem = "it is not a kvguard audit head"
            else:
                return Head(count, last_hash, sealed)
        else:
            problem = "it is not a kvguard audit head" if not data.startswith(MAGIC[:8]) else "it is damaged"
        time.sleep(0.01 * (attempt + 1))  # read while the writer overwrote it: read again
    raise HeadError(f"head file {path}: {problem}")


def sealed_by(head: Head, key: bytes | None) -> bool:
    """Whether `head` was written by the holder of `key` (None: a store not sealed)."""
    return hmac.compare_digest(head.tag, tag(head.count, head.last_hash, key))


class Completeness(NamedTuple):
    """What the head proves of a store: whether it is complete as far as the head knows, the
    last record that is proven to be there (1..through), and what was found, in one line."""

    proven: bool
    through: int
    said: str


def judge(
    path: str | None, found: Head | None, count: int, at_head: tuple[int, bytes] | None, key: bytes | None
) -> Completeness:
    """Hold the store (`count` records; `at_head`: (the last id, the hash) of the record that
    holds the head's last id) against its head `found` in `path`; `key`: the current audit
    key (None: the store is not sealed)."""
    if path is None:
        return Completeness(True, count, "an in-memory store has no head: nothing outside it can edit it")
    if found is None:
        if not count and key is None:
            return Completeness(True, 0, f"no records, and no head file yet ({path})")
        held = f"{count} records" if count else "a seal (which writes one)"
        return Completeness(
            False,
            0,
            f"no head file {path} for a store with {held}: its end cannot be proven (records may have been "
            "deleted from it); `kvguard audit head` writes one for the store as it stands",
        )
    if not sealed_by(found, key):
        if key is not None:
            why = f"the head file {path} was not sealed with the store's audit key: forged or damaged"
        else:  # a head under a key, of a store now unsealed, is what a seal removed with a rewrite leaves
            why = (
                f"the head file {path} does not check as a head of a store not sealed: damaged, forged, "
                "or sealed with a key whose seal was removed"
            )
        return Completeness(False, 0, why)
    if found.count > count:
        gone = (
            f"all {found.count} records were deleted"
            if not count
            else f"records {count + 1} to {found.count} were deleted from its end"
        )
        return Completeness(
            False,
            count,
            f"the store ends at record {count} but its head file {path} names record {found.count}: {gone}",
        )
    if at_head != (found.count, found.last_hash):
        return Completeness(
            False,
            0,
            f"record {found.count} is not the one the head file {path} names (its hash differs): "
            "the chain was rewritten",
        )
    if found.count < count:
        return Completeness(
            True,
            found.count,
            f"complete through record {found.count}, which the head file {path} names; records "
            f"{found.count + 1} to {count} came after its last write (a crash between their commit and the "
            "head's write?)",
        )
    return Completeness(True, count, f"complete through record {count}, which the head file {path} names")
