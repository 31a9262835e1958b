from kvguard.proto.kvguard.v1 import events_pb2 as _events_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Hello(_message.Message):
    __slots__ = ("node", "agent_version")
    NODE_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    node: str
    agent_version: str
    def __init__(self, node: _Optional[str] = ..., agent_version: _Optional[str] = ...) -> None: ...

class EventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedCompositeFieldContainer[_events_pb2.Event]
    def __init__(self, events: _Optional[_Iterable[_Union[_events_pb2.Event, _Mapping]]] = ...) -> None: ...

class AgentMessage(_message.Message):
    __slots__ = ("hello", "batch", "status")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    batch: EventBatch
    status: NodeStatus
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., batch: _Optional[_Union[EventBatch, _Mapping]] = ..., status: _Optional[_Union[NodeStatus, _Mapping]] = ...) -> None: ...

class Gpu(_message.Message):
    __slots__ = ("index", "name", "uuid", "memory_total", "memory_used")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    UUID_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_FIELD_NUMBER: _ClassVar[int]
    MEMORY_USED_FIELD_NUMBER: _ClassVar[int]
    index: int
    name: str
    uuid: str
    memory_total: int
    memory_used: int
    def __init__(self, index: _Optional[int] = ..., name: _Optional[str] = ..., uuid: _Optional[str] = ..., memory_total: _Optional[int] = ..., memory_used: _Optional[int] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("guard", "guard_since_ns", "guard_pid", "gpus", "gpu_unavailable", "driver", "spooled", "agent_version", "canary_ok_ns", "canary_rtt_us", "canary_waiting_since_ns", "canary_late")
    GUARD_FIELD_NUMBER: _ClassVar[int]
    GUARD_SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    GUARD_PID_FIELD_NUMBER: _ClassVar[int]
    GPUS_FIELD_NUMBER: _ClassVar[int]
    GPU_UNAVAILABLE_FIELD_NUMBER: _ClassVar[int]
    DRIVER_FIELD_NUMBER: _ClassVar[int]
    SPOOLED_FIELD_NUMBER: _ClassVar[int]
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    CANARY_OK_NS_FIELD_NUMBER: _ClassVar[int]
    CANARY_RTT_US_FIELD_NUMBER: _ClassVar[int]
    CANARY_WAITING_SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    CANARY_LATE_FIELD_NUMBER: _ClassVar[int]
    guard: str
    guard_since_ns: int
    guard_pid: int
    gpus: _containers.RepeatedCompositeFieldContainer[Gpu]
    gpu_unavailable: str
    driver: str
    spooled: int
    agent_version: str
    canary_ok_ns: int
    canary_rtt_us: int
    canary_waiting_since_ns: int
    canary_late: bool
    def __init__(self, guard: _Optional[str] = ..., guard_since_ns: _Optional[int] = ..., guard_pid: _Optional[int] = ..., gpus: _Optional[_Iterable[_Union[Gpu, _Mapping]]] = ..., gpu_unavailable: _Optional[str] = ..., driver: _Optional[str] = ..., spooled: _Optional[int] = ..., agent_version: _Optional[str] = ..., canary_ok_ns: _Optional[int] = ..., canary_rtt_us: _Optional[int] = ..., canary_waiting_since_ns: _Optional[int] = ..., canary_late: _Optional[bool] = ...) -> None: ...

class Rejected(_message.Message):
    __slots__ = ("seq", "reason", "epoch")
    SEQ_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    seq: int
    reason: str
    epoch: int
    def __init__(self, seq: _Optional[int] = ..., reason: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class Ack(_message.Message):
    __slots__ = ("node", "durable_seq", "accepted", "repeats", "rejected", "durable_epoch")
    NODE_FIELD_NUMBER: _ClassVar[int]
    DURABLE_SEQ_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    REPEATS_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    DURABLE_EPOCH_FIELD_NUMBER: _ClassVar[int]
    node: str
    durable_seq: int
    accepted: int
    repeats: int
    rejected: _containers.RepeatedCompositeFieldContainer[Rejected]
    durable_epoch: int
    def __init__(self, node: _Optional[str] = ..., durable_seq: _Optional[int] = ..., accepted: _Optional[int] = ..., repeats: _Optional[int] = ..., rejected: _Optional[_Iterable[_Union[Rejected, _Mapping]]] = ..., durable_epoch: _Optional[int] = ...) -> None: ...

class KillRequest(_message.Message):
    __slots__ = ("req", "finding", "rule", "message")
    REQ_FIELD_NUMBER: _ClassVar[int]
    FINDING_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    req: str
    finding: str
    rule: str
    message: str
    def __init__(self, req: _Optional[str] = ..., finding: _Optional[str] = ..., rule: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class QuarantinePages(_message.Message):
    __slots__ = ("pool", "pages", "finding", "epoch")
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    FINDING_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    pool: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    finding: str
    epoch: int
    def __init__(self, pool: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., finding: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class Canary(_message.Message):
    __slots__ = ("nonce", "echo")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    ECHO_FIELD_NUMBER: _ClassVar[int]
    nonce: int
    echo: bool
    def __init__(self, nonce: _Optional[int] = ..., echo: _Optional[bool] = ...) -> None: ...

class Command(_message.Message):
    __slots__ = ("id", "kill", "quarantine", "canary", "by")
    ID_FIELD_NUMBER: _ClassVar[int]
    KILL_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    id: int
    kill: KillRequest
    quarantine: QuarantinePages
    canary: Canary
    by: str
    def __init__(self, id: _Optional[int] = ..., kill: _Optional[_Union[KillRequest, _Mapping]] = ..., quarantine: _Optional[_Union[QuarantinePages, _Mapping]] = ..., canary: _Optional[_Union[Canary, _Mapping]] = ..., by: _Optional[str] = ...) -> None: ...

class StreamError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: str
    message: str
    def __init__(self, code: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class DaemonMessage(_message.Message):
    __slots__ = ("ack", "command", "error")
    ACK_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ack: Ack
    command: Command
    error: StreamError
    def __init__(self, ack: _Optional[_Union[Ack, _Mapping]] = ..., command: _Optional[_Union[Command, _Mapping]] = ..., error: _Optional[_Union[StreamError, _Mapping]] = ...) -> None: ...

class RawEventBatch(_message.Message):
    __slots__ = ("events",)
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    events: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, events: _Optional[_Iterable[bytes]] = ...) -> None: ...

class RawAgentMessage(_message.Message):
    __slots__ = ("hello", "batch", "status")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    BATCH_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    batch: RawEventBatch
    status: NodeStatus
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., batch: _Optional[_Union[RawEventBatch, _Mapping]] = ..., status: _Optional[_Union[NodeStatus, _Mapping]] = ...) -> None: ...

class AlertFilter(_message.Message):
    __slots__ = ("findings", "severities", "tenant", "node", "after", "req", "since_ns", "until_ns")
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    SEVERITIES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    REQ_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_NS_FIELD_NUMBER: _ClassVar[int]
    findings: _containers.RepeatedScalarFieldContainer[str]
    severities: _containers.RepeatedScalarFieldContainer[str]
    tenant: str
    node: str
    after: int
    req: str
    since_ns: int
    until_ns: int
    def __init__(self, findings: _Optional[_Iterable[str]] = ..., severities: _Optional[_Iterable[str]] = ..., tenant: _Optional[str] = ..., node: _Optional[str] = ..., after: _Optional[int] = ..., req: _Optional[str] = ..., since_ns: _Optional[int] = ..., until_ns: _Optional[int] = ...) -> None: ...

class Alert(_message.Message):
    __slots__ = ("cursor", "finding")
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    FINDING_FIELD_NUMBER: _ClassVar[int]
    cursor: int
    finding: _events_pb2.Finding
    def __init__(self, cursor: _Optional[int] = ..., finding: _Optional[_Union[_events_pb2.Finding, _Mapping]] = ...) -> None: ...

class AuditQuery(_message.Message):
    __slots__ = ("kind", "tenant", "req", "node", "finding", "since_ns", "until_ns", "limit", "findings", "severities", "after")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    REQ_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    FINDING_FIELD_NUMBER: _ClassVar[int]
    SINCE_NS_FIELD_NUMBER: _ClassVar[int]
    UNTIL_NS_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    SEVERITIES_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    kind: str
    tenant: str
    req: str
    node: str
    finding: str
    since_ns: int
    until_ns: int
    limit: int
    findings: _containers.RepeatedScalarFieldContainer[str]
    severities: _containers.RepeatedScalarFieldContainer[str]
    after: int
    def __init__(self, kind: _Optional[str] = ..., tenant: _Optional[str] = ..., req: _Optional[str] = ..., node: _Optional[str] = ..., finding: _Optional[str] = ..., since_ns: _Optional[int] = ..., until_ns: _Optional[int] = ..., limit: _Optional[int] = ..., findings: _Optional[_Iterable[str]] = ..., severities: _Optional[_Iterable[str]] = ..., after: _Optional[int] = ...) -> None: ...

class AuditRecord(_message.Message):
    __slots__ = ("id", "kind", "event", "finding", "command", "refused", "action", "receipt")
    ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    FINDING_FIELD_NUMBER: _ClassVar[int]
    COMMAND_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    id: int
    kind: str
    event: _events_pb2.Event
    finding: _events_pb2.Finding
    command: Command
    refused: Refusal
    action: Action
    receipt: SignedReceipt
    def __init__(self, id: _Optional[int] = ..., kind: _Optional[str] = ..., event: _Optional[_Union[_events_pb2.Event, _Mapping]] = ..., finding: _Optional[_Union[_events_pb2.Finding, _Mapping]] = ..., command: _Optional[_Union[Command, _Mapping]] = ..., refused: _Optional[_Union[Refusal, _Mapping]] = ..., action: _Optional[_Union[Action, _Mapping]] = ..., receipt: _Optional[_Union[SignedReceipt, _Mapping]] = ...) -> None: ...

class Receipt(_message.Message):
    __slots__ = ("req", "tenant", "nodes", "first_ns", "last_ns", "pages_attended", "tokens", "sources", "findings", "verdict", "kvguard_version", "ruleset_digest", "chain_record", "chain_hash", "supersedes", "issued_ns", "daemon")
    REQ_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    FIRST_NS_FIELD_NUMBER: _ClassVar[int]
    LAST_NS_FIELD_NUMBER: _ClassVar[int]
    PAGES_ATTENDED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    KVGUARD_VERSION_FIELD_NUMBER: _ClassVar[int]
    RULESET_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHAIN_RECORD_FIELD_NUMBER: _ClassVar[int]
    CHAIN_HASH_FIELD_NUMBER: _ClassVar[int]
    SUPERSEDES_FIELD_NUMBER: _ClassVar[int]
    ISSUED_NS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_FIELD_NUMBER: _ClassVar[int]
    req: str
    tenant: str
    nodes: _containers.RepeatedCompositeFieldContainer[ReceiptNode]
    first_ns: int
    last_ns: int
    pages_attended: int
    tokens: int
    sources: _containers.RepeatedCompositeFieldContainer[PageSource]
    findings: _containers.RepeatedCompositeFieldContainer[ReceiptFinding]
    verdict: str
    kvguard_version: str
    ruleset_digest: str
    chain_record: int
    chain_hash: bytes
    supersedes: int
    issued_ns: int
    daemon: str
    def __init__(self, req: _Optional[str] = ..., tenant: _Optional[str] = ..., nodes: _Optional[_Iterable[_Union[ReceiptNode, _Mapping]]] = ..., first_ns: _Optional[int] = ..., last_ns: _Optional[int] = ..., pages_attended: _Optional[int] = ..., tokens: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[PageSource, _Mapping]]] = ..., findings: _Optional[_Iterable[_Union[ReceiptFinding, _Mapping]]] = ..., verdict: _Optional[str] = ..., kvguard_version: _Optional[str] = ..., ruleset_digest: _Optional[str] = ..., chain_record: _Optional[int] = ..., chain_hash: _Optional[bytes] = ..., supersedes: _Optional[int] = ..., issued_ns: _Optional[int] = ..., daemon: _Optional[str] = ...) -> None: ...

class ReceiptNode(_message.Message):
    __slots__ = ("node", "epoch")
    NODE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    node: str
    epoch: int
    def __init__(self, node: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class PageSource(_message.Message):
    __slots__ = ("kind", "pages", "rule")
    KIND_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    kind: str
    pages: int
    rule: str
    def __init__(self, kind: _Optional[str] = ..., pages: _Optional[int] = ..., rule: _Optional[str] = ...) -> None: ...

class ReceiptFinding(_message.Message):
    __slots__ = ("record", "finding", "role", "action")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    FINDING_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    record: int
    finding: str
    role: str
    action: str
    def __init__(self, record: _Optional[int] = ..., finding: _Optional[str] = ..., role: _Optional[str] = ..., action: _Optional[str] = ...) -> None: ...

class SignedReceipt(_message.Message):
    __slots__ = ("receipt", "signature", "key_id")
    RECEIPT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    receipt: bytes
    signature: bytes
    key_id: str
    def __init__(self, receipt: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., key_id: _Optional[str] = ...) -> None: ...

class Refusal(_message.Message):
    __slots__ = ("kind", "reason", "epoch", "event", "size", "sha256")
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    kind: str
    reason: str
    epoch: int
    event: bytes
    size: int
    sha256: bytes
    def __init__(self, kind: _Optional[str] = ..., reason: _Optional[str] = ..., epoch: _Optional[int] = ..., event: _Optional[bytes] = ..., size: _Optional[int] = ..., sha256: _Optional[bytes] = ...) -> None: ...

class FleetRequest(_message.Message):
    __slots__ = ("own",)
    OWN_FIELD_NUMBER: _ClassVar[int]
    own: bool
    def __init__(self, own: _Optional[bool] = ...) -> None: ...

class PoolState(_message.Message):
    __slots__ = ("node", "report", "pages_in_use")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REPORT_FIELD_NUMBER: _ClassVar[int]
    PAGES_IN_USE_FIELD_NUMBER: _ClassVar[int]
    node: str
    report: _events_pb2.PoolReport
    pages_in_use: int
    def __init__(self, node: _Optional[str] = ..., report: _Optional[_Union[_events_pb2.PoolReport, _Mapping]] = ..., pages_in_use: _Optional[int] = ...) -> None: ...

class NodeState(_message.Message):
    __slots__ = ("node", "last_seq", "last_ts_ns", "connected", "dropped", "pools", "epoch", "restarts", "status", "status_ns", "connected_ns", "received_ns", "events_per_s", "lag_ms", "daemon")
    NODE_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_TS_NS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    STATUS_NS_FIELD_NUMBER: _ClassVar[int]
    CONNECTED_NS_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_NS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_PER_S_FIELD_NUMBER: _ClassVar[int]
    LAG_MS_FIELD_NUMBER: _ClassVar[int]
    DAEMON_FIELD_NUMBER: _ClassVar[int]
    node: str
    last_seq: int
    last_ts_ns: int
    connected: bool
    dropped: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolState]
    epoch: int
    restarts: int
    status: NodeStatus
    status_ns: int
    connected_ns: int
    received_ns: int
    events_per_s: float
    lag_ms: float
    daemon: str
    def __init__(self, node: _Optional[str] = ..., last_seq: _Optional[int] = ..., last_ts_ns: _Optional[int] = ..., connected: _Optional[bool] = ..., dropped: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolState, _Mapping]]] = ..., epoch: _Optional[int] = ..., restarts: _Optional[int] = ..., status: _Optional[_Union[NodeStatus, _Mapping]] = ..., status_ns: _Optional[int] = ..., connected_ns: _Optional[int] = ..., received_ns: _Optional[int] = ..., events_per_s: _Optional[float] = ..., lag_ms: _Optional[float] = ..., daemon: _Optional[str] = ...) -> None: ...

