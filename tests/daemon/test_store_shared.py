"""One PostgreSQL audit store, several writers (the daemons on the bus): they take turns at the
chain's end, which stays one chain, ids without gaps, verifiable; and a writer whose last
record was removed or altered under it refuses to append after the new end, which would hide
that."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from sqlalchemy import text

from kvguard.daemon.store import Record, Store, StoreError
from kvguard.proto import pb


def events(node: str, first: int, n: int) -> list[Record]:
    return [
        Record.of_event(pb.Event(node=node, seq=s, ts_ns=s * 1000, heartbeat=pb.Heartbeat()))
        for s in range(first, first + n)
    ]


def test_writers_take_turns_on_one_chain(pg_store_url: str, tmp_path: Path) -> None:
    a = Store(pg_store_url, head_file=str(tmp_path / "head-a"))
    b = Store(pg_store_url, head_file=str(tmp_path / "head-b"))
    ids = []
    for i in range(5):  # each appends after the other's records, never over them
        ids += a.append(events("a", 3 * i + 1, 3))
        ids += b.append(events("b", 2 * i + 1, 2))
    assert ids == list(range(1, 26))
    assert a.verify() == (True, 25, "")
    assert a.completeness().proven and b.completeness().proven


def test_writers_appending_at_once_wait_their_turn(pg_store_url: str, tmp_path: Path) -> None:
    writers = [Store(pg_store_url, head_file=str(tmp_path / f"head-{i}")) for i in range(3)]
    failed: list[Exception] = []

    def write(store: Store, node: str) -> None:
        try:
            for seq in range(1, 101):
                store.append(events(node, seq, 1))
        except Exception as exc:  # a duplicate id: two writers took the same end
            failed.append(exc)

    threads = [threading.Thread(target=write, args=(w, f"n{i}")) for i, w in enumerate(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failed == []
    assert writers[0].verify() == (True, 300, "")


@pytest.mark.parametrize("how", ["removed", "altered"])
def test_a_writer_will_not_append_over_its_own_last_record_gone(
    pg_store_url: str, tmp_path: Path, how: str
) -> None:
    a = Store(pg_store_url, head_file=str(tmp_path / "head-a"))
    a.append(events("a", 1, 3))
    with a.engine.begin() as conn:  # someone with the database's password, while a runs
        if how == "removed":
            conn.execute(text("DELETE FROM records WHERE id = 3"))
        else:
            conn.execute(text("UPDATE records SET hash = :h WHERE id = 3"), {"h": bytes(32)})
    with pytest.raises(
        StoreError, match=f"record 3, which this writer appended, is {how.replace('removed', 'gone')}"
    ):
        a.append(events("a", 4, 1))
