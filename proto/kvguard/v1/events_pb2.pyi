from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Event(_message.Message):
    __slots__ = ("node", "seq", "ts_ns", "epoch", "pool", "admit", "reject", "abort", "finish", "bootstrap", "alloc", "write", "free", "hold", "release", "share", "read", "xfer_send", "xfer_recv", "wire", "kill", "heartbeat", "scrub", "step", "launches", "pool_memory")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    ADMIT_FIELD_NUMBER: _ClassVar[int]
    REJECT_FIELD_NUMBER: _ClassVar[int]
    ABORT_FIELD_NUMBER: _ClassVar[int]
    FINISH_FIELD_NUMBER: _ClassVar[int]
    BOOTSTRAP_FIELD_NUMBER: _ClassVar[int]
    ALLOC_FIELD_NUMBER: _ClassVar[int]
    WRITE_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    HOLD_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    SHARE_FIELD_NUMBER: _ClassVar[int]
    READ_FIELD_NUMBER: _ClassVar[int]
    XFER_SEND_FIELD_NUMBER: _ClassVar[int]
    XFER_RECV_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    KILL_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    SCRUB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    POOL_MEMORY_FIELD_NUMBER: _ClassVar[int]
    node: str
    seq: int
    ts_ns: int
    epoch: int
    pool: PoolReport
    admit: Admit
    reject: Reject
    abort: Abort
    finish: Finish
    bootstrap: Bootstrap
    alloc: Alloc
    write: Write
    free: Free
    hold: Hold
    release: Release
    share: Share
    read: Read
    xfer_send: XferSend
    xfer_recv: XferRecv
    wire: Wire
    kill: Kill
    heartbeat: Heartbeat
    scrub: Scrub
    step: Step
    launches: Launches
    pool_memory: PoolMemory
    def __init__(self, node: _Optional[str] = ..., seq: _Optional[int] = ..., ts_ns: _Optional[int] = ..., epoch: _Optional[int] = ..., pool: _Optional[_Union[PoolReport, _Mapping]] = ..., admit: _Optional[_Union[Admit, _Mapping]] = ..., reject: _Optional[_Union[Reject, _Mapping]] = ..., abort: _Optional[_Union[Abort, _Mapping]] = ..., finish: _Optional[_Union[Finish, _Mapping]] = ..., bootstrap: _Optional[_Union[Bootstrap, _Mapping]] = ..., alloc: _Optional[_Union[Alloc, _Mapping]] = ..., write: _Optional[_Union[Write, _Mapping]] = ..., free: _Optional[_Union[Free, _Mapping]] = ..., hold: _Optional[_Union[Hold, _Mapping]] = ..., release: _Optional[_Union[Release, _Mapping]] = ..., share: _Optional[_Union[Share, _Mapping]] = ..., read: _Optional[_Union[Read, _Mapping]] = ..., xfer_send: _Optional[_Union[XferSend, _Mapping]] = ..., xfer_recv: _Optional[_Union[XferRecv, _Mapping]] = ..., wire: _Optional[_Union[Wire, _Mapping]] = ..., kill: _Optional[_Union[Kill, _Mapping]] = ..., heartbeat: _Optional[_Union[Heartbeat, _Mapping]] = ..., scrub: _Optional[_Union[Scrub, _Mapping]] = ..., step: _Optional[_Union[Step, _Mapping]] = ..., launches: _Optional[_Union[Launches, _Mapping]] = ..., pool_memory: _Optional[_Union[PoolMemory, _Mapping]] = ...) -> None: ...

