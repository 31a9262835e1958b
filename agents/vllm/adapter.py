"""kvguard inside vLLM's v1 engine core (0.32, 0.33; `VllmAdapter`): class patches on
`KVCacheManager` and `Scheduler` that report each change of KV-block ownership to the guard.

Invariants: the patches are installed once per process and dispatch by manager instance
(each guarded manager carries its `PoolState`); every hook runs kvguard's part through
`Attachment.contain`, so a kvguard failure never raises into vLLM; vLLM is interrupted only
to end the requests a verdict names, through its own error path
(`Scheduler.finish_requests(ids, FINISHED_ERROR)`), before the forward of the step (after
it, for a request whose KV a synchronous connector loaded in it: before its token leaves),
and each such request's client is sent its end, in kvguard's words (outputs.py `tell`, frontend.py).

What each hook maps to:
- `KVCacheManager.__init__` -> `pool` (num_blocks, block_size, reserved_pages=1 for the null
  block, context_len = max_model_len, role from kv_transfer_config: kv_producer -> prefill,
  kv_consumer -> decode, else colocated). Only one full-attention group is mapped; any other
  layout (hybrid, sliding window, Mamba, context parallel) is left unguarded, said in one line.
- `allocate_slots` for the waiting queue (its turn begins at `_handle_blocked_waiting_request`)
  -> `admit` (first blocks of a request), `share` (prefix-cache hits: the blocks vLLM appended
  from new_computed_blocks, origin = the request each block was last granted to), and new
  grants (including blocks for connector-loaded tokens), kept until the step. The running
  loop's calls (one a running request, a step) run vLLM's method unwrapped: their grants are
  the SchedulerOutput's new_block_ids, reported by the step. Eviction names no request: it is
  the grant of the block to someone else.
- `free` / `pop_blocks_for_free` -> `free` (the request's blocks, in vLLM's reverse order);
  preemption is such a free, then hits on its own freed blocks when it resumes.
- `Scheduler.schedule` -> one `Guard.step` per step, from its SchedulerOutput (what the workers
  run) and kvguard's incremental tables (tables.py): the KV each scheduled request writes
  (the blocks its scheduled tokens land in, slots valid after the write), its grants, and
  the check of its block table up to its context; killed requests are aborted and taken out
  of the SchedulerOutput before it reaches the workers.
- `Scheduler._free_request` -> `finish` (stopped, length) or `abort` (aborted, ignored, error).
- KV connectors (decode pool = kv_consumer): a request granted blocks for external tokens gets a
  `bootstrap` (prefill node = its kv_transfer_params' remote engine, prompt_tokens = the
  external tokens it waits for). `Scheduler.update_from_output`, before vLLM reacts to the
  worker's kv_connector_output (failure handling, promotion, frees): `xfer_recv` for each
  finished_recving (state.py: what landed), `xfer_send` + `release` for finished_sending;
  for a load a synchronous connector made in the step's forward: `xfer_recv` of what the
  workers' load witness saw land (witness.py), then that request's step, checked.
- A finished request whose blocks vLLM keeps for the connector (delay_free_blocks: a send
  still to go, a load still in flight) -> `hold` (transfer_send / transfer_recv) until then.
Tenants: tenants.py.
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
import types
from collections.abc import Callable
from typing import Any

import numpy as np

from kvguard.agents.attach import Attachment, EngineAttach, Settings
from kvguard.agents.vllm import witness
from kvguard.agents.vllm.outputs import strip, tell
from kvguard.agents.vllm.state import EMPTY, PoolState
from kvguard.agents.vllm.tenants import tenant_reader

log = logging.getLogger("kvguard.adapter")

_ACTIVE: VllmAdapter | None = None  # the adapter the class patches dispatch to
_ORIGINAL: dict[str, Callable[..., Any]] = {}
_LOCK = threading.Lock()
ROLES = {"kv_producer": "prefill", "kv_consumer": "decode"}


def _state(manager: Any) -> PoolState | None:
    return manager.__dict__.get("_kvguard")


class VllmAdapter:
    """kvguard's attachment to the vLLM engine core of this process. With an `Attachment`
    (tests), that guard is used; without one, it is made from the environment when the first
    KV cache manager is built (`Settings.from_env()`), in the engine-core process only."""

    def __init__(
        self,
        attachment: Attachment | None = None,
        *,
        settings: Settings | None = None,
        engine_version: str | None = None,
    ) -> None:
        self.engine_version = engine_version
        self.lifecycle = EngineAttach(
            "vllm", self._version, settings=settings, attachment=attachment, on_kill=self._on_kill
        )
        self.pools = 0
        self._config = threading.local()  # the VllmConfig of a Scheduler being built
        self._external_kills: dict[str, str] = {}  # ordered by the daemon, applied at the next step
        self._told: list[tuple[int, str, str]] = []  # stopped: (client, request, why) to send out

    # ------------------------------------------------------------------ install

    def install(self) -> VllmAdapter:
        """Patch vLLM's classes (once per process) and make this the adapter they report to."""
        global _ACTIVE
        with _LOCK:
            if not _ORIGINAL:
                _patch()
            _ACTIVE = self
        return self

    @property
    def attachment(self) -> Attachment | None:
        return self.lifecycle.made

    @property
    def refused(self) -> str:
        """Why this engine is not guarded ("" while it is)."""
        return self.lifecycle.refused

    def _version(self) -> str:
        import vllm

        return self.engine_version or vllm.__version__

    def _on_kill(self, req: str, reason: str) -> None:
        # The daemon's command arrives on the sink's thread: vLLM's scheduler is not
        # thread-safe, so the abort waits for the scheduler's next step.
        self._external_kills[req] = reason

    # ------------------------------------------------------------------ KV cache manager

    def on_manager(self, manager: Any, bound: inspect.BoundArguments) -> None:
        attachment = self.lifecycle.attachment()
        if attachment is None:
            return
        attachment.contain("KVCacheManager.__init__", self._pool, attachment, manager, bound)

    def _pool(self, attachment: Attachment, manager: Any, bound: inspect.BoundArguments) -> None:
        args = bound.arguments
        cfg = args["kv_cache_config"]
        groups = cfg.kv_cache_groups
        from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

        spec = groups[0].kv_cache_spec if len(groups) == 1 else None
        if (
            spec is None
            or not isinstance(spec, FullAttentionSpec)
            or isinstance(spec, SlidingWindowSpec)
            or args.get("dcp_world_size", 1) != 1
            or args.get("pcp_world_size", 1) != 1
        ):
            attachment.refuse(
                f"kvguard: this vLLM KV cache layout ({len(groups)} group(s), "
                f"{type(spec).__name__ if spec is not None else 'hybrid'}, context parallel "
                f"{args.get('dcp_world_size', 1)}/{args.get('pcp_world_size', 1)}) is not mapped yet; "
                "not guarding it rather than guarding it wrongly"
            )
            return
        vllm_config = getattr(self._config, "value", None)
        kv_transfer = getattr(vllm_config, "kv_transfer_config", None)
        role = ROLES.get(getattr(kv_transfer, "kv_role", "") or "", "colocated")
        model_config = getattr(vllm_config, "model_config", None)

        pool = self.pools
        self.pools += 1
        settings = attachment.settings
        state = PoolState(
            attachment,
            pool,
            manager.coordinator.single_type_managers[0],
            spec.block_size,
            cfg.num_blocks,
            manager.block_pool.null_block.block_id,
            "decode" if role == "decode" else "prefill",
            tenant_reader(settings.tenant_field),
            paired=role == "decode",
        )
        manager.__dict__["_kvguard"] = state
        state.direct_allocate = types.MethodType(_ORIGINAL["KVCacheManager.allocate_slots"], manager)
        state.take(
            attachment.guard.pool(
                pool,
                role,
                spec.block_size,
                cfg.num_blocks,
                engine="vllm",
                engine_version=self._version(),
                model=str(getattr(model_config, "served_model_name", "") or ""),
                context_len=int(args["max_model_len"]),
                reserved_pages=1,
                cluster=settings.cluster,
            )
        )
        log.warning(
            "kvguard: guarding vLLM %s pool %d (%s, %d blocks of %d, context %d, %s mode); %s",
            self._version(),
            pool,
            role,
            cfg.num_blocks,
            spec.block_size,
            int(args["max_model_len"]),
            settings.mode,
            settings.tenants(),
        )

    def allocate_slots(
        self,
        orig: Callable[..., Any],
        manager: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        bind: Callable[..., inspect.BoundArguments],
    ) -> Any:
        state = _state(manager)
        if state is None or not state.attachment.active:
            if state is not None and state.attachment.stopped:
                return None  # KVGUARD_ON_FAILURE=stop: nothing new gets blocks
            return orig(manager, *args, **kwargs)
        request = args[0] if args else kwargs["request"]
        rid = request.request_id
        before = len(state.vllm_table(rid))
        result = orig(manager, *args, **kwargs)
        # vLLM calls this for every running request on every step, and most decode steps
        # grant nothing: for an admitted request whose blocks did not grow there is nothing
        # to report, and its call is not even bound.
        if result is not None and (rid not in state.admitted or len(state.vllm_table(rid)) != before):
            self.allocated(state, bind(manager, *args, **kwargs), before)
        return result

    def allocated(self, state: PoolState, bound: inspect.BoundArguments, before: int) -> None:
        """What allocate_slots granted past the request's first `before` blocks (its result
        is the engine's: returned as it was)."""
        args = bound.arguments
        request = args["request"]
        hit = args.get("new_computed_blocks")
        n_hit = len(hit.blocks[0]) if hit is not None else 0
        local = request.num_computed_tokens + args.get("num_new_computed_tokens", 0)
        external = args.get("num_external_computed_tokens", 0)
        # delay_cache_blocks is vLLM's "the connector loads asynchronously": without it the
        # load happens in the worker, inside this step's forward.
        in_step = not args.get("delay_cache_blocks", False)
        state.attachment.contain(
            "allocate_slots", state.allocated, request, before, n_hit, local, external, in_step
        )

    def free(self, orig: Callable[..., Any], manager: Any, request: Any) -> Any:
        state = _state(manager)
        if state is None or not state.attachment.active:
            return orig(manager, request)
        blocks = state.attachment.contain("free", state.freeing, request.request_id)
        result = orig(manager, request)
        if blocks is not None:
            state.attachment.contain("free", state.freed, request.request_id, blocks)
        return result

    def pop_blocks_for_free(self, orig: Callable[..., Any], manager: Any, request: Any) -> Any:
        blocks = orig(manager, request)
        state = _state(manager)
        if state is not None and state.attachment.active:
            ids = np.fromiter((b.block_id for b in blocks), np.int64, len(blocks)) if blocks else EMPTY
            state.attachment.contain("pop_blocks_for_free", state.freed, request.request_id, ids)
        return blocks

    # ------------------------------------------------------------------ scheduler

    def scheduler_init(self, orig: Callable[..., Any], scheduler: Any, bound: inspect.BoundArguments) -> None:
        self._config.value = bound.arguments.get("vllm_config")
        try:
            orig(*bound.args, **bound.kwargs)
        finally:
            self._config.value = None
        state = _state(scheduler.kv_cache_manager)
        if state is not None and getattr(scheduler, "defer_async_loads", False):
            # 0.33 with HiSparse on an overlapping consumer: loads start steps after their
            # blocks are granted, fenced by steps the adapter does not follow.
            state.attachment.refuse(
                "kvguard: vLLM's deferred async loads (HiSparse on an overlapping KV consumer) "
                "are not mapped yet; not guarding it rather than guarding it wrongly"
            )

    def schedule(self, orig: Callable[..., Any], scheduler: Any, args: Any, kwargs: Any) -> Any:
        manager = scheduler.kv_cache_manager
        state = _state(manager)
        if state is not None and self._external_kills:
            # The daemon's kills, on the scheduler's own thread, before this step allocates.
            kills, self._external_kills = self._external_kills, {}
            state.attachment.contain("schedule (daemon kill)", self._stop, state, scheduler, None, kills)
        if state is None or not state.attachment.active:
            return orig(scheduler, *args, **kwargs)
        # The running loop calls allocate_slots once a running request, most granting nothing:
        # it runs vLLM's own method (the step reports its grants from the SchedulerOutput),
        # until the waiting queue's turn (`waiting_turn`).
        manager.__dict__["allocate_slots"] = state.direct_allocate
        try:
            out = orig(scheduler, *args, **kwargs)
        finally:
            manager.__dict__.pop("allocate_slots", None)
        kills = state.attachment.contain("schedule", self._step, state, out) or {}
        if kills:
            state.attachment.contain("schedule (stop)", self._stop, state, scheduler, out, kills)
        return out

    def waiting_turn(self, scheduler: Any) -> None:
        """The scheduler turns to a waiting request: its allocate_slots is kvguard's again (admission,
        prefix hits, connector loads are seen there)."""
        scheduler.kv_cache_manager.__dict__.pop("allocate_slots", None)

    def _step(self, state: PoolState, out: Any) -> dict[str, str]:
        kills = dict(state.kills)  # ended at allocation (a denied share): not in the step
        kills.update(state.step(out))
        return kills

    def _stop(self, state: PoolState, scheduler: Any, out: Any | None, kills: dict[str, str]) -> None:
        """End the condemned requests through vLLM's own error path (FINISHED_ERROR: their
        blocks freed, out of this step's batch), and tell each client why, with the outputs
        of the next update_from_output (`_told`)."""
        from vllm.v1.request import RequestStatus

        for req, why in kills.items():
            log.warning("kvguard: stopping vLLM request %s: %s", req, why)
        for request in scheduler.finish_requests(list(kills), RequestStatus.FINISHED_ERROR):
            rid = request.request_id
            self._told.append((request.client_index, rid, state.guard.told(rid)))
        if out is not None:
            strip(out, set(kills))

    def free_request(self, orig: Callable[..., Any], scheduler: Any, args: Any, kwargs: Any) -> Any:
        request = args[0] if args else kwargs["request"]
        state = _state(scheduler.kv_cache_manager)
        if state is not None and state.attachment.active:
            state.attachment.contain("_free_request", self._ended, state, request)
        result = orig(scheduler, *args, **kwargs)
        if state is not None:
            state.admitted.discard(request.request_id)
            if state.attachment.active and request.request_id in scheduler.requests:
                # vLLM kept its blocks for the connector (delay_free_blocks): held until then.
                state.attachment.contain("_free_request (delayed)", state.held_for_connector, request)
        return result

    def _ended(self, state: PoolState, request: Any) -> None:
        from vllm.v1.request import RequestStatus

        rid, status = request.request_id, request.status
        if rid not in state.admitted:
            return  # it never got blocks: nothing of it is in the ledger
        if status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED):
            state.take(state.guard.finish(rid, request.num_output_tokens))
        else:
            state.take(state.guard.abort(rid, status.name.lower()))

    def update_from_output(self, orig: Callable[..., Any], scheduler: Any, args: Any, kwargs: Any) -> Any:
        state = _state(scheduler.kv_cache_manager)
        runner = args[1] if len(args) > 1 else kwargs.get("model_runner_output")
        output = getattr(runner, "kv_connector_output", None)
        # The workers' load witness rides in invalid_block_ids: taken out before vLLM reads it.
        invalid = getattr(output, "invalid_block_ids", None)
        witnessed, unchanged = witness.taken(invalid) if isinstance(invalid, set) else (False, EMPTY)
        if state is not None and state.attachment.active:
            if output is not None:
                # Before vLLM reacts (rewinds, fails, promotes or frees): what the worker reports.
                state.attachment.contain(
                    "update_from_output (connector)", self._xfer, state, scheduler, output
                )
            if state.after_forward:
                # Loads made in the forward, checked before vLLM hands out what it computed:
                # a request stopped here has its sampled tokens dropped by vLLM itself.
                forwarded = state.attachment.contain(
                    "update_from_output (loads)", state.forwarded, witnessed, unchanged
                )
                if forwarded:
                    state.attachment.contain(
                        "update_from_output (stop)", self._stop, state, scheduler, None, forwarded
                    )
        result = orig(scheduler, *args, **kwargs)
        if state is not None and state.attachment.active:
            # The step's forward has run: its kernels are launched, the next launch needs a check
            # (vLLM's async scheduling checks step N+1 before this: its launches are then judged
            # against a closed step; run the launch witness without --async-scheduling).
            state.attachment.contain("step done", state.guard.step_done)
        if self._told and isinstance(result, dict):
            told, self._told = self._told, []
            result = tell(result, told)
        return result

    def _xfer(self, state: PoolState, scheduler: Any, output: Any) -> None:
        state.flush(list(state.pending))
        invalid = np.fromiter(output.invalid_block_ids or (), np.int64)
        failed = output.failed_recving or set()
        for rid in sorted(output.finished_recving or ()):
            state.received(rid, scheduler.requests.get(rid), invalid, rid in failed)
        for rid in sorted(output.finished_sending or ()):
            state.sent(rid, scheduler.requests.get(rid))