class StageLatency(_message.Message):
    __slots__ = ("stage", "count", "p50_ms", "p99_ms", "max_ms")
    STAGE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    P50_MS_FIELD_NUMBER: _ClassVar[int]
    P99_MS_FIELD_NUMBER: _ClassVar[int]
    MAX_MS_FIELD_NUMBER: _ClassVar[int]
    stage: str
    count: int
    p50_ms: float
    p99_ms: float
    max_ms: float
    def __init__(self, stage: _Optional[str] = ..., count: _Optional[int] = ..., p50_ms: _Optional[float] = ..., p99_ms: _Optional[float] = ..., max_ms: _Optional[float] = ...) -> None: ...

class StoreRoom(_message.Message):
    __slots__ = ("used_bytes", "free_known", "free_bytes", "reserve_bytes", "growth_bytes_per_s", "full_in_s", "refusing")
    USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_KNOWN_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RESERVE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GROWTH_BYTES_PER_S_FIELD_NUMBER: _ClassVar[int]
    FULL_IN_S_FIELD_NUMBER: _ClassVar[int]
    REFUSING_FIELD_NUMBER: _ClassVar[int]
    used_bytes: int
    free_known: bool
    free_bytes: int
    reserve_bytes: int
    growth_bytes_per_s: float
    full_in_s: float
    refusing: str
    def __init__(self, used_bytes: _Optional[int] = ..., free_known: _Optional[bool] = ..., free_bytes: _Optional[int] = ..., reserve_bytes: _Optional[int] = ..., growth_bytes_per_s: _Optional[float] = ..., full_in_s: _Optional[float] = ..., refusing: _Optional[str] = ...) -> None: ...

