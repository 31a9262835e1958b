"""Where the daemon's ledger snapshots lie and how a bad one fails safe: a snapshot stored in
parts (no SQL value holds a large ledger whole) and read back whole; one stored whole before
parts existed still read; one that cannot be read back or loaded said in one line, by name,
and the store replayed instead (the periodic snapshot's worker: test_snapshot_worker.py)."""

from __future__ import annotations

import io
import threading
import zipfile
from collections import Counter

import numpy as np
import pytest
from alembic import command
from sqlalchemy import create_engine, text

from kvguard.daemon.snapshots import restored
from kvguard.daemon.store import Record, Store, migrations
from kvguard.daemon.store import store_url as url_of
from kvguard.daemon.store.chain import snapshot_digest
from kvguard.ledger import Ledger, snapshot
from kvguard.proto.builder import EventLog


def events() -> list:
    log = EventLog()
    log.add("n0", "pool", pool=0, role="colocated", page_size=16, num_pages=64)
    for i in range(8):
        log.add("n0", "alloc", req=f"r{i}", pool=0, pages=[i + 1])
    return log.events


def ledger_of(evs: list) -> Ledger:
    ledger = Ledger()
    for e in evs:
        ledger.apply(e)
    return ledger


def parts(store_url: str) -> list[tuple[int, int]]:
    engine = create_engine(url_of(store_url))
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT snapshot_id, part FROM snapshot_parts ORDER BY 1, 2")).all()
            return [(int(a), int(b)) for a, b in rows]
    finally:
        engine.dispose()


