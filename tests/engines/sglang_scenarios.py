"""Scenarios run inside the SGLang venv: SGLang 0.5.23's own KV classes (paged allocator over a
real MHA KV pool on CPU, req_to_token, radix cache, the fake PD sender and receiver, Req and
its abort), driven as SGLang's scheduler drives them, with kvguard's adapter hooked in
through SGLang's HookRegistry. The test plays the scheduler's loop only; every KV call is
SGLang's: its own match_kv_cache and release_kv_cache under a published runtime
context. Usage: sglang_scenarios.py SCENARIO CAPTURE [MODE]. Prints one JSON line."""

from __future__ import annotations

import json
import sys
from array import array
from typing import Any

import torch
from sglang.srt.disaggregation.fake.conn import FakeKVReceiver, FakeKVSender
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.common import match_kv_cache, release_kv_cache
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache
from sglang.srt.runtime_context import get_parallel, publish
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from tiny_model import llama_dir

from kvguard.agents.attach import Attachment, Settings
from kvguard.agents.sglang import plugin
from kvguard.agents.sglang.adapter import SglangAdapter

PAGE = 4


def publish_runtime() -> None:
    """SGLang's process-wide config, as its scheduler process publishes it at start (a tiny
    local model config: nothing is downloaded, no model runs)."""
    model = llama_dir()
    publish(
        ServerArgs(model_path=str(model), skip_tokenizer_init=True, device="cpu", page_size=PAGE),
        role="scheduler",
    )