class PoolReport(_message.Message):
    __slots__ = ("pool", "role", "engine", "engine_version", "model", "page_size", "num_pages", "context_len", "max_prompt_tokens", "kv_dtype", "tp_size", "quant", "mem_fraction", "source", "cluster", "reserved_pages", "regions")
    POOL_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    ENGINE_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LEN_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    TP_SIZE_FIELD_NUMBER: _ClassVar[int]
    QUANT_FIELD_NUMBER: _ClassVar[int]
    MEM_FRACTION_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_FIELD_NUMBER: _ClassVar[int]
    RESERVED_PAGES_FIELD_NUMBER: _ClassVar[int]
    REGIONS_FIELD_NUMBER: _ClassVar[int]
    pool: int
    role: str
    engine: str
    engine_version: str
    model: str
    page_size: int
    num_pages: int
    context_len: int
    max_prompt_tokens: int
    kv_dtype: str
    tp_size: int
    quant: str
    mem_fraction: float
    source: str
    cluster: str
    reserved_pages: int
    regions: _containers.RepeatedCompositeFieldContainer[KvRegion]
    def __init__(self, pool: _Optional[int] = ..., role: _Optional[str] = ..., engine: _Optional[str] = ..., engine_version: _Optional[str] = ..., model: _Optional[str] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., context_len: _Optional[int] = ..., max_prompt_tokens: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., tp_size: _Optional[int] = ..., quant: _Optional[str] = ..., mem_fraction: _Optional[float] = ..., source: _Optional[str] = ..., cluster: _Optional[str] = ..., reserved_pages: _Optional[int] = ..., regions: _Optional[_Iterable[_Union[KvRegion, _Mapping]]] = ...) -> None: ...

class KvRegion(_message.Message):
    __slots__ = ("base", "stride", "page_bytes")
    BASE_FIELD_NUMBER: _ClassVar[int]
    STRIDE_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    base: int
    stride: int
    page_bytes: int
    def __init__(self, base: _Optional[int] = ..., stride: _Optional[int] = ..., page_bytes: _Optional[int] = ...) -> None: ...

class Admit(_message.Message):
    __slots__ = ("req", "tenant", "prompt_tokens", "stage", "handle")
    REQ_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    req: str
    tenant: str
    prompt_tokens: int
    stage: str
    handle: int
    def __init__(self, req: _Optional[str] = ..., tenant: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., stage: _Optional[str] = ..., handle: _Optional[int] = ...) -> None: ...

class Reject(_message.Message):
    __slots__ = ("req", "reason")
    REQ_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    req: str
    reason: str
    def __init__(self, req: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Abort(_message.Message):
    __slots__ = ("req", "reason")
    REQ_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    req: str
    reason: str
    def __init__(self, req: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class Finish(_message.Message):
    __slots__ = ("req", "output_tokens")
    REQ_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    req: str
    output_tokens: int
    def __init__(self, req: _Optional[str] = ..., output_tokens: _Optional[int] = ...) -> None: ...

class Bootstrap(_message.Message):
    __slots__ = ("req", "prefill_node", "decode_node", "prompt_tokens", "tenant")
    REQ_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    req: str
    prefill_node: str
    decode_node: str
    prompt_tokens: int
    tenant: str
    def __init__(self, req: _Optional[str] = ..., prefill_node: _Optional[str] = ..., decode_node: _Optional[str] = ..., prompt_tokens: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class Alloc(_message.Message):
    __slots__ = ("req", "pool", "pages")
    REQ_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    req: str
    pool: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req: _Optional[str] = ..., pool: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ...) -> None: ...

class Write(_message.Message):
    __slots__ = ("req", "pool", "pages", "slots")
    REQ_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    req: str
    pool: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req: _Optional[str] = ..., pool: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ...) -> None: ...

class Step(_message.Message):
    __slots__ = ("pool", "reqs", "counts", "pages", "slots", "handles", "grants")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REQS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    HANDLES_FIELD_NUMBER: _ClassVar[int]
    GRANTS_FIELD_NUMBER: _ClassVar[int]
    pool: int
    reqs: _containers.RepeatedScalarFieldContainer[str]
    counts: _containers.RepeatedScalarFieldContainer[int]
    pages: _containers.RepeatedScalarFieldContainer[int]
    slots: _containers.RepeatedScalarFieldContainer[int]
    handles: _containers.RepeatedScalarFieldContainer[int]
    grants: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool: _Optional[int] = ..., reqs: _Optional[_Iterable[str]] = ..., counts: _Optional[_Iterable[int]] = ..., pages: _Optional[_Iterable[int]] = ..., slots: _Optional[_Iterable[int]] = ..., handles: _Optional[_Iterable[int]] = ..., grants: _Optional[_Iterable[int]] = ...) -> None: ...

