"""Per-request integrity receipts (issue 44), for real: a daemon with an Ed25519 receipt key
signs each request's receipt as it ends; `kvguard audit receipt` hands it out, and
`verify-receipt` checks it offline with only the public key. Tampered, foreign-key and
other-tenant receipts are refused with their reason; a finding heard after a clean receipt
supersedes it and the exposure report lists it; a daemon SIGKILLed mid-stream leaves every
finished request exactly one current receipt."""

from __future__ import annotations

import contextlib
import io
import shutil
from collections import Counter
from pathlib import Path

import pytest
from agent_helpers import wait_for as eventually
from daemon_helpers import ingest, wait_for

from kvguard.agents.upstream import AgentStream
from kvguard.cli.audit import main as audit
from kvguard.cli.process import start_daemon
from kvguard.daemon.daemon import Daemon
from kvguard.daemon.store import Store
from kvguard.proto import pb, receipt
from kvguard.proto.builder import EventLog
from kvguard.proto.channel import channel
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.testbed.fleet import fleet


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    private, public = tmp_path / "receipt.key", tmp_path / "receipt.pub"
    receipt.new_key(private, public)
    return private, public


def run(*argv: str) -> tuple[int, str]:
    """A `kvguard audit` command, as its user runs it: (exit status, what it printed)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = audit(list(argv))
    return code, out.getvalue()


def request(log: EventLog, req: str, tenant: str, page: int, *, written: bool) -> None:
    """A request on n1 that takes `page`, reads page 0, finishes and frees its page."""
    log.add("n1", "admit", req=req, tenant=tenant, prompt_tokens=16, stage="prefill")
    log.add("n1", "alloc", req=req, pool=0, pages=[page])
    if written:
        log.add("n1", "write", req=req, pool=0, pages=[page])
    log.add("n1", "read", reads=[{"req": req, "pool": 0, "pages": [0], "tokens": 16}])
    log.add("n1", "finish", req=req)
    log.add("n1", "free", req=req, pool=0, pages=[page])


def receipts(store: Store) -> list[tuple[int, svc.Receipt]]:
    return [
        (rid, svc.Receipt.FromString(svc.SignedReceipt.FromString(body).receipt))
        for rid, _, body in store.rows(kind="receipt")
    ]


def test_a_receipt_verifies_offline_and_a_later_finding_supersedes_it(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    db = str(tmp_path / "audit.db")
    store = Store(db)
    daemon = Daemon(store, snapshot_every=0, receipt_key=receipt.load_private(private), name="kvg-1")
    log = EventLog()
    log.add("n1", "pool", pool=0, role="colocated", page_size=16, num_pages=64)
    request(log, "chat-1", "acme", 0, written=True)
    try:
        ingest(daemon, "n1", log.lines, lambda m: None)
        wait_for(lambda: daemon.counters["receipts"] == 1)
        code, said = run("receipt", "chat-1", "--store", db)
        assert code == 0, said
        assert "receipt of request chat-1 (tenant acme): CLEAN, current" in said
        assert "attended 1 pages over 16 tokens; its pages' KV: 1 own" in said
        code, file_form = run("receipt", "chat-1", "--store", db, "-o", "json")
        clean = tmp_path / "chat-1.json"
        clean.write_text(file_form)
        code, said = run(
            "verify-receipt", str(clean), "--key", str(public), "--tenant", "acme", "--req", "chat-1"
        )
        assert code == 0, said
        assert "VALID: receipt of request chat-1 of tenant acme: CLEAN" in said
        assert "no finding named the request when it was signed" in said
        assert "that no later receipt supersedes it" in said  # what it does not prove, said

        # globex's request reads chat-1's freed page: chat-1 is a victim after its receipt.
        first = len(log.lines)
        request(log, "chat-2", "globex", 1, written=True)
        ingest(daemon, "n1", log.lines[first:], lambda m: None)
        wait_for(lambda: daemon.counters["receipts"] == 3)
    finally:
        daemon.close()
    (first_id, first), (third_id, third) = [(i, r) for i, r in receipts(store) if r.req == "chat-1"]
    [(_, second)] = [(i, r) for i, r in receipts(store) if r.req == "chat-2"]
    assert first.verdict == "clean"
    assert third.supersedes == first_id and third.verdict == "findings"
    assert [(f.finding, f.role) for f in third.findings] == [("foreign_read", "victim")]
    assert [(f.finding, f.role) for f in second.findings] == [("foreign_read", "offender")]
    code, said = run("receipt", "chat-1", "--store", db, "--all")
    assert code == 1 and f"CLEAN, SUPERSEDED by record {third_id}" in said and "FINDINGS, current" in said
    code, said = run("exposure", "--tenant", "acme", "--store", db)
    assert code == 1
    assert f"chat-1: receipt {first_id} (clean) superseded by receipt {third_id} (foreign_read)" in said
    # The old clean one still verifies as signed: offline, nothing can say it was superseded.
    assert run("verify-receipt", str(clean), "--key", str(public))[0] == 0
    code, listed = run("receipts", "--tenant", "acme", "--store", db)
    assert code == 0 and listed.split()[-4:] == ["findings", "chat-1", "(1", "superseded)"], listed
    store.close()


def test_an_altered_a_foreign_and_another_tenants_receipt_are_refused_with_the_reason(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    private, public = keys
    db = str(tmp_path / "audit.db")
    store = Store(db)
    daemon = Daemon(store, snapshot_every=0, receipt_key=receipt.load_private(private))
    log = EventLog()
    log.add("n1", "pool", pool=0, role="colocated", page_size=16, num_pages=64)
    request(log, "chat-1", "acme", 0, written=True)
    try:
        ingest(daemon, "n1", log.lines, lambda m: None)
        wait_for(lambda: daemon.counters["receipts"] == 1)
    finally:
        daemon.close()
    store.close()
    issued = run("receipt", "chat-1", "--store", db, "-o", "json")[1].encode()
    good = tmp_path / "good.json"
    good.write_bytes(issued)
    assert run("verify-receipt", str(good), "--key", str(public))[0] == 0
    # Any one byte changed, anywhere in the file: refused, and why.
    altered = tmp_path / "altered.json"
    for at in range(0, len(issued), max(1, len(issued) // 40)):
        changed = bytearray(issued)
        changed[at] = ord("x") if changed[at] != ord("x") else ord("y")
        altered.write_bytes(bytes(changed))
        code, said = run("verify-receipt", str(altered), "--key", str(public))
        assert code == 1 and said.startswith("REFUSED: "), (at, said)
    # Signed by another key: the receipt names its key, which is not this one.
    other_private, other_public = tmp_path / "other.key", tmp_path / "other.pub"
    receipt.new_key(other_private, other_public)
    code, said = run("verify-receipt", str(good), "--key", str(other_public))
    assert code == 1 and "signed by key" in said and "not by this key" in said
    forged = receipt.sign(
        svc.Receipt.FromString(receipt.from_file(good).receipt), receipt.load_private(other_private)
    )
    forged_file = tmp_path / "forged.json"
    forged_file.write_bytes(receipt.to_file(forged))
    code, said = run("verify-receipt", str(forged_file), "--key", str(public))
    assert code == 1 and "not by this key" in said
    # acme's receipt, presented by globex as its own.
    code, said = run("verify-receipt", str(good), "--key", str(public), "--tenant", "globex")
    assert code == 1 and "the receipt is of tenant 'acme''s request, not of 'globex'" in said
    code, said = run("verify-receipt", str(good), "--key", str(public), "--req", "chat-9")
    assert code == 1 and "the receipt is of request 'chat-1', not of 'chat-9'" in said
    # Unusable input is not a verdict: exit 2.
    assert run("verify-receipt", str(good), "--key", str(tmp_path / "none.pub"))[0] == 2
    assert run("receipt", "chat-9", "--store", db)[0] == 2


def test_a_transfer_heard_after_its_request_finished_supersedes_its_receipt(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """A prefill/decode pair: the decode side finishes a request before the prefill side's
    report of the short transfer arrives; the receipt says `transfer_count` (no checksum to
    compare yet), and the transfer's verdict, once heard, supersedes it."""
    f = fleet(1, decodes=1, ticks=8, length=3, fault_every=2)
    planted = f.planted[0]
    batches = list(f.batches)
    at = next(
        i
        for i, (_, ev) in enumerate(batches)
        if any(e.HasField("xfer_send") and e.xfer_send.req == planted for e in ev)
    )
    late = batches.pop(at)
    store = Store(str(tmp_path / "audit.db"))
    daemon = Daemon(store, snapshot_every=0, receipt_key=receipt.load_private(keys[0]))
    try:
        for node, events in batches:
            ingest(daemon, node, events, lambda m: None)
        wait_for(lambda: any(r.req == planted for _, r in receipts(store)))
        ingest(daemon, *late, lambda m: None)
        wait_for(lambda: daemon.counters["receipts_superseded"] == 1)
    finally:
        daemon.close()
    mine = [(rid, r) for rid, r in receipts(store) if r.req == planted]
    (first_id, first), (_, current) = mine
    # One page came (its checksum not yet compared), three held whatever was there before.
    assert [(s.kind, s.pages) for s in first.sources] == [("transfer_count", 1), ("unwritten", 3)]
    assert current.supersedes == first_id
    assert (
        Counter(x.finding for x in current.findings)["transfer_mismatch"]
        > Counter(x.finding for x in first.findings)["transfer_mismatch"]
    )
    clean = [r for _, r in receipts(store) if r.verdict == "clean"]
    assert clean and all(("transfer_checksum", 4) in [(s.kind, s.pages) for s in r.sources] for r in clean)
    store.close()


