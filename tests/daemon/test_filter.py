"""One filter (proto/filter.py) for the live alert stream and the audit queries: what it takes
of a finding as it is published is what the store's query takes of the stored findings, and
the two wire messages spell it the same."""

from __future__ import annotations

import random
from pathlib import Path

from kvguard.daemon.store import Record, Store
from kvguard.ledger import Finding
from kvguard.proto import pb
from kvguard.proto.filter import Filter
from kvguard.proto.kvguard.v1 import services_pb2 as svc

TENANTS = ("acme", "globex", "")
KINDS = ("stale_read", "double_free", "config_drift")
SEVERITIES = ("critical", "high", "low")


def findings(rng: random.Random, n: int) -> list[Finding]:
    return [
        Finding(
            rng.choice(KINDS),
            node=rng.choice(("p0", "d0")),
            req=f"r{rng.randint(1, 6)}",
            tenant=rng.choice(TENANTS),
            victim_req=rng.choice(("", f"r{rng.randint(1, 6)}")),
            victim_tenant=rng.choice(TENANTS),
            seq=i + 1,
            ts_ns=1_000 * (i + 1),
            severity=rng.choice(SEVERITIES),
            action="alert",
            rule="r",
            message="m",
        )
        for i in range(n)
    ]


def filters(rng: random.Random) -> Filter:
    return Filter(
        findings=frozenset(rng.sample(KINDS, rng.randint(0, 2))),
        severities=frozenset(rng.sample(SEVERITIES, rng.randint(0, 2))),
        tenant=rng.choice(("", "acme", "globex")),
        req=rng.choice(("", "r2", "r5")),
        node=rng.choice(("", "p0", "d0")),
        since_ns=rng.choice((0, 20_000)),
        until_ns=rng.choice((0, 60_000)),
    )


def test_the_store_takes_what_the_live_stream_takes(tmp_path: Path) -> None:
    rng = random.Random(5)
    made = findings(rng, 80)
    store = Store(str(tmp_path / "audit.db"))
    ids = store.append([Record.of_finding(f) for f in made])
    for _ in range(300):
        f = filters(rng)
        live = [record_id for record_id, finding in zip(ids, made, strict=True) if f.matches(finding)]
        stored = [record_id for record_id, _, _ in store.rows(Filter(**{**_fields(f), "kind": "finding"}))]
        assert stored == live, f
        # and a finding read back (kvguard.v1.Finding) is judged as it was live
        for record_id, _, body in store.rows(kind="finding"):
            assert f.matches(Finding.from_proto(pb.Finding.FromString(body))) == (record_id in live)
    store.close()


def _fields(f: Filter) -> dict[str, object]:
    return {name: getattr(f, name) for name in f.__slots__}


def test_the_wire_messages_spell_the_same_filter() -> None:
    f = Filter(
        findings=frozenset({"stale_read", "foreign_read"}),
        severities=frozenset({"critical"}),
        tenant="acme",
        req="r1",
        node="d0",
        since_ns=5,
        until_ns=9,
        after=3,
    )
    assert Filter.of(f.alert_filter()) == f
    query = Filter(**{**_fields(f), "kind": "finding", "limit": 10})
    assert Filter.of(query.audit_query()) == query
    # An audit query's one `finding` joins its `findings`.
    assert Filter.of(svc.AuditQuery(finding="double_free", findings=["stale_read"])).findings == {
        "double_free",
        "stale_read",
    }
