"""Runs: the consecutive events of a batch stored as one record. Every read must see exactly
what it saw when each event was a record of its own: the same ids, bodies and matches for
every filter, the same replay, counts and chain length; and a run must be as tamper-evident
as the records it replaces."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import OperationalError

from kvguard.daemon import _rows
from kvguard.daemon.store import (
    RUN_MAX,
    RUN_SPAN_NS,
    EventRun,
    Record,
    Store,
    StoreError,
    migrations,
    rows_of,
)
from kvguard.daemon.store import rows as store_rows
from kvguard.daemon.store import store as store_module
from kvguard.daemon.store import store_url as url_of
from kvguard.proto import pb, wire
from kvguard.proto.builder import EventLog
from kvguard.proto.kvguard.v1 import services_pb2 as svc

TENANTS = ["acme", "globex", "initech"]


def workload(seed: int) -> tuple[list[wire.Batch], list[list[Record | EventRun]], list[list[Record]]]:
    """Groups as the daemon submits them (batches as received, runs of accepted events with
    findings between them) and the same records one event a record (how they were stored
    before runs). Times mostly step 1 µs, now and then jump past a run's span or go back."""
    rng = random.Random(seed)
    now = [10**15]

    def clock() -> int:
        roll = rng.random()
        now[0] += 3 * RUN_SPAN_NS // 2 if roll < 0.03 else -5_000 if roll < 0.06 else 1_000
        return now[0]

    log = EventLog(clock=clock)
    messages: list[wire.Batch] = []
    groups: list[list[Record | EventRun]] = []
    flat: list[list[Record]] = []
    req = 0
    for _ in range(12):
        parts: list[Record | EventRun] = []
        rows: list[Record] = []
        for _ in range(rng.randint(1, 3)):  # batches in the group
            node = rng.choice(["n0", "n1"])
            events: list[pb.Event] = []
            for _ in range(rng.randint(1, 40)):
                req += 1
                name = f"{node}-r{rng.randint(max(1, req - 8), req)}"
                kind = rng.choice(["admit", "alloc", "write", "read", "free", "step"])
                if kind == "step":  # a batch's forward pass: not indexed, found in its requests' spans
                    reqs = sorted(
                        {f"{node}-r{rng.randint(max(1, req - 12), req)}" for _ in range(rng.randint(1, 5))}
                    )
                    events.append(
                        log.add(node, kind, pool=0, reqs=reqs, counts=[1] * len(reqs), pages=[4] * len(reqs))
                    )
                elif kind == "admit":
                    events.append(log.add(node, kind, req=name, tenant=rng.choice(TENANTS)))
                elif kind == "read":
                    entries = [
                        {"req": rng.choice([name, f"{node}-r{rng.randint(1, req)}"]), "pool": 0, "pages": [2]}
                        for _ in range(rng.randint(1, 3))
                    ]
                    events.append(log.add(node, kind, reads=entries))
                else:
                    events.append(log.add(node, kind, req=name, pool=0, pages=[3]))
            messages.append(
                wire.decode_batch(svc.AgentMessage(batch=svc.EventBatch(events=events)).SerializeToString())
            )
            position = len(messages) - 1
            start = 0
            while start < len(events):  # accepted runs, a finding after some of them
                stop = min(len(events), start + rng.randint(1, 25))
                parts.append(EventRun(position, start, stop))
                rows += [Record.of_event(e) for e in events[start:stop]]
                if rng.random() < 0.4:
                    last = events[stop - 1]
                    victim = rng.choice(TENANTS)
                    finding = pb.Finding(finding="stale_read", node=node, seq=last.seq, ts_ns=last.ts_ns)
                    record = Record(
                        "finding",
                        node,
                        last.seq,
                        last.ts_ns,
                        finding.SerializeToString(),
                        f"{node}-r{req}",
                        rng.choice(TENANTS),
                        victim,
                        "stale_read",
                        "critical",
                    )
                    parts.append(record)
                    rows.append(record)
                start = stop
        groups.append(parts)
        flat.append(rows)
    return messages, groups, flat


