"""Exact de-duplication at the daemon (a real daemon process, SQLite and PostgreSQL): a gap
stays a gap that can still be filled, a far-future sequence number hides nothing after it, a
repeat is acknowledged as one and a repeat with other bytes is refused as tampering."""

from __future__ import annotations

import subprocess
import sys

import grpc

from kvguard.agents.upstream import AgentStream
from kvguard.cli.process import Service
from kvguard.daemon.store import Store
from kvguard.proto import limits, pb
from kvguard.proto.kvguard.v1 import services_pb2 as svc
from kvguard.proto.kvguard.v1 import services_pb2_grpc as svc_grpc

FAR = 4 + limits.SEQ_JUMP_MAX  # as far past the last as a node's lost events may go
POOL = pb.Event(node="p0", seq=1, pool=pb.PoolReport(pool=0, role="prefill", page_size=16, num_pages=8))


def admit(seq: int, tenant: str = "acme") -> pb.Event:
    return pb.Event(
        node="p0", seq=seq, ts_ns=seq, admit=pb.Admit(req=f"r{seq}", tenant=tenant, stage="prefill")
    )


def test_deduplication_is_exact_and_a_changed_repeat_is_tampering(daemon: Service) -> None:
    with grpc.insecure_channel(daemon.address) as channel:
        stream = AgentStream(channel, "p0")
        ack = stream.send([POOL, admit(4)])
        assert (ack.accepted, ack.durable_seq) == (2, 1)  # 2 and 3 are missing: not durable past 1
        ack = stream.send([admit(2), admit(3)])  # late, not repeats: the gap is filled
        assert (ack.accepted, ack.repeats, ack.durable_seq) == (2, 0, 4)
        ack = stream.send([admit(3), admit(3, tenant="globex")])
        assert (ack.accepted, ack.repeats) == (0, 1)
        (refused,) = ack.rejected
        assert refused.seq == 3 and "different bytes" in refused.reason
        # A number far ahead (a corrupt line, an impostor) hides nothing that comes after it ...
        ack = stream.send([admit(FAR), admit(5), admit(6)])
        assert (ack.accepted, ack.repeats, ack.durable_seq) == (3, 0, 6)
        # ... and one past any gap events could leave is refused, and moves no count.
        ack = stream.send([admit(10**15), admit(7)])
        assert ack.accepted == 1 and "past the last applied" in ack.rejected[0].reason
        counters = svc_grpc.FleetServiceStub(channel).State(svc.FleetRequest()).counters
        assert (counters["tampered"], counters["repeat"], counters["out_of_range"]) == (1, 1, 1)
        assert counters["ledger_missing"] == FAR - 4 - 1 - 3  # the gap FAR opened, less 5, 6 and 7 filled
        stream.close()
    store = Store(daemon.store)
    try:
        events = list(store.events())
        refused = [svc.Refusal.FromString(body) for _, _, body in store.rows(kind="refused")]
        assert store.verify()[0]
    finally:
        store.close()
    # The tampered copy is kept in the audit log, as evidence, with why it was refused.
    (tampered, forged) = refused
    assert forged.kind == "out_of_range" and "past the last applied" in forged.reason
    assert tampered.kind == "tampered" and "different bytes" in tampered.reason
    assert tampered.event == admit(3, tenant="globex").SerializeToString()
    query = [sys.executable, "-m", "kvguard", "audit", "query", "--store", daemon.store, "--kind", "refused"]
    said = subprocess.run(query, capture_output=True, text=True, check=True).stdout
    assert "refused admit (tampered)" in said and "p0" in said
    assert [(e.seq, e.admit.tenant) for e in events[1:]] == [
        (4, "acme"),
        (2, "acme"),
        (3, "acme"),
        (FAR, "acme"),
        (5, "acme"),
        (6, "acme"),
        (7, "acme"),
    ]