class Free(_message.Message):
    __slots__ = ("req", "pool", "pages")
    REQ_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    req: str
    pool: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req: _Optional[str] = ..., pool: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ...) -> None: ...

class Hold(_message.Message):
    __slots__ = ("req", "pool", "pages", "holder")
    REQ_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    req: str
    pool: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    holder: str
    def __init__(self, req: _Optional[str] = ..., pool: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., holder: _Optional[str] = ...) -> None: ...

class Release(_message.Message):
    __slots__ = ("req", "pool", "pages", "holder")
    REQ_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    req: str
    pool: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    holder: str
    def __init__(self, req: _Optional[str] = ..., pool: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., holder: _Optional[str] = ...) -> None: ...

class Share(_message.Message):
    __slots__ = ("req", "pool", "pages", "origin_req")
    REQ_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_REQ_FIELD_NUMBER: _ClassVar[int]
    req: str
    pool: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    origin_req: str
    def __init__(self, req: _Optional[str] = ..., pool: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., origin_req: _Optional[str] = ...) -> None: ...

class ReadEntry(_message.Message):
    __slots__ = ("req", "pool", "pages", "tokens")
    REQ_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    req: str
    pool: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    tokens: int
    def __init__(self, req: _Optional[str] = ..., pool: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., tokens: _Optional[int] = ...) -> None: ...

class Read(_message.Message):
    __slots__ = ("reads",)
    READS_FIELD_NUMBER: _ClassVar[int]
    reads: _containers.RepeatedCompositeFieldContainer[ReadEntry]
    def __init__(self, reads: _Optional[_Iterable[_Union[ReadEntry, _Mapping]]] = ...) -> None: ...

class XferSend(_message.Message):
    __slots__ = ("req", "xfer", "peer_node", "pool", "pages", "tokens", "bytes", "checksums", "status")
    REQ_FIELD_NUMBER: _ClassVar[int]
    XFER_FIELD_NUMBER: _ClassVar[int]
    PEER_NODE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    req: str
    xfer: str
    peer_node: str
    pool: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    tokens: int
    bytes: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    status: str
    def __init__(self, req: _Optional[str] = ..., xfer: _Optional[str] = ..., peer_node: _Optional[str] = ..., pool: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., status: _Optional[str] = ...) -> None: ...

class XferRecv(_message.Message):
    __slots__ = ("req", "xfer", "peer_node", "pool", "pages", "tokens", "bytes", "checksums", "status", "claimed_tokens", "claimed_bytes", "claimed_checksums")
    REQ_FIELD_NUMBER: _ClassVar[int]
    XFER_FIELD_NUMBER: _ClassVar[int]
    PEER_NODE_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CLAIMED_CHECKSUMS_FIELD_NUMBER: _ClassVar[int]
    req: str
    xfer: str
    peer_node: str
    pool: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    tokens: int
    bytes: int
    checksums: _containers.RepeatedScalarFieldContainer[int]
    status: str
    claimed_tokens: int
    claimed_bytes: int
    claimed_checksums: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, req: _Optional[str] = ..., xfer: _Optional[str] = ..., peer_node: _Optional[str] = ..., pool: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., tokens: _Optional[int] = ..., bytes: _Optional[int] = ..., checksums: _Optional[_Iterable[int]] = ..., status: _Optional[str] = ..., claimed_tokens: _Optional[int] = ..., claimed_bytes: _Optional[int] = ..., claimed_checksums: _Optional[_Iterable[int]] = ...) -> None: ...

