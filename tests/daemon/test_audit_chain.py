"""The tamper-evident audit log: `kvguard audit verify` finding an altered record or request
index, and the audit key that seals the chain (new-key, seal, rotation, key files refused)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from daemon_helpers import facts, local_findings, stored_findings
from sqlalchemy import create_engine, text

from kvguard.cli.process import Service, start_daemon
from kvguard.cli.send import send_capture
from kvguard.daemon.store import Record, Store
from kvguard.daemon.store import store_url as url_of
from kvguard.proto import pb
from kvguard.proto.builder import EventLog
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR

INCIDENT = (DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl").read_text().splitlines()


def test_audit_verify_finds_an_altered_record(daemon: Service) -> None:
    send_capture(INCIDENT, daemon.address)
    daemon.stop()
    verify = [sys.executable, "-m", "kvguard", "audit", "verify", "--store", daemon.store]
    ok = subprocess.run(verify, capture_output=True, text=True)
    assert ok.returncode == 0 and "64 records, chain intact" in ok.stdout
    assert "ledger snapshot: after record 64, bound to the chain there" in ok.stdout  # saved at the stop
    engine = create_engine(Store(daemon.store).url)
    with engine.begin() as db:
        db.execute(
            text("UPDATE records SET victim_tenant = 'x' WHERE kind = 'finding' AND victim_tenant = 'acme'")
        )
    bad = subprocess.run(verify, capture_output=True, text=True)
    assert bad.returncode == 1 and "was altered" in bad.stderr
    with engine.begin() as db:
        db.execute(text("DELETE FROM records WHERE id = 3"))
    engine.dispose()
    gone = subprocess.run(verify, capture_output=True, text=True)
    assert gone.returncode == 1 and "NOT proven intact" in gone.stderr


def test_the_requests_a_record_names_are_indexed_and_the_index_verified(store_url: str) -> None:
    # A decode step's launch names its whole batch; a request's timeline must find it by any
    # entry, and a row taken out of that index (outside the chain) must not go unnoticed.
    log = EventLog()
    log.add("n0", "pool", pool=0, role="colocated", page_size=16, num_pages=16)
    reads = [{"req": r, "pool": 0, "pages": [i], "tokens": 16} for i, r in enumerate(["a", "b", "c", "b"])]
    launch = log.add("n0", "read", reads=reads)
    s = Store(store_url)
    try:
        s.append([Record.of_event(e) for e in log.events])
        assert [r[0] for r in s.rows(req="b")] == [2] and [r[0] for r in s.rows(req="c")] == [2]
        assert pb.Event.FromString(next(s.rows(req="c"))[2]) == launch
        assert s.verify() == (True, 2, "")
        engine = create_engine(url_of(store_url))
        with engine.begin() as db:
            db.execute(text("DELETE FROM named WHERE req = 'c'"))
        assert s.verify() == (False, 1, "record 2: the index of the requests it names was altered")
        assert list(s.rows(req="c")) == []  # what such a removal would hide
        with engine.begin() as db:
            db.execute(text("INSERT INTO named (record_id, req) VALUES (2, 'c'), (1, 'z')"))
        assert s.verify() == (False, 0, "record 1: the index of the requests it names was altered")
        with engine.begin() as db:
            db.execute(text("DELETE FROM named WHERE req = 'z'"))
            db.execute(text("INSERT INTO named (record_id, req) VALUES (9, 'z')"))
        assert s.verify() == (False, 2, "the index of named requests lists record 9, past the last record")
        engine.dispose()
    finally:
        s.close()


def audit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvguard", "audit", *args], capture_output=True, text=True)


def rechain(where: str, key: bytes | None) -> None:
    """What someone who can write the database does to hide an edit: recompute every hash."""
    from kvguard.daemon.store.chain import GENESIS, chain

    engine = create_engine(url_of(where))
    with engine.begin() as db:
        prev = GENESIS
        for row in db.execute(text("SELECT * FROM records ORDER BY id")).mappings().all():
            columns = [row[c] for c in ("kind", "node", "seq", "ts_ns", "req", "tenant")]
            columns += [row[c] for c in ("victim_tenant", "finding", "severity")]
            digest = chain(prev, row["id"], columns, row["body"], key)
            db.execute(
                text("UPDATE records SET prev_hash = :p, hash = :h WHERE id = :i"),
                {"p": prev, "h": digest, "i": row["id"]},
            )
            prev = digest
    engine.dispose()


def test_a_sealed_chain_cannot_be_rewritten_without_its_key(store_url: str, tmp_path: Path) -> None:
    key, other = tmp_path / "audit.key", tmp_path / "other.key"
    made = audit("new-key", str(key))
    assert made.returncode == 0 and (key.stat().st_mode & 0o777) == 0o600
    assert audit("new-key", str(key)).returncode == 1  # never over an existing key
    audit("new-key", str(other))
    d = start_daemon(store_url, 0, "--audit-key", str(key))
    send_capture(INCIDENT, d.address)
    d.stop()
    store = ["--store", store_url]
    ok = audit("verify", *store, "--audit-key", str(key))
    assert ok.returncode == 0, ok.stderr
    assert "64 records, chain intact, sealed with the audit key from record 1 on" in ok.stdout
    assert "ledger snapshot: after record 64, bound to the chain there" in ok.stdout
    unkeyed = audit("verify", *store)
    assert (
        unkeyed.returncode == 1
        and "records from 1 on are sealed with an audit key not given" in unkeyed.stderr
    )
    wrong = audit("verify", *store, "--audit-key", str(other))
    assert wrong.returncode == 1 and "an audit key given is not one its chain is sealed with" in wrong.stderr
    # Without the key a sealed store takes no records: the daemon does not start.
    with pytest.raises(
        RuntimeError,
        match=r"sealed \(the current seal from record 1 on\); writing to it needs that audit key",
    ):
        start_daemon(store_url)
    # A rewrite by someone who can write the database: a victim's tenant changed, the chain
    # recomputed. Caught with the key, whether the seal is left in place or removed too.
    engine = create_engine(url_of(store_url))
    with engine.begin() as db:
        db.execute(text("UPDATE records SET victim_tenant = 'x' WHERE victim_tenant = 'acme'"))
    rechain(store_url, None)
    caught = audit("verify", *store, "--audit-key", str(key))
    assert caught.returncode == 1 and "record 1 (event of p0) was altered" in caught.stderr
    with engine.begin() as db:
        db.execute(text("DELETE FROM seal"))
    engine.dispose()
    # What a plain chain cannot tell, its head (sealed with the key) does.
    headless = audit("verify", *store)
    assert headless.returncode == 1 and "sealed with a key whose seal was removed" in headless.stderr
    with pytest.raises(RuntimeError, match="is not sealed but has records: seal it once"):
        start_daemon(store_url, 0, "--audit-key", str(key))  # no new seal over a rewrite
    unsealed = audit("verify", *store, "--audit-key", str(key))
    assert (
        unsealed.returncode == 1
        and "the chain is not sealed (never sealed, or the seal was removed)" in unsealed.stderr
    )


def test_a_store_sealed_later_is_proven_plain_before_the_seal_and_keyed_after(
    tmp_path: Path,
) -> None:
    where, key = str(tmp_path / "audit.db"), tmp_path / "audit.key"
    audit("new-key", str(key))
    d = start_daemon(where)
    send_capture(INCIDENT[:20], d.address)
    d.stop()
    first = Store(where).count()
    with pytest.raises(
        RuntimeError, match="is not sealed but has records: seal it once with `kvguard audit seal`"
    ):
        start_daemon(where, 0, "--audit-key", str(key))
    sealed = audit("seal", "--store", where, "--audit-key", str(key))
    assert sealed.returncode == 0 and f"sealed with the audit key from record {first + 1} on" in sealed.stdout
    again = audit("seal", "--store", where, "--audit-key", str(key))
    assert (
        again.returncode == 1
        and f"sealed already (the current seal from record {first + 1} on)" in again.stderr
    )
    d = start_daemon(where, 0, "--audit-key", str(key))
    send_capture(INCIDENT, d.address)  # the first 20 lines are repeats: refused, not stored
    d.stop()
    ok = audit("verify", "--store", where, "--audit-key", str(key))
    assert ok.returncode == 0, ok.stderr
    assert f"sealed with the audit key from record {first + 1} on" in ok.stdout
    assert Store(where).count() > first + 10
    assert facts(stored_findings(where)) == facts(local_findings())


def test_the_audit_key_rotates_and_each_key_proves_what_it_sealed(
    tmp_path: Path,
) -> None:
    where, k1, k2 = str(tmp_path / "audit.db"), tmp_path / "k1", tmp_path / "k2"
    audit("new-key", str(k1))
    audit("new-key", str(k2))
    d = start_daemon(where, 0, "--audit-key", str(k1))
    send_capture(INCIDENT[:20], d.address)
    d.stop()
    first = Store(where).count()
    store = ["--store", where]
    refused = audit("seal", *store, "--audit-key", str(k2))
    assert (
        refused.returncode == 1
        and "to rotate its key, give the current one as --current-key" in refused.stderr
    )
    impostor = audit("seal", *store, "--audit-key", str(k1), "--current-key", str(k2))
    assert impostor.returncode == 1 and "not one its chain is sealed with" in impostor.stderr
    rotated = audit("seal", *store, "--audit-key", str(k2), "--current-key", str(k1))
    assert rotated.returncode == 0 and f"from record {first + 1} on (key rotated)" in rotated.stdout
    with pytest.raises(RuntimeError, match=f"the current seal from record {first + 1} on"):
        start_daemon(where, 0, "--audit-key", str(k1))  # the old key writes no more
    d = start_daemon(where, 0, "--audit-key", str(k2))
    send_capture(INCIDENT, d.address)
    d.stop()
    both = audit("verify", *store, "--audit-key", str(k1), "--audit-key", str(k2))
    assert both.returncode == 0, both.stderr
    assert f"sealed with the audit key from record 1 on (key rotated at record {first + 1})" in both.stdout
    assert "bound to the chain there" in both.stdout  # the snapshot, under the current key
    old_only = audit("verify", *store, "--audit-key", str(k1))
    assert (
        old_only.returncode == 1
        and f"records from {first + 1} on are sealed with an audit key not given" in old_only.stderr
    )
    new_only = audit("verify", *store, "--audit-key", str(k2))
    assert (
        new_only.returncode == 1
        and "records from 1 on are sealed with an audit key not given" in new_only.stderr
    )
    assert facts(stored_findings(where)) == facts(local_findings())


def test_an_audit_key_others_may_read_or_too_short_is_refused(tmp_path: Path) -> None:
    where, key = str(tmp_path / "audit.db"), tmp_path / "audit.key"
    key.write_text("k" * 64)
    key.chmod(0o640)
    with pytest.raises(RuntimeError, match=r"others may read or write it \(mode 640\); chmod 600 it"):
        start_daemon(where, 0, "--audit-key", str(key))
    key.chmod(0o600)
    key.write_text("short\n")
    with pytest.raises(RuntimeError, match="5 bytes, at least 32 needed"):
        start_daemon(where, 0, "--audit-key", str(key))
    missing = audit("verify", "--store", where, "--audit-key", str(tmp_path / "nope"))
    assert missing.returncode == 1 and "No such file or directory" in missing.stderr


def small_store(where: str, n: int = 30, *keys: bytes) -> Store:
    """A store of `n` events of one node, each a record of its own (no run)."""
    log = EventLog()
    log.add("n0", "pool", pool=0, role="colocated", page_size=16, num_pages=16)
    for i in range(n - 1):
        log.add("n0", "admit", req=f"r{i}", tenant="acme", prompt_tokens=4)
    s = Store(where, *keys)
    if keys:
        s.seal()
    s.append([Record.of_event(e) for e in log.events])
    return s


@pytest.mark.parametrize(
    ("column", "value", "last"),
    [("seq", "'abc'", False), ("ts_ns", "'12:00'", False), ("hash", "'x'", False), ("body", "'zz'", True)],
)
def test_a_row_edited_to_text_is_named_by_verify_and_the_daemon(
    tmp_path: Path, column: str, value: str, last: bool
) -> None:
    # SQLite keeps any value in any column: an integer or blob column rewritten as text must
    # be refused by row and column, in one line, by verify and by the daemon that reads it.
    where = str(tmp_path / "audit.db")
    small_store(where, 5).close()
    engine = create_engine(url_of(where))
    with engine.begin() as db:
        db.execute(text(f"UPDATE records SET {column} = {value} WHERE id = {5 if last else 3}"))
    engine.dispose()
    said = f"record {5 if last else 3}: column {column} holds text {value}, not "
    verify = audit("verify", "--store", where)
    assert verify.returncode == 1 and said in verify.stderr and "Traceback" not in verify.stderr
    assert len(verify.stderr.splitlines()) == 1
    query = audit("query", "--store", where)
    if column in ("ts_ns", "body"):  # what a query reads
        assert query.returncode == 2 and said in query.stderr and "Traceback" not in query.stderr
    if last:  # the daemon reads the last record's body at its start
        with pytest.raises(
            RuntimeError, match=f"audit store {where}: {said}a blob; see `kvguard audit verify`"
        ):
            start_daemon(where)