def test_a_snapshot_is_stored_in_parts_and_read_back_whole(store_url: str) -> None:
    store = Store(store_url)
    evs = events()
    store.append([Record.of_event(e) for e in evs])
    body = snapshot.dump(ledger_of(evs))
    through = store.save_snapshot(body, part_bytes=1000)
    assert store.latest_snapshot() == (through, body)
    count = -(-len(body) // 1000)
    assert count > 2 and [p for _, p in parts(store_url)] == list(range(count))
    for _ in range(2):  # only the newest two are kept, parts and all
        store.save_snapshot(body, part_bytes=len(body) // 2 + 1)
    assert sorted(Counter(s for s, _ in parts(store_url)).values()) == [2, 2]
    assert store.latest_snapshot() == (through, body)
    assert snapshot.dump(snapshot.load(store.latest_snapshot()[1])) == body  # type: ignore[index]


def test_a_snapshot_stored_whole_before_parts_existed_is_still_loaded(store_url: str) -> None:
    store = Store(store_url)
    evs = events()
    store.append([Record.of_event(e) for e in evs])
    store.close()
    body = snapshot.dump(ledger_of(evs))
    engine = create_engine(url_of(store_url))
    with engine.begin() as conn:
        command.downgrade(migrations(conn), "0007")
        last = conn.execute(text("SELECT id, hash FROM records ORDER BY id DESC LIMIT 1")).one()
        row = {"t": last[0], "b": body, "d": snapshot_digest(bytes(last[1]), body, None)}
        insert = "INSERT INTO snapshots (through_id, created_ns, body, digest) VALUES (:t, 1, :b, :d)"
        conn.execute(text(insert), row)
    engine.dispose()
    store = Store(store_url)  # upgraded to parts on open
    ledger, through = restored(store, Ledger())
    assert through == last[0] and snapshot.dump(ledger) == body


def stored_whole(store: Store, body: bytes) -> int:
    """A snapshot stored as a store of revision 0007 stored it (whole), with a sound digest."""
    with store.engine.begin() as conn:
        last = conn.execute(text("SELECT id, hash FROM records ORDER BY id DESC LIMIT 1")).one()
        row = {"t": last[0], "b": body, "d": snapshot_digest(bytes(last[1]), body, None)}
        insert = "INSERT INTO snapshots (through_id, created_ns, body, digest) VALUES (:t, 1, :b, :d)"
        conn.execute(text(insert), row)
    return int(last[0])


@pytest.mark.parametrize("damage", ["empty body", "a part missing", "not a snapshot", "absurd sizes"])
def test_a_snapshot_that_cannot_be_used_is_said_in_one_line_and_the_store_replayed(
    store_url: str, damage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    store = Store(store_url)
    evs = events()
    store.append([Record.of_event(e) for e in evs])
    good = snapshot.dump(ledger_of(evs))
    if damage == "a part missing":
        through = store.save_snapshot(good, part_bytes=1000)
        with store.engine.begin() as conn:
            conn.execute(text("DELETE FROM snapshot_parts WHERE part = 1"))
        reason = f"the snapshot taken after record {through} has part 2 where part 1 of"
    elif damage == "empty body":
        through = stored_whole(store, b"")
        reason = f"the snapshot taken after record {through} has an empty body"
    else:
        body = b"not a snapshot" * 100 if damage == "not a snapshot" else absurd(good)
        through = stored_whole(store, body)
        reason = f"the snapshot taken after record {through} cannot be loaded: "
    ledger, at = restored(store, Ledger())
    assert at == 0 and ledger.nodes == {}  # fresh: the whole store is replayed
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and reason in said and said.endswith("; replaying the whole store\n")


def absurd(good: bytes) -> bytes:
    """`good` with every pool's owner array claiming 2^40 pages in its header."""
    with zipfile.ZipFile(io.BytesIO(good)) as z:
        files = {name: z.read(name) for name in z.namelist()}
    fmt = np.lib.format
    for name, body in files.items():
        if name.endswith(".owner.npy"):
            f = io.BytesIO(body)
            fmt.read_magic(f)
            _, _, dtype = fmt.read_array_header_1_0(f)
            header = io.BytesIO()
            fields = {"descr": fmt.dtype_to_descr(dtype), "fortran_order": False, "shape": (1 << 40,)}
            fmt.write_array_header_1_0(header, fields)
            files[name] = header.getvalue() + body[f.tell() :]
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, body in files.items():
            z.writestr(name, body)
    return out.getvalue()


def test_no_snapshot_thread_is_left_running() -> None:
    assert not [t for t in threading.enumerate() if t.name == "kvguard-daemon-snapshot"]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("'not a blob'", "a part: column body holds text 'not a blob', not a blob"),
        ("CAST(X'FF61' AS TEXT)", None),  # not UTF-8: read back as its bytes, which the digest refuses
    ],
)
def test_a_snapshot_part_edited_to_text_is_named_and_the_store_replayed(
    tmp_path, value: str, said: str | None
) -> None:
    # SQLite keeps any value in any column: a hand edit can leave text, even text that is not
    # UTF-8, where a snapshot's bytes belong. The daemon then replays the store; it never fails.
    where = str(tmp_path / "audit.db")
    store = Store(where)
    evs = events()
    store.append([Record.of_event(e) for e in evs])
    store.save_snapshot(snapshot.dump(ledger_of(evs)), part_bytes=1000)
    store.close()
    engine = create_engine(url_of(where))
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE snapshot_parts SET body = {value} WHERE part = 1"))
    engine.dispose()
    store = Store(where)
    found = store.latest_snapshot()
    assert isinstance(found, str)
    if said is not None:
        assert found.endswith(said), found
    fresh = Ledger()
    assert restored(store, fresh) == (fresh, 0)  # the whole store replayed instead
    store.close()


def test_text_that_is_not_utf8_in_a_record_is_named_by_audit_verify(tmp_path) -> None:
    import subprocess
    import sys

    where = str(tmp_path / "audit.db")
    store = Store(where)
    store.append([Record.of_event(e) for e in events()])
    store.close()
    engine = create_engine(url_of(where))
    with engine.begin() as conn:
        conn.execute(text("UPDATE records SET node = CAST(X'FF61' AS TEXT) WHERE id = 3"))
    engine.dispose()
    done = subprocess.run(
        [sys.executable, "-m", "kvguard", "audit", "verify", "--store", where], capture_output=True, text=True
    )
    assert "Traceback" not in done.stderr and done.returncode == 1, done.stderr
    assert (
        "NOT proven intact after 2 good records: record 3: column node holds a blob of 2 bytes, not text"
        in (done.stdout + done.stderr)
    )