class Wire(_message.Message):
    __slots__ = ("xfer", "peer_node", "bytes", "calls", "probe", "complete", "remote_lo", "remote_hi", "writes", "writes_lost", "first_write_ns", "last_write_ns")
    XFER_FIELD_NUMBER: _ClassVar[int]
    PEER_NODE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CALLS_FIELD_NUMBER: _ClassVar[int]
    PROBE_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    REMOTE_LO_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HI_FIELD_NUMBER: _ClassVar[int]
    WRITES_FIELD_NUMBER: _ClassVar[int]
    WRITES_LOST_FIELD_NUMBER: _ClassVar[int]
    FIRST_WRITE_NS_FIELD_NUMBER: _ClassVar[int]
    LAST_WRITE_NS_FIELD_NUMBER: _ClassVar[int]
    xfer: str
    peer_node: str
    bytes: int
    calls: int
    probe: str
    complete: bool
    remote_lo: int
    remote_hi: int
    writes: _containers.RepeatedCompositeFieldContainer[RemoteRun]
    writes_lost: int
    first_write_ns: int
    last_write_ns: int
    def __init__(self, xfer: _Optional[str] = ..., peer_node: _Optional[str] = ..., bytes: _Optional[int] = ..., calls: _Optional[int] = ..., probe: _Optional[str] = ..., complete: _Optional[bool] = ..., remote_lo: _Optional[int] = ..., remote_hi: _Optional[int] = ..., writes: _Optional[_Iterable[_Union[RemoteRun, _Mapping]]] = ..., writes_lost: _Optional[int] = ..., first_write_ns: _Optional[int] = ..., last_write_ns: _Optional[int] = ...) -> None: ...

class RemoteRun(_message.Message):
    __slots__ = ("addr", "bytes")
    ADDR_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    addr: int
    bytes: int
    def __init__(self, addr: _Optional[int] = ..., bytes: _Optional[int] = ...) -> None: ...

class Kill(_message.Message):
    __slots__ = ("req", "finding", "by", "late")
    REQ_FIELD_NUMBER: _ClassVar[int]
    FINDING_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    LATE_FIELD_NUMBER: _ClassVar[int]
    req: str
    finding: str
    by: str
    late: bool
    def __init__(self, req: _Optional[str] = ..., finding: _Optional[str] = ..., by: _Optional[str] = ..., late: _Optional[bool] = ...) -> None: ...

class Heartbeat(_message.Message):
    __slots__ = ("agent_version", "dropped", "canary")
    AGENT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    agent_version: str
    dropped: int
    canary: int
    def __init__(self, agent_version: _Optional[str] = ..., dropped: _Optional[int] = ..., canary: _Optional[int] = ...) -> None: ...

class Launches(_message.Message):
    __slots__ = ("launches", "graphs", "attention", "checked", "unguarded", "captured", "unjudged", "unnamed", "unwrapped", "checks", "steps", "kernel", "kernel_steps", "judged", "kernel_in_graph", "quiet_steps")
    LAUNCHES_FIELD_NUMBER: _ClassVar[int]
    GRAPHS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_FIELD_NUMBER: _ClassVar[int]
    CHECKED_FIELD_NUMBER: _ClassVar[int]
    UNGUARDED_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_FIELD_NUMBER: _ClassVar[int]
    UNJUDGED_FIELD_NUMBER: _ClassVar[int]
    UNNAMED_FIELD_NUMBER: _ClassVar[int]
    UNWRAPPED_FIELD_NUMBER: _ClassVar[int]
    CHECKS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    KERNEL_STEPS_FIELD_NUMBER: _ClassVar[int]
    JUDGED_FIELD_NUMBER: _ClassVar[int]
    KERNEL_IN_GRAPH_FIELD_NUMBER: _ClassVar[int]
    QUIET_STEPS_FIELD_NUMBER: _ClassVar[int]
    launches: int
    graphs: int
    attention: int
    checked: int
    unguarded: int
    captured: int
    unjudged: int
    unnamed: int
    unwrapped: int
    checks: int
    steps: int
    kernel: str
    kernel_steps: int
    judged: bool
    kernel_in_graph: bool
    quiet_steps: int
    def __init__(self, launches: _Optional[int] = ..., graphs: _Optional[int] = ..., attention: _Optional[int] = ..., checked: _Optional[int] = ..., unguarded: _Optional[int] = ..., captured: _Optional[int] = ..., unjudged: _Optional[int] = ..., unnamed: _Optional[int] = ..., unwrapped: _Optional[int] = ..., checks: _Optional[int] = ..., steps: _Optional[int] = ..., kernel: _Optional[str] = ..., kernel_steps: _Optional[int] = ..., judged: _Optional[bool] = ..., kernel_in_graph: _Optional[bool] = ..., quiet_steps: _Optional[int] = ...) -> None: ...