class Engine:
    """One SGLang scheduler's KV state, its requests driven as the scheduler drives them."""

    def __init__(
        self,
        node: str,
        role: str,
        capture: str,
        mode: str,
        pages: int = 8,
        rows: int = 8,
        context: int = 0,
        need_sort: bool = True,
        radix: bool = False,
        attachment: Attachment | None = None,
    ) -> None:
        size = PAGE * pages
        self.kv = MHATokenToKVPool(
            size=size,
            page_size=PAGE,
            dtype=torch.float16,
            head_num=2,
            head_dim=8,
            layer_num=2,
            device="cpu",
            enable_memory_saver=False,
        )
        if attachment is None:  # else the one the plugin made from the environment (sglang_live.py)
            attachment = Attachment("sglang", Settings(node=node, capture=capture, mode=mode))
        self.adapter = plugin.install(SglangAdapter(attachment, role))
        self.alloc = PagedTokenToKVPoolAllocator(
            size=size, page_size=PAGE, dtype=torch.float16, device="cpu", kvcache=self.kv, need_sort=need_sort
        )
        context = context or size
        self.r2t = ReqToTokenPool(
            size=rows, max_context_len=max(context, 64), device="cpu", enable_memory_saver=False
        )
        self.tree = RadixCache(  # disabled: the prefix cache off, as SGLang runs without one
            CacheInitParams(
                disable=not radix,
                req_to_token_pool=self.r2t,
                token_to_kv_pool_allocator=self.alloc,
                page_size=PAGE,
            )
        )
        self.adapter.report_pool(self.alloc, role=role, context_len=context, req_to_token_pool=self.r2t)
        self.guard = attachment.guard

    def request(self, rid: str, tokens: list[int], tenant: str) -> Req:
        return Req(rid, "", array("q", tokens), SamplingParams(max_new_tokens=4), cache_salt=tenant)

    def forward(
        self,
        reqs: list[Req],
        slots: torch.Tensor,
        value: float | None = None,
        extend_lens: list[int] | None = None,
        rows: torch.Tensor | None = None,
    ) -> None:
        """run_batch: the adapter's step check (the hook's call, with the batch's fields),
        then the forward writes K and V at the slots."""
        if rows is None:
            rows = torch.tensor([r.kv.req_pool_idx for r in reqs])
        lens = torch.tensor([r.kv.kv_allocated_len for r in reqs])
        self.adapter.forward_step(reqs, rows, lens, slots, self.r2t, extend_lens)
        for r in reqs:
            if r.to_finish is None and value is not None:
                self.kv.k_buffer[0][slots] = value
                self.kv.v_buffer[0][slots] = value

    def prefill(
        self, req: Req, value: float, prefix: torch.Tensor | None = None, upto: int | None = None
    ) -> torch.Tensor:
        """alloc_for_extend for one request (prefix slots from the tree first), then the forward."""
        if req.kv.req_pool_idx is None:
            assert self.r2t.alloc([req]) is not None
        row = req.kv.req_pool_idx
        start = req.kv.kv_allocated_len
        end = len(req.origin_input_ids) if upto is None else upto
        if prefix is not None and len(prefix):
            self.r2t.write((row, slice(0, len(prefix))), prefix.to(torch.int32))
            start = len(prefix)
            req.kv.cache_protected_len = start
        last = self.r2t.req_to_token[row, start - 1 : start].long() if start else torch.tensor([-1])
        slots = self.alloc.alloc_extend(
            prefix_lens=torch.tensor([start]),
            prefix_lens_cpu=torch.tensor([start]),
            seq_lens=torch.tensor([end]),
            seq_lens_cpu=torch.tensor([end]),
            last_loc=last,
            extend_num_tokens=end - start,
        )
        assert slots is not None, "pool full"
        self.r2t.write((row, slice(start, end)), slots.to(torch.int32))
        req.kv.kv_allocated_len = end
        self.forward([req], slots, value, [end - start])
        return slots

    def decode(self, reqs: list[Req], value: float, held: bool = True) -> None:
        """alloc_for_decode: one slot each (a new page at a page boundary), the batch's row
        write, then one forward for the batch, with the batch's own rows tensor, as SGLang's
        ScheduleBatch passes it (`held`: the adapter's step takes the alloc and the write it
        held; else the rows come as a new tensor and what was held is applied as made)."""
        lens = torch.tensor([r.kv.kv_allocated_len + 1 for r in reqs])
        rows = torch.tensor([r.kv.req_pool_idx for r in reqs])
        last = self.r2t.req_to_token[rows, lens - 2].long()
        slots = self.alloc.alloc_decode(seq_lens=lens, seq_lens_cpu=lens, last_loc=last)
        self.r2t.write((rows, lens - 1), slots.to(torch.int32))
        for r in reqs:
            r.kv.kv_allocated_len += 1
        self.forward(reqs, slots, value, rows=rows if held else None)

    def row_slots(self, req: Req) -> torch.Tensor:
        return self.r2t.req_to_token[req.kv.req_pool_idx, : req.kv.kv_allocated_len].long()

    def release(self, req: Req, insert: bool = False) -> None:
        """SGLang's own release_kv_cache: with checkpoint, the tree keeps what it can key
        (duplicates freed, the row rewritten to the tree's slots), then the request's own
        part is freed and its row given back."""
        req.kv.kv_committed_len = req.kv.kv_allocated_len
        release_kv_cache(req, self.tree, checkpoint=insert)

    def finish(self, req: Req, insert: bool = False) -> None:
        from sglang.srt.managers.schedule_batch import FINISH_LENGTH

        req.finished_reason = FINISH_LENGTH(length=1)
        req.output_ids = array("q", [1])
        self.release(req, insert)

    def match(self, req: Req) -> torch.Tensor:
        """SGLang's match_kv_cache and the lock the scheduler takes on the matched path."""
        match_kv_cache(req, self.tree)
        req.lock = self.tree.lock(req.last_node)
        return self.tree.prefix_device_indices(req) if req.prefix_len else torch.zeros(0, dtype=torch.int64)