def _bound(fn: Callable[..., Any]) -> Callable[..., inspect.BoundArguments]:
    sig = inspect.signature(fn)

    def bind(*args: Any, **kwargs: Any) -> inspect.BoundArguments:
        bound = sig.bind(*args, **kwargs)
        bound.apply_defaults()
        return bound

    return bind


def _patch() -> None:
    """Wrap vLLM's methods; each wrapper hands over to the active adapter."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler

    def wrap(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        orig = getattr(cls, name)
        _ORIGINAL[f"{cls.__name__}.{name}"] = orig
        setattr(cls, name, functools.wraps(orig)(make(orig)))

    def init(orig: Callable[..., Any]) -> Callable[..., Any]:
        bind = _bound(orig)

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            orig(self, *args, **kwargs)
            if _ACTIVE is not None:
                _ACTIVE.on_manager(self, bind(self, *args, **kwargs))

        return __init__

    def allocate(orig: Callable[..., Any]) -> Callable[..., Any]:
        bind = _bound(orig)

        def allocate_slots(self: Any, *args: Any, **kwargs: Any) -> Any:
            if _ACTIVE is None or "_kvguard" not in self.__dict__:
                return orig(self, *args, **kwargs)
            return _ACTIVE.allocate_slots(orig, self, args, kwargs, bind)

        return allocate_slots

    def by_request(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def hook(self: Any, request: Any) -> Any:
                if _ACTIVE is None or "_kvguard" not in self.__dict__:
                    return orig(self, request)
                return getattr(_ACTIVE, method)(orig, self, request)

            return hook

        return make

    def sched_init(orig: Callable[..., Any]) -> Callable[..., Any]:
        bind = _bound(orig)

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            if _ACTIVE is None:
                return orig(self, *args, **kwargs)
            return _ACTIVE.scheduler_init(orig, self, bind(self, *args, **kwargs))

        return __init__

    def delegate(method: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        """A hook that hands the call to the active adapter's `method(orig, self, args, kwargs)`."""

        def make(orig: Callable[..., Any]) -> Callable[..., Any]:
            def hook(self: Any, *args: Any, **kwargs: Any) -> Any:
                if _ACTIVE is None:
                    return orig(self, *args, **kwargs)
                return getattr(_ACTIVE, method)(orig, self, args, kwargs)

            return hook

        return make

    def waiting(orig: Callable[..., Any]) -> Callable[..., Any]:
        def hook(self: Any, request: Any) -> Any:
            if _ACTIVE is not None:
                _ACTIVE.waiting_turn(self)
            return orig(self, request)

        return hook

    wrap(KVCacheManager, "__init__", init)
    wrap(KVCacheManager, "allocate_slots", allocate)
    wrap(KVCacheManager, "free", by_request("free"))
    wrap(KVCacheManager, "pop_blocks_for_free", by_request("pop_blocks_for_free"))
    wrap(Scheduler, "__init__", sched_init)
    wrap(Scheduler, "schedule", delegate("schedule"))
    wrap(Scheduler, "_free_request", delegate("free_request"))
    wrap(Scheduler, "_handle_blocked_waiting_request", waiting)
    wrap(Scheduler, "update_from_output", delegate("update_from_output"))


def attach(attachment: Attachment | None = None, **kwargs: Any) -> VllmAdapter:
    """Install kvguard's vLLM hooks in this process, with this attachment (or one made from
    the environment when the first KV cache manager is built)."""
    return VllmAdapter(attachment, **kwargs).install()
