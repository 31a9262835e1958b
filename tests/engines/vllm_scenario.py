"""vLLM 0.33.0 scenarios for kvguard's adapter, run in the vLLM venv: the real Scheduler,
KVCacheManager and BlockPool on CPU, the model runner's part played by ModelRunnerOutput (one
sampled token per scheduled request that finished its prompt). Usage:
vllm_scenario.py SCENARIO CAPTURE; prints one JSON object (findings, kills, engine state)."""

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

SCENARIO, CAPTURE = sys.argv[1], sys.argv[2]
CURRENT = ""  # in a batch, "NAME,MODE" of the scenario running (its result line says it)
TOLD: list = []  # (request, stop_reason) of the ERROR ends the engine core sent its clients
BS = 4

if SCENARIO == "plugin":
    os.environ["KVGUARD_CAPTURE"] = CAPTURE
    os.environ["KVGUARD_NODE"] = "vllm-plugin-node"
    from vllm.plugins import load_general_plugins

    load_general_plugins()

import torch  # noqa: E402
from tiny_model import llama_dir  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import FinishReason  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from kvguard.agents.attach import Attachment, Settings  # noqa: E402
from kvguard.agents.guard import CaptureSink, Guard  # noqa: E402
from kvguard.agents.vllm import adapter as vllm_adapter  # noqa: E402

init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)


def model_dir() -> str:
    return str(
        llama_dir(
            num_attention_heads=4, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False
        )
    )


def scheduler(
    num_blocks: int,
    max_model_len: int = 128,
    batched: int = 32,
    seqs: int = 8,
    kv_role: str | None = None,
    failure_policy: str = "fail",
) -> Scheduler:
    """The real Scheduler; `kv_role` set: with vLLM's NixlConnector (its scheduler half, which
    needs no NIXL library) as kv_producer (prefill) or kv_consumer (decode)."""
    mc = ModelConfig(
        model=model_dir(), dtype="float16", seed=0, skip_tokenizer_init=True, max_model_len=max_model_len
    )
    sc = SchedulerConfig(
        max_num_seqs=seqs,
        max_num_batched_tokens=batched,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cc = CacheConfig(
        block_size=BS, gpu_memory_utilization=0.9, cache_dtype="auto", enable_prefix_caching=True
    )
    kt = (
        KVTransferConfig(kv_connector="NixlConnector", kv_role=kv_role, kv_load_failure_policy=failure_policy)
        if kv_role
        else None
    )
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=sc,
        cache_config=cc,
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=kt,
    )
    kc = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(
                ["layers.0"],
                FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=16, dtype=torch.float16),
            )
        ],
    )
    cc.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vc,
        kv_cache_config=kc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BS,
    )


def request(rid: str, prompt: list[int], salt: str | None, tenant: str, max_tokens: int = 4) -> Request:
    return Request(
        rid,
        prompt,
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        None,
        cache_salt=salt,
        block_hasher=HASHER,
        trace_headers={"x-tenant": tenant},
    )


def step(s: Scheduler, trace: list, kv: KVConnectorOutput | None = None) -> dict:
    """One engine step: schedule (the adapter's step call runs in it), then the runner's output
    (with `kv`: what the worker's KV connector reports this step)."""
    out = s.schedule()
    ids = list(out.num_scheduled_tokens)
    sampled = [[7] if not s.requests[r].is_prefill_chunk else [] for r in ids]
    mro = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=sampled,
        kv_connector_output=kv,
    )
    for outputs in s.update_from_output(out, mro).values():
        # What the engine core sends each client: a stopped request's end, in kvguard's words.
        TOLD.extend(
            (o.request_id, o.stop_reason) for o in outputs.outputs if o.finish_reason == FinishReason.ERROR
        )
    trace.append({r: n for r, n in out.num_scheduled_tokens.items()})
    return out


def guard_for(mode: str = "enforce", tenant_field: str = "header:x-tenant"):
    settings = Settings(node="vllm-node", capture=CAPTURE, mode=mode, tenant_field=tenant_field)
    guard = Guard(settings.node, mode=mode, sink=CaptureSink(CAPTURE))
    attachment = Attachment("vllm", settings, guard=guard)
    return attachment, vllm_adapter.attach(attachment)


