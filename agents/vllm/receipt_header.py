"""The vLLM API server's `kvguard-receipt` response header: the ids under which kvguard knows
the engine requests an HTTP request made, so that its client can fetch and check their
receipts (`kvguard audit receipt ID`, `kvguard audit verify-receipt`).

vLLM names an engine request by the API's id plus 8 random characters (its internal id), and
the engine core's guard knows it by that name only: the header names those. An ASGI middleware
gives each HTTP request a list in a context variable, which the tasks serving it share; the
output processor's `add_request`, which every engine request passes (each child of `n > 1`
too), appends its id there. The response's start is held until its first body part, by which
time the engine requests exist (a stream's headers would otherwise leave before them).

Invariants: a response names only the engine requests its own HTTP request made; one that made
none (a health check, a request refused before the engine) is passed unchanged; a PD prefill
server (kv_producer) sets no header: its client is the router, and the receipt is the decode's.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

log = logging.getLogger("kvguard.adapter")

HEADER = "kvguard-receipt"
_IDS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("kvguard_receipt_ids", default=None)
_PATCHED: dict[str, Callable[..., Any]] = {}

Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]


class ReceiptHeader:
    """ASGI middleware: each HTTP response names the engine requests it answers."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Send) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        ids: list[str] = []
        token = _IDS.set(ids)
        held: list[Message] = []

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                held.append(message)  # until the first body part: the engine requests exist then
                return
            if held:
                start = held.pop()
                if ids:
                    value = ", ".join(dict.fromkeys(ids)).encode("latin-1")
                    start["headers"] = [*start.get("headers", []), (HEADER.encode(), value)]
                await send(start)
            await send(message)

        try:
            await self.app(scope, receive, send_named)
        finally:
            _IDS.reset(token)


def noted(request_id: str) -> None:
    """An engine request made while serving the current HTTP request (none: outside one)."""
    ids = _IDS.get()
    if ids is not None:
        ids.append(request_id)


def install() -> bool:
    """Add the middleware to every app the API server builds and note each engine request's
    id (once per process); False where vLLM's app builder or output path is not the one known
    (then responses carry no header)."""
    if _PATCHED:
        return True
    try:
        from vllm.entrypoints.launchers import app as launcher
        from vllm.v1.engine.output_processor import OutputProcessor
    except ImportError as exc:
        log.warning("kvguard: vLLM's API app is not the one known (%s): no %s header", exc, HEADER)
        return False
    init_middleware, add_request = launcher.init_entrypoints_middleware, OutputProcessor.add_request

    @functools.wraps(init_middleware)
    def init_entrypoints_middleware(args: Any, app: Any, *rest: Any, **kwargs: Any) -> Any:
        done = init_middleware(args, app, *rest, **kwargs)
        if _role(args) == "kv_producer":
            log.info("kvguard: a PD prefill server: no %s header (the decode's response names it)", HEADER)
        else:
            app.add_middleware(ReceiptHeader)
        return done

    @functools.wraps(add_request)
    def add(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        noted(request.request_id)
        return add_request(self, request, *args, **kwargs)

    _PATCHED["init_entrypoints_middleware"] = init_middleware
    _PATCHED["OutputProcessor.add_request"] = add_request
    launcher.init_entrypoints_middleware = init_entrypoints_middleware
    OutputProcessor.add_request = add
    return True


def _role(args: Any) -> str:
    """The server's KV transfer role (`kv_producer`, `kv_consumer`, `kv_both`; "" without one)."""
    config = getattr(args, "kv_transfer_config", None)
    if isinstance(config, dict):
        return str(config.get("kv_role") or "")
    return str(getattr(config, "kv_role", "") or "")