def test_ends_left_unsigned_by_a_stop_are_signed_at_the_next_start(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    store = Store(str(tmp_path / "audit.db"))
    key = receipt.load_private(keys[0])
    log = EventLog()
    log.add("n1", "pool", pool=0, role="colocated", page_size=16, num_pages=64)
    for i in range(5):
        request(log, f"chat-{i}", "acme", i, written=True)
    daemon = Daemon(store, snapshot_every=0, receipt_key=key)
    assert daemon.receipts is not None
    daemon.receipts.close()  # its signer gone: the ends below stay unsigned, as at a crash
    ingest(daemon, "n1", log.lines, lambda m: None)
    wait_for(lambda: daemon.counters["events"] == len(log.lines))
    daemon.close()
    assert receipts(store) == []
    again = Daemon(store, snapshot_every=0, receipt_key=key)
    try:
        wait_for(lambda: again.counters["receipts"] == 5)
        assert again.counters["receipts_recovered_ends"] == 5
    finally:
        again.close()
    assert sorted(r.req for _, r in receipts(store)) == [f"chat-{i}" for i in range(5)]
    third = Daemon(store, snapshot_every=0, receipt_key=key)  # nothing left to sign: nothing signed twice
    third.close()
    assert len(receipts(store)) == 5 and third.counters["receipts_known"] == 0
    store.close()


def test_through_a_sigkill_mid_stream_every_finished_request_has_one_current_receipt(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    f = fleet(4, decodes=1, ticks=30, length=3, fault_every=5)
    db = str(tmp_path / "audit.db")
    args = ("--receipt-key", str(keys[0]), "--snapshot-every", "0")
    daemon = start_daemon(db, 0, *args, quiet=True)
    streams: dict[str, AgentStream] = {}
    try:
        for i, (node, events) in enumerate(f.batches):
            if i == len(f.batches) // 2:
                daemon.kill()  # SIGKILL: ends applied, their receipts not all signed
                for s in streams.values():
                    with contextlib.suppress(Exception):
                        s.close()
                streams.clear()
                daemon = start_daemon(db, 0, *args, quiet=True)
            if node not in streams:
                streams[node] = AgentStream(channel(daemon.address, None), node)
            streams[node].send(events)
        for s in streams.values():
            s.close()

        def finished() -> set[str]:
            s = Store(db)
            try:
                ended = set()
                for _, _, body in s.rows(kind="event"):
                    e = pb.Event.FromString(body)
                    if e.WhichOneof("payload") == "finish" and e.node.startswith("d"):
                        ended.add(e.finish.req)
                return ended
            finally:
                s.close()

        def first_receipts() -> Counter[str]:
            s = Store(db)
            try:
                return Counter(r.req for _, r in receipts(s) if not r.supersedes)
            finally:
                s.close()

        assert eventually(lambda: set(first_receipts()) == finished(), timeout=30), (
            f"finished without a receipt: {sorted(finished() - set(first_receipts()))}"
        )
        assert set(first_receipts().values()) == {1}, "a request with two first receipts"
        # From the daemon itself, as a tenant's operator asks it: a receipt, and the key to check it.
        req = sorted(finished())[0]
        code, said = run("receipt", req, "--daemon", daemon.address)
        assert code in (0, 1) and f"receipt of request {req} (tenant " in said and ", current" in said
        code, pem = run("receipt-key", "--daemon", daemon.address)
        assert code == 0 and pem == keys[1].read_text()
    finally:
        said = daemon.stop()
    assert "Traceback" not in said


def test_a_cross_tenant_share_a_rule_permits_is_named_in_the_receipt_with_its_rule(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """globex's request reads a prefix that acme's request wrote, which the operator permits
    (an exception of the cross_tenant_share rule): its receipt stays clean and says so, with
    the exception that let the share through."""
    from kvguard.ruleset import DEFAULT_RULES_DIR, load_ruleset

    rules = tmp_path / "rules"
    shutil.copytree(DEFAULT_RULES_DIR, rules)
    leaks = rules / "10-leaks.yaml"
    text = leaks.read_text()
    rule = "- rule: cross_tenant_share\n"
    at = text.index("  tags: [leak, cross-tenant, prefix-cache]", text.index(rule))
    exception = (
        "  exceptions:\n    - name: shared-corpus\n"
        '      condition: tenant == "globex" && victim_tenant == "acme"\n'
    )
    leaks.write_text(text[:at] + exception + text[at:])
    store = Store(str(tmp_path / "audit.db"))
    daemon = Daemon(store, load_ruleset(rules), snapshot_every=0, receipt_key=receipt.load_private(keys[0]))
    log = EventLog()
    log.add("n1", "pool", pool=0, role="colocated", page_size=16, num_pages=64)
    log.add("n1", "admit", req="corpus", tenant="acme", prompt_tokens=32, stage="prefill")
    log.add("n1", "alloc", req="corpus", pool=0, pages=[0, 1])
    log.add("n1", "write", req="corpus", pool=0, pages=[0, 1])
    log.add("n1", "admit", req="ask", tenant="globex", prompt_tokens=48, stage="prefill")
    log.add("n1", "alloc", req="ask", pool=0, pages=[2])
    log.add("n1", "share", req="ask", pool=0, pages=[0, 1], origin_req="corpus")
    log.add("n1", "write", req="ask", pool=0, pages=[2])
    log.add("n1", "read", reads=[{"req": "ask", "pool": 0, "pages": [0, 1, 2], "tokens": 48}])
    log.add("n1", "finish", req="ask")
    try:
        ingest(daemon, "n1", log.lines, lambda m: None)
        wait_for(lambda: daemon.counters["receipts"] == 1)
    finally:
        daemon.close()
    [(_, ask)] = receipts(store)
    assert ask.req == "ask" and ask.verdict == "clean" and ask.pages_attended == 3
    assert [(s.kind, s.pages, s.rule) for s in ask.sources] == [
        ("own", 1, ""),
        ("prefix_permitted", 2, "cross_tenant_share/shared-corpus"),
    ]
    store.close()