class FleetState(_message.Message):
    __slots__ = ("nodes", "requests", "events", "findings", "counters", "latencies", "store", "now_ns", "mode", "judged", "daemon", "cells", "receipt_key")
    class FindingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class CountersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NODES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    COUNTERS_FIELD_NUMBER: _ClassVar[int]
    LATENCIES_FIELD_NUMBER: _ClassVar[int]
    STORE_FIELD_NUMBER: _ClassVar[int]
    NOW_NS_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    JUDGED_FIELD_NUMBER: _ClassVar[int]
    DAEMON_FIELD_NUMBER: _ClassVar[int]
    CELLS_FIELD_NUMBER: _ClassVar[int]
    RECEIPT_KEY_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeState]
    requests: int
    events: int
    findings: _containers.ScalarMap[str, int]
    counters: _containers.ScalarMap[str, int]
    latencies: _containers.RepeatedCompositeFieldContainer[StageLatency]
    store: StoreRoom
    now_ns: int
    mode: str
    judged: _containers.RepeatedCompositeFieldContainer[FindingCount]
    daemon: str
    cells: _containers.RepeatedCompositeFieldContainer[CellLease]
    receipt_key: str
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeState, _Mapping]]] = ..., requests: _Optional[int] = ..., events: _Optional[int] = ..., findings: _Optional[_Mapping[str, int]] = ..., counters: _Optional[_Mapping[str, int]] = ..., latencies: _Optional[_Iterable[_Union[StageLatency, _Mapping]]] = ..., store: _Optional[_Union[StoreRoom, _Mapping]] = ..., now_ns: _Optional[int] = ..., mode: _Optional[str] = ..., judged: _Optional[_Iterable[_Union[FindingCount, _Mapping]]] = ..., daemon: _Optional[str] = ..., cells: _Optional[_Iterable[_Union[CellLease, _Mapping]]] = ..., receipt_key: _Optional[str] = ...) -> None: ...

