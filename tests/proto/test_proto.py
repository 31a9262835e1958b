"""The wire: generated code is current, and the messages keep the names of the event contract
(docs/integrator.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

from kvguard.proto import pb
from kvguard.proto.generate import PACKAGE_DIR, PROTO_ROOT, generate

# The event contract (docs/integrator.md), the Event table: payload -> its fields.
CONTRACT = {
    "pool": {
        "pool",
        "role",
        "engine",
        "engine_version",
        "model",
        "page_size",
        "num_pages",
        "context_len",
        "max_prompt_tokens",
        "kv_dtype",
        "tp_size",
        "quant",
        "mem_fraction",
        "source",
    },
    "admit": {"req", "tenant", "prompt_tokens", "stage"},
    "reject": {"req", "reason"},
    "abort": {"req", "reason"},
    "finish": {"req", "output_tokens"},
    "bootstrap": {"req", "prefill_node", "decode_node", "prompt_tokens"},
    "alloc": {"req", "pool", "pages"},
    "write": {"req", "pool", "pages", "slots"},
    "free": {"req", "pool", "pages"},
    "hold": {"req", "pool", "pages", "holder"},
    "release": {"req", "pool", "pages", "holder"},
    "share": {"req", "pool", "pages", "origin_req"},
    "read": {"reads"},
    "xfer_send": {"req", "xfer", "peer_node", "pool", "pages", "tokens", "bytes", "checksums", "status"},
    "xfer_recv": {"req", "xfer", "peer_node", "pool", "pages", "tokens", "bytes", "checksums", "status"},
    "wire": {"xfer", "peer_node", "bytes", "calls", "probe"},
    "kill": {"req", "finding", "by"},
    "heartbeat": {"agent_version", "dropped"},
}
FINDING_FIELDS = {
    "finding",
    "severity",
    "action",
    "rule",
    "node",
    "req",
    "tenant",
    "victim_req",
    "victim_tenant",
    "pool",
    "pages",
    "seq",
    "message",
}


def test_generated_code_is_current(tmp_path: Path) -> None:
    written = generate(tmp_path)
    assert {p.name for p in written} >= {"events_pb2.py", "events_pb2.pyi"}
    for path in written:
        committed = PROTO_ROOT / PACKAGE_DIR / path.name
        assert committed.exists(), f"{committed} is missing: run make proto"
        assert committed.read_text() == path.read_text(), f"{committed} is stale: run make proto"


def test_event_envelope() -> None:
    fields = pb.Event.DESCRIPTOR.fields_by_name
    assert fields["node"].type == FieldDescriptor.TYPE_STRING
    assert fields["seq"].type == FieldDescriptor.TYPE_UINT64
    assert fields["ts_ns"].type == FieldDescriptor.TYPE_INT64
    payloads = {f.name for f in pb.Event.DESCRIPTOR.oneofs_by_name["payload"].fields}
    assert payloads >= set(CONTRACT)


@pytest.mark.parametrize("payload", sorted(CONTRACT))
def test_payload_fields_keep_the_contract_names(payload: str) -> None:
    message = pb.Event.DESCRIPTOR.fields_by_name[payload].message_type
    assert set(message.fields_by_name) >= CONTRACT[payload]


def test_read_entries() -> None:
    entry = pb.Event.DESCRIPTOR.fields_by_name["read"].message_type.fields_by_name["reads"].message_type
    assert set(entry.fields_by_name) == {"req", "pool", "pages", "tokens"}


def test_finding_fields() -> None:
    assert set(pb.Finding.DESCRIPTOR.fields_by_name) >= FINDING_FIELDS


def test_page_lists_are_packed_on_the_wire() -> None:
    # One length-delimited field (tag 3, wire type 2) holding the varints: not one field per page.
    assert pb.Alloc(pages=[1, 2, 300]).SerializeToString() == bytes([0x1A, 4, 1, 2, 0xAC, 0x02])
    assert pb.Write(pages=[5], slots=[16]).SerializeToString() == bytes([0x1A, 1, 5, 0x22, 1, 16])