class PoolMemory(_message.Message):
    __slots__ = ("pool", "kind", "base", "bytes", "covered", "lo", "hi", "call", "allocations", "steps")
    POOL_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    COVERED_FIELD_NUMBER: _ClassVar[int]
    LO_FIELD_NUMBER: _ClassVar[int]
    HI_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    ALLOCATIONS_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    pool: int
    kind: str
    base: int
    bytes: int
    covered: int
    lo: int
    hi: int
    call: str
    allocations: int
    steps: int
    def __init__(self, pool: _Optional[int] = ..., kind: _Optional[str] = ..., base: _Optional[int] = ..., bytes: _Optional[int] = ..., covered: _Optional[int] = ..., lo: _Optional[int] = ..., hi: _Optional[int] = ..., call: _Optional[str] = ..., allocations: _Optional[int] = ..., steps: _Optional[int] = ...) -> None: ...

class Scrub(_message.Message):
    __slots__ = ("pool", "pages")
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    pool: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pool: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ...) -> None: ...

class Finding(_message.Message):
    __slots__ = ("finding", "severity", "action", "rule", "node", "req", "tenant", "victim_req", "victim_tenant", "pool", "pages", "seq", "message", "ts_ns", "tags", "details")
    class DetailsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    FINDING_FIELD_NUMBER: _ClassVar[int]
    SEVERITY_FIELD_NUMBER: _ClassVar[int]
    ACTION_FIELD_NUMBER: _ClassVar[int]
    RULE_FIELD_NUMBER: _ClassVar[int]
    NODE_FIELD_NUMBER: _ClassVar[int]
    REQ_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    VICTIM_REQ_FIELD_NUMBER: _ClassVar[int]
    VICTIM_TENANT_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    PAGES_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    TS_NS_FIELD_NUMBER: _ClassVar[int]
    TAGS_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    finding: str
    severity: str
    action: str
    rule: str
    node: str
    req: str
    tenant: str
    victim_req: str
    victim_tenant: str
    pool: int
    pages: _containers.RepeatedScalarFieldContainer[int]
    seq: int
    message: str
    ts_ns: int
    tags: _containers.RepeatedScalarFieldContainer[str]
    details: _containers.ScalarMap[str, str]
    def __init__(self, finding: _Optional[str] = ..., severity: _Optional[str] = ..., action: _Optional[str] = ..., rule: _Optional[str] = ..., node: _Optional[str] = ..., req: _Optional[str] = ..., tenant: _Optional[str] = ..., victim_req: _Optional[str] = ..., victim_tenant: _Optional[str] = ..., pool: _Optional[int] = ..., pages: _Optional[_Iterable[int]] = ..., seq: _Optional[int] = ..., message: _Optional[str] = ..., ts_ns: _Optional[int] = ..., tags: _Optional[_Iterable[str]] = ..., details: _Optional[_Mapping[str, str]] = ...) -> None: ...