def result(attachment, s, **extra) -> None:
    """Print the outcome; a callable in `extra` is read after the capture is closed."""
    guard = attachment.guard
    guard.sink.close()
    extra = {k: v() if callable(v) else v for k, v in extra.items()}
    print(
        json.dumps(
            {
                **({"scenario": CURRENT} if CURRENT else {}),
                "findings": [
                    {
                        "finding": f.finding,
                        "req": f.req,
                        "tenant": f.tenant,
                        "victim_req": f.victim_req,
                        "victim_tenant": f.victim_tenant,
                        "pages": list(f.pages),
                    }
                    for f in guard.findings
                ],
                "killed": sorted(guard.killed),
                "told": TOLD,
                "errors": guard.errors,
                "failed": attachment.failed,
                "failures": attachment.failures,
                "statuses": {rid: r.status.name for rid, r in (s.requests.items() if s else ())},
                **extra,
            }
        )
    )


PREFIX = list(range(100, 116))  # four full blocks


def two_tenants(salted: bool) -> None:
    attachment, _ = guard_for()
    s = scheduler(64)
    trace: list = []
    a = request("a-1", [*PREFIX, 1, 2, 3], "tenant-a" if salted else None, "tenant-a", max_tokens=12)
    s.add_request(a)
    for _ in range(3):
        step(s, trace)
    b = request("b-1", [*PREFIX, 5, 6, 7], "tenant-b" if salted else None, "tenant-b")
    s.add_request(b)
    blocks_a = list(s.kv_cache_manager.get_block_ids("a-1")[0])
    status_b, blocks_b = [], []
    for _ in range(6):
        step(s, trace)
        status_b.append(b.status.name)
        if not blocks_b and "b-1" in s.requests:
            blocks_b = list(s.kv_cache_manager.get_block_ids("b-1")[0])
    result(
        attachment,
        s,
        blocks_a=blocks_a,
        blocks_b=blocks_b,
        status_b=status_b,
        trace=trace,
        finished={"a-1": a.status.name, "b-1": b.status.name},
    )