class CellLease(_message.Message):
    __slots__ = ("cell", "daemon", "sources")
    CELL_FIELD_NUMBER: _ClassVar[int]
    DAEMON_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    cell: str
    daemon: str
    sources: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, cell: _Optional[str] = ..., daemon: _Optional[str] = ..., sources: _Optional[_Iterable[str]] = ...) -> None: ...

class FindingCount(_message.Message):
    __slots__ = ("kind", "rule", "severity", "count")
    KIND_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    kind: str
    rule: str
    severity: str
    count: int
    def __init__(self, kind: _Optional[str] = ..., rule: _Optional[str] = ..., severity: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class PoolMapRequest(_message.Message):
    __slots__ = ("node", "pool")
    NODE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    node: str
    pool: int
    def __init__(self, node: _Optional[str] = ..., pool: _Optional[int] = ...) -> None: ...

class PoolMap(_message.Message):
    __slots__ = ("node", "pool", "page_size", "epoch", "states", "tenant", "tenants", "req", "reqs")
    NODE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    TENANTS_FIELD_NUMBER: _ClassVar[int]
    REQ_FIELD_NUMBER: _ClassVar[int]
    REQS_FIELD_NUMBER: _ClassVar[int]
    node: str
    pool: int
    page_size: int
    epoch: int
    states: bytes
    tenant: _containers.RepeatedScalarFieldContainer[int]
    tenants: _containers.RepeatedScalarFieldContainer[str]
    req: _containers.RepeatedScalarFieldContainer[int]
    reqs: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node: _Optional[str] = ..., pool: _Optional[int] = ..., page_size: _Optional[int] = ..., epoch: _Optional[int] = ..., states: _Optional[bytes] = ..., tenant: _Optional[_Iterable[int]] = ..., tenants: _Optional[_Iterable[str]] = ..., req: _Optional[_Iterable[int]] = ..., reqs: _Optional[_Iterable[str]] = ...) -> None: ...

class RulesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RuleState(_message.Message):
    __slots__ = ("id", "finding", "severity", "action", "mode", "overridden", "by")
    ID_FIELD_NUMBER: _ClassVar[int]
    FINDING_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    OVERRIDDEN_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    id: str
    finding: str
    severity: str
    action: str
    mode: str
    overridden: bool
    by: str
    def __init__(self, id: _Optional[str] = ..., finding: _Optional[str] = ..., severity: _Optional[str] = ..., action: _Optional[str] = ..., mode: _Optional[str] = ..., overridden: _Optional[bool] = ..., by: _Optional[str] = ...) -> None: ...

class RulesState(_message.Message):
    __slots__ = ("mode", "rules")
    MODE_FIELD_NUMBER: _ClassVar[int]
    RULES_FIELD_NUMBER: _ClassVar[int]
    mode: str
    rules: _containers.RepeatedCompositeFieldContainer[RuleState]
    def __init__(self, mode: _Optional[str] = ..., rules: _Optional[_Iterable[_Union[RuleState, _Mapping]]] = ...) -> None: ...

class Acknowledge(_message.Message):
    __slots__ = ("cursor",)
    CURSOR_FIELD_NUMBER: _ClassVar[int]
    cursor: int
    def __init__(self, cursor: _Optional[int] = ...) -> None: ...

