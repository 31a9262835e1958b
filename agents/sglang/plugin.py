"""kvguard as an SGLang plugin: the `sglang.srt.plugins` entry point (`load`) registers hooks
on SGLang's own classes through its HookRegistry; no fork of SGLang.

Invariants: `load` only registers hooks (SGLang calls it in every one of its processes); the
guard is made on the first hook that runs, i.e. in the scheduler process, from the
environment (kvguard.agents.attach); every hook runs kvguard's part contained, so a failure
of kvguard never raises into SGLang; a version this adapter does not know is refused in one
line and left unguarded.
"""

from __future__ import annotations

import logging
import pkgutil
from collections.abc import Callable
from typing import Any

import numpy as np

from kvguard.agents.attach import EngineAttach
from kvguard.agents.sglang import receipts
from kvguard.agents.sglang.adapter import SglangAdapter
from kvguard.agents.sglang.transfers import host_ints

log = logging.getLogger("kvguard.adapter")

_adapter: SglangAdapter | None = None


def _version() -> str:
    import sglang

    return sglang.__version__


def _stop_rid(rid: str, why: str) -> None:
    if _adapter is not None:
        _adapter.stop_rid(rid, why)


_lifecycle = EngineAttach("sglang", _version, on_kill=_stop_rid)


def install(adapter: SglangAdapter) -> SglangAdapter:
    """Guard this process with `adapter` (tests, or an engine that makes its own guard)."""
    global _adapter
    _adapter = adapter
    _register()
    return adapter


def current() -> SglangAdapter | None:
    """The process's adapter, made from the environment the first time a hook needs it."""
    global _adapter
    if _adapter is None:
        attachment = _lifecycle.attachment()
        if attachment is None:
            return None
        _adapter = SglangAdapter(attachment)
    return _adapter


def load() -> None:
    """The entry point SGLang calls (in each of its processes): a version this adapter does
    not know registers no hook at all."""
    if _lifecycle.version_known():
        _register()


# The calls that take what a decode step holds themselves (decode.py); before any other, it is
# applied as made.
_TAKES_HELD = (SglangAdapter.row_written, SglangAdapter.forward_step, SglangAdapter.decode_slots)