def stores(tmp_path: Path, store_url: str, seed: int) -> tuple[Store, Store]:
    """The workload in runs (store_url) and one event a record (a SQLite file beside it)."""
    messages, groups, flat = workload(seed)
    runs, plain = Store(store_url), Store(str(tmp_path / "plain.db"))
    for parts, rows in zip(groups, flat, strict=True):
        assert runs.append(rows_of(messages, parts))[0] == plain.append(rows)[0]
    return runs, plain


def test_runs_read_back_exactly_as_one_record_an_event(store_url: str, tmp_path: Path) -> None:
    runs, plain = stores(tmp_path, store_url, seed=7)
    try:
        total = plain.count()
        engine = create_engine(url_of(store_url))
        with engine.connect() as db:
            physical = db.execute(text("SELECT count(*) FROM records")).scalar_one()
            kinds = {k for (k,) in db.execute(text("SELECT DISTINCT kind FROM records"))}
        engine.dispose()
        assert "events" in kinds and physical < total / 2  # the point of runs
        assert runs.verify() == plain.verify() == (True, total, "")
        for kind in (None, "event", "finding", "command"):
            assert runs.count(kind) == plain.count(kind)
        for after in (0, 1, 5, total // 3, total - 1, total):
            assert list(runs.events(after)) == list(plain.events(after))
            expected = [(e.node, e) for e in plain.events(after)]
            for store in (runs, plain):  # the bytes the daemon rebuilds from, each event's node with it
                found = store.event_batches(after)
                assert [
                    (node, pb.Event.FromString(batch.event(i)))
                    for node, batch, skip in found
                    for i in range(skip, len(batch))
                ] == expected
        rng = random.Random(3)
        times = sorted(e.ts_ns for e in plain.events())
        for _ in range(300):
            since = rng.choice(times) + rng.choice([-1, 0, 1])  # mostly inside some run's span
            filters = rng.choice(
                [
                    {"kind": "event"},
                    {"kind": "finding"},
                    {"req": f"n{rng.randint(0, 1)}-r{rng.randint(1, 400)}"},
                    {"tenant": rng.choice(TENANTS)},
                    {"node": rng.choice(["n0", "n1"])},
                    {"since_ns": since},
                    {"until_ns": since},
                    {"since_ns": since, "until_ns": rng.choice(times)},
                    {"after": rng.randint(0, total)},
                    {"kind": "event", "tenant": rng.choice(TENANTS), "after": rng.randint(0, total)},
                    {"req": f"n0-r{rng.randint(1, 400)}", "limit": rng.randint(1, 3)},
                    {"limit": rng.randint(1, total)},
                ]
            )
            assert list(runs.rows(**filters)) == list(plain.rows(**filters)), filters
    finally:
        runs.close()
        plain.close()


def first_run(store_url: str) -> tuple[int, bytes, list[str]]:
    """The first run record: its id, its body and the requests indexed for it."""
    engine = create_engine(url_of(store_url))
    with engine.connect() as db:
        run_id, body = db.execute(
            text("SELECT id, body FROM records WHERE kind = 'events' ORDER BY id LIMIT 1")
        ).one()
        named = db.execute(text("SELECT req FROM named WHERE record_id = :i"), {"i": run_id}).scalars().all()
    engine.dispose()
    return run_id, bytes(body), list(named)


def named_rows(store_url: str) -> list[tuple[str, int]]:
    engine = create_engine(url_of(store_url))
    with engine.connect() as db:
        rows = db.execute(text("SELECT req, record_id FROM named ORDER BY req, record_id")).all()
    engine.dispose()
    return [(str(req), int(record_id)) for req, record_id in rows]


def test_the_named_index_keeps_its_rows_across_migration_0007(store_url: str, tmp_path: Path) -> None:
    """0007 keeps the index as one B-tree by request (its primary key; WITHOUT ROWID in
    SQLite): taken back to 0006 and forward again, it lists the same rows, and every query
    by request reads the same records."""
    runs, plain = stores(tmp_path, store_url, seed=13)
    plain.close()
    rows = named_rows(store_url)
    assert len(rows) > 50
    answers = {req: list(runs.rows(req=req)) for req in sorted({req for req, _ in rows})}
    total = runs.count()
    runs.close()
    engine = create_engine(url_of(store_url))
    with engine.begin() as conn:
        command.downgrade(migrations(conn), "0006")
    assert {i["name"] for i in inspect(engine).get_indexes("named")} == {"named_req"}
    assert not inspect(engine).get_pk_constraint("named")["constrained_columns"]
    engine.dispose()
    assert named_rows(store_url) == rows
    upgraded = Store(store_url)
    try:
        engine = create_engine(url_of(store_url))
        assert inspect(engine).get_pk_constraint("named")["constrained_columns"] == ["req", "record_id"]
        if "://" not in store_url:  # SQLite: a path
            with engine.connect() as db, pytest.raises(OperationalError, match="rowid"):
                db.execute(text("SELECT rowid FROM named"))
        engine.dispose()
        assert named_rows(store_url) == rows
        assert {req: list(upgraded.rows(req=req)) for req in answers} == answers
        assert upgraded.verify() == (True, total, "")
    finally:
        upgraded.close()


@pytest.mark.parametrize("edit", ["an event in its body", "a request it names", "the whole run"])
def test_a_run_is_as_tamper_evident_as_its_events(store_url: str, tmp_path: Path, edit: str) -> None:
    runs, plain = stores(tmp_path, store_url, seed=11)
    plain.close()
    run_id, body, named = first_run(store_url)
    assert named
    events = list(svc.RawEventBatch.FromString(body).events)
    altered = pb.Event.FromString(events[-1])
    altered.ts_ns += 1  # one nanosecond of one event
    events[-1] = altered.SerializeToString()
    statement, params, why = {
        "an event in its body": (
            "UPDATE records SET body = :b WHERE id = :i",
            {"b": svc.RawEventBatch(events=events).SerializeToString()},
            f"record {run_id} (events of",
        ),
        "a request it names": (
            "DELETE FROM named WHERE record_id = :i AND req = :r",
            {"r": named[-1]},
            f"record {run_id}: the index of the requests it names was altered",
        ),
        "the whole run": ("DELETE FROM records WHERE id = :i", {}, f"record {run_id} is missing"),
    }[edit]
    runs.close()
    engine = create_engine(url_of(store_url))
    with engine.begin() as db:
        db.execute(text(statement), {"i": run_id, **params})
    engine.dispose()
    edited = Store(store_url)
    try:
        ok, _, message = edited.verify()
        assert not ok and why in message, message
    finally:
        edited.close()


def test_a_snapshot_is_taken_only_where_a_record_ends(store_url: str, tmp_path: Path) -> None:
    runs, plain = stores(tmp_path, store_url, seed=5)
    plain.close()
    engine = create_engine(url_of(store_url))
    with engine.connect() as db:
        run_id, body = db.execute(
            text("SELECT id, body FROM records WHERE kind = 'events' ORDER BY id LIMIT 1")
        ).one()
    engine.dispose()
    end = run_id + len(svc.RawEventBatch.FromString(body).events) - 1
    try:
        assert runs.save_snapshot(b"state", end) == end
        assert runs.latest_snapshot() == (end, b"state")
        with pytest.raises(StoreError, match=f"no record ends at id {end - 1}"):
            runs.save_snapshot(b"state", end - 1)
    finally:
        runs.close()


def common_events(rng: random.Random, n: int) -> list[pb.Event]:
    """n events of the shapes the store splits in C (alloc, write, free, a one-entry read, step),
    requests repeating and some named in UTF-8 beyond ASCII; times mostly step 1 µs, now and
    then jump past a run's span, to its very edge, or back."""
    now = [10**15]

    def clock() -> int:
        roll = rng.random()
        step = (
            3 * RUN_SPAN_NS // 2
            if roll < 0.04
            else RUN_SPAN_NS
            if roll < 0.06
            else -5_000
            if roll < 0.1
            else 1_000
        )
        now[0] += step
        return now[0]

    log = EventLog(clock=clock)
    names = [f"n0-r{i}" for i in range(6)] + ["n0-ré", "n0-請求"]
    for _ in range(n):
        req = rng.choice(names)
        kind = rng.choice(["alloc", "write", "read", "free", "step"])
        if kind == "step":  # its requests are not indexed: the rows name none of them
            reqs = rng.sample(names, rng.randint(1, 4))
            log.add("n0", kind, pool=0, reqs=reqs, counts=[1] * len(reqs), pages=[5] * len(reqs), slots=[])
        elif kind == "read":
            log.add("n0", kind, reads=[{"req": req, "pool": 0, "pages": [2, 3], "tokens": 16}])
        else:
            log.add("n0", kind, req=req, pool=0, pages=[3])
    return log.lines


def test_common_events_split_in_c_into_the_rows_read_event_by_event(monkeypatch: pytest.MonkeyPatch) -> None:
    # The writer splits a run of accepted events into rows in C when every event is of the
    # common shapes; the rows are exactly those read event by event from each head (and
    # any other shape among them sends the whole run that way).
    rng = random.Random(11)
    for run_max in (RUN_MAX, 5):
        monkeypatch.setattr(store_rows, "RUN_MAX", run_max)
        for n in [1, 2, 3, *(rng.randint(1, 80) for _ in range(150))]:
            bodies = [e.SerializeToString() for e in common_events(rng, n)]
            batch = wire.batch_of(bodies)
            split = _rows.split_runs(batch.data, batch.heads, 0, n, RUN_SPAN_NS, run_max)
            assert split is not None and split[-1][1] == n
            assert store_rows.run_rows(batch, 0, n) == store_rows._parsed_run_rows(bodies)
            # A part of the batch, and the same events where they do not lie back to back.
            assert store_rows.run_rows(batch, n // 3, n) == store_rows._parsed_run_rows(bodies[n // 3 :])
            apart = wire.Batch(batch.data, batch.heads[::-1].copy()[::-1].copy())
            apart.heads["batched"] = 0  # heads of single events: their bodies are framed anew
            assert store_rows.run_rows(apart, 0, n) == store_rows._parsed_run_rows(bodies)
            other = EventLog().add("n0", "admit", req="n0-r1", tenant="acme").SerializeToString()
            mixed = wire.batch_of([*bodies[: n // 2], other, *bodies[n // 2 :]])
            assert _rows.split_runs(mixed.data, mixed.heads, 0, n + 1, RUN_SPAN_NS, run_max) is None
            assert store_rows.run_rows(mixed, 0, n + 1) == store_rows._parsed_run_rows(mixed.events())
    empty = wire.batch_of([])
    assert _rows.split_runs(empty.data, empty.heads, 0, 0, RUN_SPAN_NS, RUN_MAX) == []
    with pytest.raises(TypeError, match="bytes expected"):
        _rows.split_runs("not bytes", empty.heads, 0, 0, RUN_SPAN_NS, RUN_MAX)
    with pytest.raises(ValueError, match="run_max 0"):
        _rows.split_runs(empty.data, empty.heads, 0, 0, RUN_SPAN_NS, 0)


def wal_restarts(wal: Path) -> int:
    """The WAL header's checkpoint sequence number: SQLite adds one each time it starts the
    WAL over."""
    with wal.open("rb") as f:
        return int.from_bytes(f.read(16)[12:16], "big")


def test_the_wal_starts_over_under_a_steady_stream_of_commits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The checkpoint thread copies pages while commits go on, but SQLite starts the WAL over
    only at a commit that finds every frame copied: without the writer's restart_wal() between
    commits the WAL held every frame ever committed. With it, the WAL stays the size of the
    commits between two restarts, and nothing committed is lost."""
    monkeypatch.setattr(store_module, "WAL_RESTART_S", 0.0)  # due at every call
    where = tmp_path / "audit.db"
    s = Store(str(where))
    wal = Path(f"{where}-wal")
    log = EventLog()
    pages = list(range(1 << 20, (1 << 20) + 16384))  # ~48 KB an event: a dozen WAL pages a commit
    commits, restarted = 300, 0
    try:
        for i in range(commits):
            s.append([Record.of_event(log.add("n0", "alloc", req=f"r{i}", pool=0, pages=pages))])
            restarted += s.restart_wal()
            assert wal.stat().st_size < 8 << 20, f"the WAL grew to {wal.stat().st_size} bytes at commit {i}"
        assert restarted == commits
        assert wal_restarts(wal) >= commits // 2  # a restart_wal() may meet the thread's checkpoint
        assert s.count("event") == commits and s.verify() == (True, commits, "")
    finally:
        s.close()