class RuleMode(_message.Message):
    __slots__ = ("rule", "mode")
    RULE_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    rule: str
    mode: str
    def __init__(self, rule: _Optional[str] = ..., mode: _Optional[str] = ...) -> None: ...

class Action(_message.Message):
    __slots__ = ("kill", "quarantine", "acknowledge", "rule_mode", "node", "reason", "by", "ts_ns", "commands", "nodes")
    KILL_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_FIELD_NUMBER: _ClassVar[int]
    ACKNOWLEDGE_FIELD_NUMBER: _ClassVar[int]
    RULE_MODE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    COMMANDS_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    kill: KillRequest
    quarantine: QuarantinePages
    acknowledge: Acknowledge
    rule_mode: RuleMode
    node: str
    reason: str
    by: str
    ts_ns: int
    commands: _containers.RepeatedScalarFieldContainer[int]
    nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kill: _Optional[_Union[KillRequest, _Mapping]] = ..., quarantine: _Optional[_Union[QuarantinePages, _Mapping]] = ..., acknowledge: _Optional[_Union[Acknowledge, _Mapping]] = ..., rule_mode: _Optional[_Union[RuleMode, _Mapping]] = ..., node: _Optional[str] = ..., reason: _Optional[str] = ..., by: _Optional[str] = ..., ts_ns: _Optional[int] = ..., commands: _Optional[_Iterable[int]] = ..., nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class ActionResult(_message.Message):
    __slots__ = ("record", "action", "message")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    record: int
    action: Action
    message: str
    def __init__(self, record: _Optional[int] = ..., action: _Optional[_Union[Action, _Mapping]] = ..., message: _Optional[str] = ...) -> None: ...