def _run(what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    adapter = current()
    if adapter is None:
        return None
    if adapter.held is not None and fn not in _TAKES_HELD:
        adapter.attachment.contain("held decode calls", SglangAdapter.flush, adapter)
    return adapter.attachment.contain(what, fn, adapter, *args, **kwargs)


# ---------------------------------------------------------------------- the hooks

ALLOC = "sglang.srt.mem_cache.allocator.paged.PagedTokenToKVPoolAllocator"
TOKEN = "sglang.srt.mem_cache.allocator.token.TokenToKVPoolAllocator"
ROWS = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool"
RADIX = "sglang.srt.mem_cache.radix_cache.RadixCache"
REQ = "sglang.srt.managers.schedule_batch.Req"
SCHED = "sglang.srt.managers.scheduler.Scheduler"
SENDERS = (
    "sglang.srt.disaggregation.fake.conn.FakeKVSender",
    "sglang.srt.disaggregation.common.conn.CommonKVSender",
)
RECEIVERS = (
    "sglang.srt.disaggregation.fake.conn.FakeKVReceiver",
    "sglang.srt.disaggregation.common.conn.CommonKVReceiver",
)


def _handed_out(result: Any, allocator: Any, *args: Any, **kwargs: Any) -> None:
    _run("allocator alloc", SglangAdapter.handed_out, allocator, result)


def _decode_slots(result: Any, allocator: Any, *args: Any, **kwargs: Any) -> None:
    _run("allocator alloc_decode", SglangAdapter.decode_slots, allocator, result)


def _released(allocator: Any, *page_ids: Any) -> None:
    pages = np.concatenate([host_ints(p) for p in page_ids]) if page_ids else np.zeros(0, np.int64)
    _run("allocator free", SglangAdapter.released, allocator, pages)


def _token_free(allocator: Any, free_index: Any) -> None:
    if allocator.free_group is None:  # in a group: freed at its end, by one call that comes here
        _run("allocator free", SglangAdapter.released, allocator, host_ints(free_index))


def _cleared(result: Any, allocator: Any) -> None:
    adapter = current()
    if adapter is not None and adapter.pool_of(allocator) is not None:
        adapter.attachment.contain("held decode calls", SglangAdapter.flush, adapter)
        adapter.book.clear()


def _rows_alloc(original: Callable[..., Any], pool: Any, reqs: list[Any]) -> Any:
    adapter = current()
    if adapter is not None and adapter.attachment.stopped:
        return None  # kvguard failed and the operator chose stop: no room for new requests
    rows = original(pool, reqs)
    if rows is not None:
        _run("req_to_token alloc", SglangAdapter.rows_bound, pool, reqs)
    return rows


def _rows_write(result: Any, pool: Any, indices: Any, values: Any) -> None:
    _run("req_to_token write", SglangAdapter.row_written, pool, indices, values)


def _rows_free(pool: Any, req: Any) -> None:
    _run("req_to_token free", SglangAdapter.row_freed, pool, req)


def _inserted(result: Any, tree: Any, params: Any) -> None:
    if result is not None:
        allocator = getattr(tree, "token_to_kv_pool_allocator", None)
        _run(
            "radix insert",
            SglangAdapter.cached,
            allocator,
            getattr(params, "value", None),
            int(result.prefix_len),
        )


def _set_finish_with_abort(
    original: Callable[..., Any], req: Any, error_msg: str, *args: Any, **kw: Any
) -> Any:
    adapter = current()
    if adapter is not None:
        adapter.attachment.contain("reject", SglangAdapter.request, adapter, req)  # its prompt, before
    result = original(req, error_msg, *args, **kw)
    _run("reject", SglangAdapter.rejected, req, error_msg)
    return result


MAPPED_POOLS = ("MHATokenToKVPool",)  # the KV pool classes the adapter maps
MAPPED_TRANSFERS = ("fake",)  # PD transfer backends whose senders and receivers it hooks


def unmapped(scheduler: Any) -> list[str]:
    """What an SGLang scheduler runs that the adapter does not map, in words (none: [])."""
    found = []
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    kv = allocator.get_kvcache() if hasattr(allocator, "get_kvcache") else None
    if kv is not None and type(kv).__name__ not in MAPPED_POOLS:
        found.append(f"KV pool {type(kv).__name__} (MLA, SWA and hybrid pools are not mapped)")
    if getattr(scheduler, "is_hybrid_swa", False):
        found.append("hybrid sliding-window pools")
    if getattr(scheduler, "enable_hierarchical_cache", False):
        found.append("HiCache (the hierarchical cache)")
    mode = str(getattr(getattr(scheduler, "server_args", None), "disaggregation_mode", "null"))
    backend = getattr(scheduler, "transfer_backend", None)
    name = str(getattr(backend, "value", backend))
    if mode in ("prefill", "decode") and backend is not None and name not in MAPPED_TRANSFERS:
        found.append(f"PD transfer backend {name} (its senders and receivers override poll and send)")
    return found


def _scheduler_made(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    adapter = current()
    parts = unmapped(scheduler) if adapter is not None else []
    if adapter is not None and parts:
        adapter.attachment.refuse(
            f"kvguard: this SGLang setup is not mapped yet ({'; '.join(parts)}); "
            "not guarding it rather than guarding it wrongly"
        )
        return
    mode = str(getattr(scheduler.server_args, "disaggregation_mode", "null"))
    _run(
        "pool report",
        SglangAdapter.report_pool,
        scheduler.token_to_kv_pool_allocator,
        role=mode if mode in ("prefill", "decode") else "colocated",
        context_len=int(scheduler.model_config.context_len),
        req_to_token_pool=scheduler.req_to_token_pool,
        max_prompt_tokens=int(getattr(scheduler, "max_req_input_len", 0) or 0),
    )


def _run_batch(scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    if getattr(scheduler, "enable_overlap", False):
        # The overlap scheduler launches a step's kernels on its forward thread, after run_batch
        # returns: a step ends when the next begins, right before that one's check.
        _run("step done", SglangAdapter.step_done)
    if (
        batch is not None
        and getattr(batch, "reqs", None)
        and getattr(batch, "out_cache_loc", None) is not None
    ):
        _run(
            "forward step",
            SglangAdapter.forward_step,
            batch.reqs,
            batch.req_pool_indices,
            # The host copy SGLang keeps, where it has one: no device sync for the lengths.
            batch.seq_lens if getattr(batch, "seq_lens_cpu", None) is None else batch.seq_lens_cpu,
            batch.out_cache_loc,
            scheduler.req_to_token_pool,
            getattr(batch, "extend_lens", None),
        )


def _ran_batch(result: Any, scheduler: Any, *args: Any, **kwargs: Any) -> None:
    if not getattr(scheduler, "enable_overlap", False):  # the forward's kernels are launched
        _run("step done", SglangAdapter.step_done)


def _sender_init(sender: Any, *args: Any, **kwargs: Any) -> None:
    _run("sender init", SglangAdapter.sender_init, sender)


def _sender_send(
    sender: Any, kv_indices: Any, state_indices: Any = None, num_kv_tokens: Any = None, **kw: Any
) -> None:
    _run("sender send", SglangAdapter.sent, sender, kv_indices, num_kv_tokens)


def _polled(kind: str) -> Callable[..., Any]:
    method = SglangAdapter.sender_polled if kind == "sender" else SglangAdapter.receiver_polled

    def hook(original: Callable[..., Any], end: Any) -> Any:
        from sglang.srt.disaggregation.base.conn import KVPoll

        state = original(end)
        decided = _run(f"{kind} poll", method, end, state, KVPoll.Success, KVPoll.Failed)
        return state if decided is None else decided

    return hook


def _receiver_made(
    result: Any,
    receiver: Any,
    mgr: Any = None,
    bootstrap_addr: Any = None,
    bootstrap_room: Any = None,
    *args: Any,
    **kwargs: Any,
) -> None:
    _run("receiver init", SglangAdapter.receiver_made, receiver, bootstrap_room)


def _metadata_sent(
    result: Any,
    receiver: Any,
    kv_indices: Any,
    aux_index: Any = None,
    state_indices: Any = None,
    decode_prefix_len: Any = None,
    *args: Any,
    **kwargs: Any,
) -> None:
    _run("receiver metadata", SglangAdapter.reserved, receiver, kv_indices, decode_prefix_len)


def hooks() -> list[tuple[str, Callable[..., Any], str]]:
    """(target, hook, kind) of every hook, in SGLang's HookRegistry terms."""
    table = [
        (f"{ALLOC}.alloc", _handed_out, "AFTER"),
        (f"{ALLOC}.alloc_extend", _handed_out, "AFTER"),
        (f"{ALLOC}.alloc_decode", _decode_slots, "AFTER"),
        (f"{ALLOC}._release_page_ids", _released, "BEFORE"),
        (f"{ALLOC}.clear", _cleared, "AFTER"),
        (f"{TOKEN}.alloc", _handed_out, "AFTER"),
        (f"{TOKEN}.free", _token_free, "BEFORE"),
        (f"{ROWS}.alloc", _rows_alloc, "AROUND"),
        (f"{ROWS}.write", _rows_write, "AFTER"),
        (f"{ROWS}.free", _rows_free, "BEFORE"),
        (f"{RADIX}.insert", _inserted, "AFTER"),
        (f"{REQ}.set_finish_with_abort", _set_finish_with_abort, "AROUND"),
        (f"{SCHED}.__init__", _scheduler_made, "AFTER"),
        (f"{SCHED}.run_batch", _run_batch, "BEFORE"),
        (f"{SCHED}.run_batch", _ran_batch, "AFTER"),
    ]
    for sender in SENDERS:
        table += [
            (f"{sender}.init", _sender_init, "BEFORE"),
            (f"{sender}.send", _sender_send, "BEFORE"),
            (f"{sender}.poll", _polled("sender"), "AROUND"),
        ]
    for receiver in RECEIVERS:
        table += [
            (f"{receiver}.__init__", _receiver_made, "AFTER"),
            (f"{receiver}.send_metadata", _metadata_sent, "AFTER"),
            (f"{receiver}.poll", _polled("receiver"), "AROUND"),
        ]
    return table + receipts.hooks()  # the HTTP server's kvguard-receipt header


_registered = False


def _register() -> None:
    """Register the hooks that resolve in this SGLang, and apply them (idempotent)."""
    global _registered
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if not _registered:
        _registered = True
        for target, hook, kind in hooks():
            owner, _, attr = target.rpartition(".")
            try:
                if attr not in vars(pkgutil.resolve_name(owner)):
                    continue  # inherited here: hooked where it is defined
            except (ImportError, AttributeError) as exc:
                log.warning("kvguard: SGLang has no %s (%s): that hook is off", target, exc)
                continue
            HookRegistry.register(target, hook, HookType[kind])
    HookRegistry.apply_hooks()