def stale_pages(engine: Engine, req: Req, value: float) -> int:
    slots = engine.row_slots(req)
    return sum(
        bool((engine.kv.k_buffer[0][slots[p * PAGE : (p + 1) * PAGE]] == value).all())
        for p in range(len(slots) // PAGE)
    )


def one_page_of_eight_lands(e: Engine, b: Req, room: int = 42) -> FakeKVReceiver:
    """B's decode reservation of its whole 32-token prompt (8 pages, whatever they held), told
    to prefill through the fake receiver of `room`; the one page prefill sends lands."""
    b.bootstrap_room = room
    assert e.r2t.alloc([b]) is not None
    slots = e.alloc.alloc(32)
    e.r2t.write((b.kv.req_pool_idx, slice(0, 32)), slots.to(torch.int32))
    b.kv.kv_allocated_len = 32
    receiver = FakeKVReceiver(mgr=None, bootstrap_addr="fake", bootstrap_room=room)
    receiver.init(prefill_dp_rank=0)
    receiver.send_metadata(kv_indices=(slots[::PAGE] // PAGE).numpy().astype("int32"))
    e.kv.k_buffer[0][slots[:PAGE]] = 1.0
    e.kv.v_buffer[0][slots[:PAGE]] = 1.0
    return receiver


def incident(capture: str, mode: str) -> dict:
    """Decode reserves 8 pages for B's transfer; prefill (rejected, flowing on) sends one;
    the other 7 still hold tenant A's KV. SGLang's receiver says Success."""
    e = Engine("d0", "decode", capture, mode)
    a = e.request("a-1", list(range(1000, 1032)), "tenant-a")
    e.prefill(a, 7.0)
    e.finish(a)
    b = e.request("b-1", list(range(2000, 2032)), "tenant-b")
    receiver = one_page_of_eight_lands(e, b)
    stale = stale_pages(e, b, 7.0)
    state = receiver.poll()
    return {
        "stale_pages": stale,
        "poll": int(state),
        "findings": [f.finding for f in e.guard.findings],
        "killed": sorted(e.guard.killed),
        "victims": sorted({f.victim_req for f in e.guard.findings}),
        "errors": e.guard.errors,
    }


def short_send(capture: str, mode: str) -> dict:
    """Prefill's fake sender: told 8 pages, sends 1, reports Success."""
    e = Engine("p0", "prefill", capture, mode)
    r = e.request("r-1", list(range(3000, 3032)), "tenant-a")
    r.bootstrap_room = 7
    e.prefill(r, 3.0)
    sender = FakeKVSender(mgr=None, bootstrap_addr="fake", bootstrap_room=7)
    sender.init(num_kv_indices=8)
    first = (e.row_slots(r)[:PAGE:PAGE] // PAGE).numpy().astype("int32")
    sender.send(kv_indices=first, num_kv_tokens=PAGE)
    state = sender.poll()
    return {
        "poll": int(state),
        "findings": [f.finding for f in e.guard.findings],
        "killed": sorted(e.guard.killed),
    }


def rejected(capture: str, mode: str) -> dict:
    """SGLang rejects a too-long prompt (set_finish_with_abort: to_finish, a one-token stub),
    and the request flows on anyway: a row, a page, a send (the incident's old path)."""
    e = Engine("p0", "prefill", capture, mode)
    r = e.request("long-1", list(range(5000, 5048)), "tenant-b")
    r.bootstrap_room = 9
    with get_parallel().override(tp_rank=0):
        r.set_finish_with_abort("Input length (48 tokens) exceeds the maximum allowed length (32 tokens)")
    stub_len = len(r.origin_input_ids)
    e.prefill(r, 5.0)  # finished() is False: the old queue let it on
    sender = FakeKVSender(mgr=None, bootstrap_addr="fake", bootstrap_room=9)
    sender.init(num_kv_indices=1)
    sender.send(kv_indices=(e.row_slots(r)[:1] // PAGE).numpy().astype("int32"), num_kv_tokens=1)
    state = sender.poll()
    return {
        "stub_len": stub_len,
        "finished": r.finished(),
        "poll": int(state),
        "findings": [f.finding for f in e.guard.findings],
        "killed": sorted(e.guard.killed),
    }


def mixed(capture: str, mode: str) -> dict:
    """Every fault off: chunked prefill, prefix hits within a tenant (on live and on
    finished requests' cached pages), decode steps across page boundaries, retraction and
    recompute, an abort, radix eviction under pressure, grouped frees."""
    e = Engine("c0", "colocated", capture, mode, pages=24, rows=8, need_sort=False, radix=True)
    doc = list(range(100, 116))
    a1 = e.request("a-1", [*doc, 1, 2, 3, 4], "tenant-a")
    assert len(e.match(a1)) == 0
    e.prefill(a1, 1.0, upto=8)  # chunked prefill: two chunks
    e.prefill(a1, 1.0)
    e.decode([a1], 1.5)
    e.finish(a1, insert=True)  # its prefix stays in the tree
    a2 = e.request("a-2", [*doc, 5, 6, 7, 8], "tenant-a")
    hit = e.match(a2)
    assert len(hit) == 16, len(hit)
    e.prefill(a2, 2.0, prefix=hit)  # a hit on a finished request's cached pages
    b1 = e.request("b-1", list(range(600, 620)), "tenant-b")
    assert len(e.match(b1)) == 0
    e.prefill(b1, 3.0)
    for _ in range(5):
        e.decode([a2, b1], 4.0)  # across page boundaries
    # Retraction: b1 gives everything back and is recomputed later.
    e.release(b1)
    assert len(e.match(b1)) == 0
    e.prefill(b1, 3.5)
    e.decode([a2, b1], 4.5)
    # An abort mid-decode.
    c1 = e.request("c-1", list(range(700, 710)), "tenant-c")
    e.match(c1)
    e.prefill(c1, 6.0)
    from sglang.srt.managers.schedule_batch import FINISH_ABORT

    c1.finished_reason = FINISH_ABORT("client disconnected")
    e.release(c1)
    e.finish(a2, insert=True)
    e.finish(b1, insert=True)
    a3 = e.request("a-3", [*doc, 5, 6, 7, 8, 9], "tenant-a")
    assert len(e.match(a3)) == 20  # a-1's prefix and a-2's page, both ended
    e.prefill(a3, 2.5, prefix=e.tree.prefix_device_indices(a3))
    e.finish(a3, insert=True)
    # Pressure: the tree evicts to make room for a new tenant's long prompt.
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    e.tree.evict(EvictParams(num_tokens=96))
    d1 = e.request("d-1", list(range(800, 840)), "tenant-d")
    e.match(d1)
    e.prefill(d1, 8.0)
    e.decode([d1], 8.5)
    e.finish(d1)
    return {
        "findings": [f"{f.finding}: {f.message}" for f in e.guard.findings],
        "killed": sorted(e.guard.killed),
        "errors": e.guard.errors,
        "events": e.guard._seq,
    }


def decode_faults(capture: str, mode: str) -> dict:
    """Decode steps, the adapter taking its held calls (SGLang's own batch) and not: clean
    steps across a page boundary, then an allocator whose free list holds a page another
    request still has (a double free inside the allocator) hands it to a request's decode
    step. The same findings either way."""
    out: dict[str, Any] = {}
    for held in (True, False):
        where = capture if held else f"{capture}.as-made"
        e = Engine(f"c-{held}", "colocated", where, mode, pages=16, rows=4)
        a = e.request("a-1", list(range(100, 100 + 2 * PAGE)), "tenant-a")  # two full pages
        b = e.request("b-1", list(range(300, 302)), "tenant-b")  # half a page
        e.prefill(a, 1.0)
        e.prefill(b, 2.0)
        for _ in range(PAGE):
            e.decode([a, b], 3.0, held)  # a opens a new page; b fills its first and opens one
        clean = len(e.guard.findings)
        theirs = int(e.row_slots(b)[0]) // PAGE  # b's first page, still b's
        free = e.alloc.free_pages
        e.alloc.free_pages = torch.cat((torch.tensor([theirs], dtype=free.dtype), free))
        e.decode([a], 4.0, held)  # a's next token opens a page: the allocator hands it b's
        out["held" if held else "as made"] = {
            "clean_steps_findings": clean,
            "findings": sorted(f"{f.finding}:{f.req}" for f in e.guard.findings),
            "killed": sorted(e.guard.killed),
            "errors": e.guard.errors,
        }
    return out


def plugin_path(capture: str, mode: str) -> dict:
    """SGLang loads kvguard through its own plugin loader (the entry point), and the guard is
    made from the environment (KVGUARD_NODE, KVGUARD_CAPTURE) on the first hook that runs."""
    from sglang.srt.plugins import load_plugins

    load_plugins()
    kv = MHATokenToKVPool(
        size=16,
        page_size=PAGE,
        dtype=torch.float16,
        head_num=2,
        head_dim=8,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    alloc = PagedTokenToKVPoolAllocator(
        size=16, page_size=PAGE, dtype=torch.float16, device="cpu", kvcache=kv, need_sort=False
    )
    r2t = ReqToTokenPool(size=2, max_context_len=16, device="cpu", enable_memory_saver=False)
    adapter = plugin.current()
    adapter.report_pool(alloc, role="colocated", context_len=16, req_to_token_pool=r2t)
    req = Req("env-1", "", array("q", range(8)), SamplingParams(max_new_tokens=1), cache_salt="tenant-e")
    r2t.alloc([req])
    slots = alloc.alloc(8)
    r2t.write((req.kv.req_pool_idx, slice(0, 8)), slots.to(torch.int32))
    return {
        "hooked": hasattr(PagedTokenToKVPoolAllocator.alloc, "__wrapped__"),
        "node": adapter.guard.node,
        "findings": [f.finding for f in adapter.guard.findings],
    }


def version_refused(capture: str, mode: str) -> dict:
    """An SGLang this adapter does not know: refused in one line, nothing hooked."""
    import sglang

    sglang.__version__ = "0.6.0"
    plugin.load()
    return {
        "hooked": hasattr(PagedTokenToKVPoolAllocator.alloc, "__wrapped__"),
        "refused": plugin._lifecycle.refused,
    }


def unmapped_refused(capture: str, mode: str) -> dict:
    """What SGLang can run that the adapter does not map, as its own classes make it: each said
    at the scheduler's start, and the scheduler then unguarded (no pool reported)."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.utils import TransferBackend
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

    def scheduler(kv: object, mode: str = "null", backend: object = None, **flags: object) -> SimpleNamespace:
        alloc = PagedTokenToKVPoolAllocator(
            size=16, page_size=PAGE, dtype=torch.float16, device="cpu", kvcache=kv, need_sort=False
        )
        return SimpleNamespace(
            token_to_kv_pool_allocator=alloc,
            server_args=SimpleNamespace(disaggregation_mode=mode),
            transfer_backend=backend,
            **flags,
        )

    mha = MHATokenToKVPool(
        size=16, page_size=PAGE, dtype=torch.float16, head_num=2, head_dim=8, layer_num=1, device="cpu",
        enable_memory_saver=False,
    )  # fmt: skip
    mla = MLATokenToKVPool(
        size=16, page_size=PAGE, dtype=torch.float16, kv_lora_rank=16, qk_rope_head_dim=8, layer_num=1,
        device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    cases = {
        "mapped": scheduler(mha, "decode", TransferBackend.FAKE),
        "mla": scheduler(mla),
        "mooncake": scheduler(mha, "prefill", TransferBackend.MOONCAKE),
        "nixl": scheduler(mha, "decode", TransferBackend.NIXL),
        "hicache": scheduler(mha, enable_hierarchical_cache=True),
        "swa": scheduler(mha, is_hybrid_swa=True),
    }
    found = {name: plugin.unmapped(s) for name, s in cases.items()}
    settings = Settings(node="u0", capture=capture, mode=mode, on_failure="stop")
    adapter = plugin.install(SglangAdapter(Attachment("sglang", settings)))
    plugin._scheduler_made(None, cases["mooncake"])
    return {
        "unmapped": found,
        "refused": adapter.attachment.failed,
        "stopped": adapter.attachment.stopped,
        "reported": adapter.book is not None,
    }


def contained(capture: str, mode: str) -> dict:
    """kvguard itself fails inside a hook: SGLang's call returns as it would, once said."""
    e = Engine("c0", "colocated", capture, mode)
    e.adapter.book.owner = None  # kvguard's own state broken
    first = e.alloc.alloc(8)
    second = e.alloc.alloc(8)
    return {
        "first": first.tolist(),
        "second": second.tolist(),
        "failed": e.adapter.attachment.failed,
        "failures": e.adapter.attachment.failures,
    }


def run(name: str, capture: str, mode: str) -> dict:
    result = globals()[name](capture, mode)
    if plugin._adapter is not None:
        attachment = plugin._adapter.attachment  # a refusal (unmapped_refused) is no failure
        result["adapter_failed"] = "" if attachment.refused else attachment.failed
        plugin._adapter.guard.sink.close()
    return result


if __name__ == "__main__":
    publish_runtime()
    if sys.argv[1] == "batch":  # several scenarios, one process (SGLang imported once): NAME,CAPTURE,MODE ...
        for spec in sys.argv[2:]:
            name, capture, mode = spec.split(",")
            print(json.dumps({"scenario": f"{name},{mode}", **run(name, capture, mode)}), flush=True)
    else:
        print(json.dumps(run(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else "enforce")))
