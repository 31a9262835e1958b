"""Tampering with the audit store's tables, as someone who can write the database (and, in the
second half of each case, the chain's head file too) would: what `verify` and the head
(store/head.py) catch, sealed with an audit key and not, on SQLite and PostgreSQL. The
table in docs/audit.md is this test's expectations, in words."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text

from kvguard.cli.process import start_daemon
from kvguard.cli.send import send_capture
from kvguard.daemon.store import GENESIS, Record, Store
from kvguard.daemon.store import head as heads
from kvguard.daemon.store import store_url as url_of
from kvguard.daemon.store.chain import chain
from kvguard.proto.builder import EventLog
from kvguard.ruleset.fixtures import DEFAULT_FIXTURES_DIR

KEY = b"k" * 32
N = 30  # records in the store tampered with
INCIDENT = (DEFAULT_FIXTURES_DIR / "incident" / "capture.jsonl").read_text().splitlines()


def small_store(where: str, sealed: bool) -> None:
    log = EventLog()
    log.add("n0", "pool", pool=0, role="colocated", page_size=16, num_pages=16)
    for i in range(N - 1):
        log.add("n0", "admit", req=f"r{i}", tenant="acme", prompt_tokens=4)
    s = Store(where, KEY) if sealed else Store(where)
    if sealed:
        s.seal()
    s.append([Record.of_event(e) for e in log.events])
    s.close()


def rechain(db: object) -> None:
    """Recompute every hash, as one without the key can: plain SHA-256."""
    prev = GENESIS
    for row in db.execute(text("SELECT * FROM records ORDER BY id")).mappings().all():  # type: ignore[attr-defined]
        columns = [row[c] for c in ("kind", "node", "seq", "ts_ns", "req", "tenant", "victim_tenant")]
        digest = chain(prev, row["id"], [*columns, row["finding"], row["severity"]], row["body"], None)
        db.execute(  # type: ignore[attr-defined]
            text("UPDATE records SET prev_hash = :p, hash = :h WHERE id = :i"),
            {"p": prev, "h": digest, "i": row["id"]},
        )
        prev = digest


TAMPER = {
    "edit": ["UPDATE records SET tenant = 'globex' WHERE id = 10"],
    "delete in the middle": ["DELETE FROM records WHERE id = 10"],
    "swap two": [
        "UPDATE records SET id = -1 WHERE id = 10",
        "UPDATE records SET id = 10 WHERE id = 11",
        "UPDATE records SET id = 11 WHERE id = -1",
    ],
    "delete the last": [f"DELETE FROM records WHERE id = {N}"],
    "truncate the tail": [f"DELETE FROM records WHERE id > {N - 20}"],
    "delete all": ["DELETE FROM records"],
    "rewrite, hashes recomputed": ["UPDATE records SET tenant = 'globex' WHERE id = 10", rechain],
}
# What verify says of each, by (sealed, the head file rewritten too): "" where it cannot tell.
CHAIN_BROKEN = {
    "edit": "record 10 (event of n0) was altered",
    "delete in the middle": "record 10 is missing (next is 11)",
    "swap two": "record 10: the chain is broken before it",
}
TAIL = {
    "delete the last": f"the store ends at record {N - 1} but its head file",
    "truncate the tail": f"records {N - 19} to {N} were deleted from its end",
    "delete all": f"all {N} records were deleted",
}


def expected(case: str, sealed: bool, head_forged: bool) -> str:
    if case in CHAIN_BROKEN:
        return CHAIN_BROKEN[case]
    if case in TAIL:
        if not head_forged:
            return TAIL[case]
        return "was not sealed with the store's audit key" if sealed else ""
    # rewritten with recomputed hashes: only the key holder can make a sealed hash
    if sealed:
        return "record 1 (event of n0) was altered"
    return "" if head_forged else f"record {N} is not the one the head file"


@pytest.mark.parametrize("head_forged", [False, True], ids=["db only", "db and head"])
@pytest.mark.parametrize("sealed", [False, True], ids=["plain", "sealed"])
@pytest.mark.parametrize("case", list(TAMPER))
def test_tampering_with_the_store(store_url: str, case: str, sealed: bool, head_forged: bool) -> None:
    small_store(store_url, sealed)
    engine = create_engine(url_of(store_url))
    with engine.begin() as db:
        for step in TAMPER[case]:
            step(db) if callable(step) else db.execute(text(step))
        end = db.execute(text("SELECT id, hash FROM records ORDER BY id DESC LIMIT 1")).first()
    engine.dispose()
    s = Store(store_url, *([KEY] if sealed else []))
    if head_forged:  # what one who can write the head file but lacks the key writes there
        assert s.head_file is not None
        heads.create(s.head_file, end[0] if end else 0, end[1] if end else GENESIS, None)
    ok, _, problem = s.verify()
    if ok:
        complete = s.completeness()
        ok, problem = complete.proven, complete.said
    want = expected(case, sealed, head_forged)
    if want:
        assert not ok and want in problem
    else:  # what it cannot tell: docs/audit.md says so
        assert ok, problem


def audit(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvguard", "audit", *args], capture_output=True, text=True)


def test_records_deleted_from_the_end_are_found_and_a_lagging_head_is_told_apart(
    store_url: str, tmp_path: Path
) -> None:
    key = tmp_path / "audit.key"
    audit("new-key", str(key))
    d = start_daemon(store_url, 0, "--audit-key", str(key))
    send_capture(INCIDENT, d.address)
    d.stop()
    verify = ("verify", "--store", store_url, "--audit-key", str(key))
    ok = audit(*verify)
    head_file = Store(store_url, key.read_bytes().strip()).head_file
    assert head_file is not None and Path(head_file).exists()
    assert ok.returncode == 0, ok.stderr
    assert (
        "64 records, chain intact, sealed with the audit key from record 1 on; "
        f"complete through record 64, which the head file {head_file} names" in ok.stdout
    )
    # A crash between a commit and the head's write: the head lags, which is no tampering.
    shutil.copy(head_file, tmp_path / "old.head")
    s = Store(store_url, key.read_bytes().strip())
    s.append([Record.of_event(e) for e in _more()])
    s.close()
    shutil.copy(tmp_path / "old.head", head_file)
    lag = audit(*verify)
    assert lag.returncode == 0, lag.stderr
    assert "complete through record 64, which the head file" in lag.stdout
    assert (
        "records 65 to 67 came after its last write (a crash between their commit and the head's write?)"
        in lag.stdout
    )
    d = start_daemon(store_url, 0, "--audit-key", str(key))  # it starts, and brings the head up to date
    assert "records 65 to 67 came after its last write" in d.stop()
    assert "complete through record 67, which the head file" in audit(*verify).stdout
    # The last records deleted, then all: one line, exit 1, and the daemon will not write on.
    engine = create_engine(url_of(store_url))
    with engine.begin() as db:
        db.execute(text("DELETE FROM records WHERE id > 40"))
        db.execute(text("DELETE FROM named WHERE record_id > 40"))  # left, it would give the deletion away
    cut = audit(*verify)
    assert cut.returncode == 1 and len(cut.stderr.splitlines()) == 1
    assert (
        "NOT proven complete: the store ends at record" in cut.stderr
        and "to 67 were deleted from its end" in cut.stderr
    )
    with pytest.raises(RuntimeError, match="not proven complete: the store ends at record"):
        start_daemon(store_url, 0, "--audit-key", str(key))
    with engine.begin() as db:
        db.execute(text("DELETE FROM records"))
        db.execute(text("DELETE FROM named"))
    engine.dispose()
    gone = audit(*verify)
    assert gone.returncode == 1 and "the store ends at record 0 but its head file" in gone.stderr
    assert "all 67 records were deleted" in gone.stderr
    # The head deleted too: a sealed store always has one, so its end is not proven, and the
    # daemon will not start on it until `audit head` writes one for the store as it stands.
    Path(head_file).unlink()
    headless = audit(*verify)
    assert headless.returncode == 1 and f"no head file {head_file} for a store with a seal" in headless.stderr
    with pytest.raises(RuntimeError, match=f"no head file {head_file}"):
        start_daemon(store_url, 0, "--audit-key", str(key))
    adopted = audit("head", "--store", store_url, "--audit-key", str(key))
    assert adopted.returncode == 0 and f"its head, at record 0, written to {head_file}" in adopted.stdout
    assert audit(*verify).returncode == 0
    start_daemon(store_url, 0, "--audit-key", str(key)).stop()


def _more() -> list:
    log = EventLog()
    log.add("n9", "pool", pool=0, role="colocated", page_size=16, num_pages=16)
    log.add("n9", "admit", req="x1", tenant="acme", prompt_tokens=4, stage="prefill")
    log.add("n9", "admit", req="x2", tenant="acme", prompt_tokens=4, stage="prefill")
    return log.events