def mixed() -> None:
    """Chunked prefill, hits within a tenant (live and revived from the free queue),
    preemption under a small pool, aborts, many steps: nothing wrong happens."""
    attachment, _ = guard_for()
    s = scheduler(20, max_model_len=64, batched=24, seqs=6)
    trace: list = []
    prefixes = {"t0": list(range(200, 212)), "t1": list(range(300, 312)), "t2": list(range(400, 412))}
    n, aborted, steps, preempted = 0, [], 0, set()
    for wave in range(6):
        for k in range(4):
            tenant = f"t{(wave + k) % 3}"
            rid = f"{tenant}-r{n}"
            prompt = prefixes[tenant] + [n % 50 + 1] * (3 + (n * 5) % 17)
            s.add_request(request(rid, prompt, tenant, tenant, max_tokens=3 + n % 6))
            n += 1
        for _ in range(5):
            step(s, trace)
            steps += 1
            preempted.update(rid for rid, r in s.requests.items() if r.num_preemptions)
        live = [rid for rid, r in s.requests.items() if not r.is_finished()]
        if live and wave % 2:
            victim = live[len(live) // 2]
            s.finish_requests([victim], RequestStatus.FINISHED_ABORTED)
            aborted.append(victim)
    while s.has_unfinished_requests() and steps < 400:
        step(s, trace)
        steps += 1
    pool = s.kv_cache_manager.block_pool
    result(
        attachment,
        s,
        steps=steps,
        aborted=aborted,
        free_blocks=pool.get_num_free_blocks(),
        hashed_free=sum(1 for b in pool.blocks if b.block_hash is not None and b.ref_cnt == 0),
        preempted=sorted(preempted),
        requests=n,
    )


def small_pool() -> None:
    attachment, _ = guard_for()
    s = scheduler(9, max_model_len=64)  # 8 usable blocks of 4 = 32 tokens < 64
    result(attachment, s)


def plugin() -> None:
    from kvguard.agents.vllm import adapter

    s = scheduler(40)
    trace: list = []
    s.add_request(request("p-1", PREFIX, "tenant-p", "tenant-p"))
    step(s, trace)
    active = adapter._ACTIVE
    active.attachment.guard.sink.close()
    print(
        json.dumps(
            {
                "installed": active is not None,
                "refused": active.refused,
                "node": active.attachment.guard.node,
                "findings": [f.finding for f in active.attachment.guard.findings],
            }
        )
    )


def refused() -> None:
    adapter = vllm_adapter.VllmAdapter(settings=Settings(node="n", capture=CAPTURE), engine_version="0.99.0")
    adapter.install()
    s = scheduler(40)
    trace: list = []
    s.add_request(request("q-1", PREFIX, None, ""))
    for _ in range(3):
        step(s, trace)
    print(
        json.dumps(
            {
                "refused": adapter.refused,
                "attachment": adapter.attachment is not None,
                "guarded": "_kvguard" in s.kv_cache_manager.__dict__,
                "status": s.requests["q-1"].status.name if "q-1" in s.requests else "gone",
                "trace": trace,
            }
        )
    )


def hybrid_refused() -> None:
    """A hybrid layout (full attention and sliding window, one block-id space, two tables) is
    not mapped: refused when its KV cache manager is made, said once, and left unguarded."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    attachment, _ = guard_for()
    spec = {"block_size": BS, "num_kv_heads": 2, "head_size": 16, "dtype": torch.float16}
    groups = [
        KVCacheGroupSpec(["layers.0"], FullAttentionSpec(**spec)),
        KVCacheGroupSpec(["layers.1"], SlidingWindowSpec(**spec, sliding_window=8)),
    ]
    cfg = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)
    manager = KVCacheManager(
        cfg, max_model_len=64, scheduler_block_size=BS, hash_block_size=BS, enable_caching=True
    )
    result(attachment, None, refused=attachment.refused, guarded="_kvguard" in manager.__dict__)


def contained() -> None:
    attachment, _ = guard_for()

    def broken(*args, **kwargs):
        raise RuntimeError("planted kvguard defect")

    attachment.guard.step = broken  # kvguard's own call fails inside the schedule hook
    s = scheduler(40)
    trace: list = []
    s.add_request(request("c-1", PREFIX, None, ""))
    s.add_request(request("c-2", [*PREFIX, 9], None, ""))
    outs = []
    for _ in range(8):
        out = step(s, trace)
        outs.append(out.total_num_scheduled_tokens)
    result(attachment, s, totals=outs, trace=trace)


# ---------------------------------------------------------------------- P/D (NixlConnector)

PROMPT = list(range(500, 518))  # 18 tokens: five blocks of 4, the last holding 2


def remote_prefill(rid: str, tenant: str, blocks: int = 5, tokens: int = 18) -> Request:
    """A decode-side request whose prompt KV a prefill engine holds (NIXL's kv_transfer_params,
    as the prefill's request_finished returns them; `blocks`/`tokens`: what the prefill holds)."""
    r = request(rid, PROMPT, tenant, tenant, max_tokens=3)
    r.kv_transfer_params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [list(range(30, 30 + blocks))],
        "remote_engine_id": "prefill-0",
        "remote_request_id": f"p-{rid}",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_num_tokens": tokens,
    }
    return r


def kv_events(kind: str, rid: str) -> list:
    """The capture's events of one kind for one request (read once the capture is closed)."""
    seen = [json.loads(line) for line in Path(CAPTURE).read_text().splitlines() if line.strip()]
    return [e[kind] for e in seen if kind in e and e[kind].get("req") == rid]


def pd_decode(case: str) -> None:
    """Decode side: d-1 loads its prompt's KV from the prefill engine, then decodes.
    case: clean | fail_first | recompute_first (the first loaded block is invalid, under vLLM's
    kv_load_failure_policy fail / recompute) | recompute_third (the third is) | short (the
    prefill holds 12 of the 18 tokens)."""
    policy = "recompute" if case.startswith("recompute") else "fail"
    attachment, _ = guard_for()
    s = scheduler(40, kv_role="kv_consumer", failure_policy=policy)
    trace: list = []
    short = case == "short"
    d = remote_prefill("d-1", "tenant-d", *((3, 12) if short else (5, 18)))
    s.add_request(d)
    s.add_request(request("l-1", list(range(700, 710)), "tenant-l", "tenant-l", max_tokens=3))
    step(s, trace)
    waiting = {
        "status": d.status.name,
        "computed": d.num_computed_tokens,
        "blocks": list(s.kv_cache_manager.get_block_ids("d-1")[0]),
    }
    step(s, trace)  # the load is still in flight
    still = d.status.name
    blocks = waiting["blocks"]
    invalid = {blocks[0]} if case.endswith("_first") else {blocks[2]} if case.endswith("_third") else set()
    step(s, trace, KVConnectorOutput(finished_recving={"d-1"}, invalid_block_ids=invalid))
    after_recv = {"status": d.status.name, "computed": d.num_computed_tokens}
    promoted = None
    for _ in range(8):
        out = step(s, trace)
        if promoted is None and "d-1" in out.num_scheduled_tokens:
            promoted = {
                "scheduled": out.num_scheduled_tokens["d-1"],
                "blocks": list(s.kv_cache_manager.get_block_ids("d-1")[0]),
            }
    result(
        attachment,
        s,
        waiting=waiting,
        still=still,
        after_recv=after_recv,
        promoted=promoted,
        final=d.status.name,
        gone="d-1" not in s.requests,
        trace=trace,
        free_blocks=s.kv_cache_manager.block_pool.get_num_free_blocks(),
        bootstrap=lambda: kv_events("bootstrap", "d-1"),
        recv=lambda: kv_events("xfer_recv", "d-1"),
    )


def pd_decode_abort() -> None:
    """Decode side: d-2 is aborted while its load is in flight; vLLM keeps its blocks until the
    worker reports the load finished (they are being written), then frees them."""
    attachment, _ = guard_for()
    s = scheduler(40, kv_role="kv_consumer")
    trace: list = []
    d = remote_prefill("d-2", "tenant-d")
    s.add_request(d)
    step(s, trace)
    blocks = list(s.kv_cache_manager.get_block_ids("d-2")[0])
    pool = s.kv_cache_manager.block_pool
    s.finish_requests(["d-2"], RequestStatus.FINISHED_ABORTED)
    kept = {"in_requests": "d-2" in s.requests, "free": pool.get_num_free_blocks()}
    step(s, trace, KVConnectorOutput(finished_recving={"d-2"}))
    result(
        attachment,
        s,
        blocks=blocks,
        kept=kept,
        gone="d-2" not in s.requests,
        free_blocks=pool.get_num_free_blocks(),
        hold=lambda: kv_events("hold", "d-2"),
        release=lambda: kv_events("release", "d-2"),
        recv=lambda: kv_events("xfer_recv", "d-2"),
        free=lambda: kv_events("free", "d-2"),
    )


def pd_prefill() -> None:
    """Prefill side: p-1 prefills and finishes (max_tokens 1); NIXL keeps its blocks until the
    decode engine has read them (finished_sending). p-2 is aborted mid-prefill: NIXL sends
    nothing of an aborted request, so vLLM frees its blocks at once."""
    attachment, _ = guard_for()
    s = scheduler(40, kv_role="kv_producer", batched=24)
    trace: list = []
    pool = s.kv_cache_manager.block_pool
    p1 = request("p-1", PROMPT, "tenant-p", "tenant-p", max_tokens=1)
    p1.kv_transfer_params = {"do_remote_decode": True}
    p2 = request("p-2", list(range(800, 840)), "tenant-q", "tenant-q", max_tokens=1)
    p2.kv_transfer_params = {"do_remote_decode": True}
    s.add_request(p1)
    s.add_request(p2)
    step(s, trace)  # p-1's prompt and p-2's first chunk
    blocks = {rid: list(s.kv_cache_manager.get_block_ids(rid)[0]) for rid in ("p-1", "p-2")}
    s.finish_requests(["p-2"], RequestStatus.FINISHED_ABORTED)
    p2_gone = "p-2" not in s.requests
    step(s, trace)
    held = {
        "status": p1.status.name,
        "in_requests": "p-1" in s.requests,
        "blocks": list(s.kv_cache_manager.get_block_ids("p-1")[0]) if "p-1" in s.requests else [],
        "free": pool.get_num_free_blocks(),
    }
    step(s, trace)  # nothing yet from the decode side
    step(s, trace, KVConnectorOutput(finished_sending={"p-1"}))
    result(
        attachment,
        s,
        blocks=blocks,
        p2_gone=p2_gone,
        held=held,
        gone="p-1" not in s.requests,
        free_blocks=pool.get_num_free_blocks(),
        hold=lambda: kv_events("hold", "p-1"),
        release=lambda: kv_events("release", "p-1"),
        send=lambda: kv_events("xfer_send", "p-1") + kv_events("xfer_send", "p-2"),
        free=lambda: {rid: kv_events("free", rid) for rid in ("p-1", "p-2")},
        ends=lambda: {rid: kv_events("finish", rid) + kv_events("abort", rid) for rid in ("p-1", "p-2")},
    )


t0 = time.time()
SCENARIOS = {
    "salted": lambda: two_tenants(True),
    "unsalted": lambda: two_tenants(False),
    "mixed": mixed,
    "small_pool": small_pool,
    "plugin": plugin,
    "refused": refused,
    "contained": contained,
    "hybrid_refused": hybrid_refused,
    "pd_decode": lambda: pd_decode("clean"),
    "pd_decode_fail": lambda: pd_decode("fail_first"),
    "pd_decode_recompute": lambda: pd_decode("recompute_first"),
    "pd_decode_short": lambda: pd_decode("short"),
    "pd_decode_partial": lambda: pd_decode("recompute_third"),
    "pd_decode_abort": pd_decode_abort,
    "pd_prefill": pd_prefill,
}
if SCENARIO == "batch":  # several in one process (vLLM imported once): NAME,CAPTURE,MODE ...
    for spec in sys.argv[2:]:
        name, CAPTURE, mode = spec.split(",")
        CURRENT = f"{name},{mode}"
        TOLD.clear()
        SCENARIOS[name]()
        sys.stdout.flush()
else:
    SCENARIOS[SCENARIO]()
