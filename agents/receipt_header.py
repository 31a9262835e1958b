"""The `kvguard-receipt` response header an engine's HTTP server sets: the ids under which the
guard knows the engine requests an HTTP request made, so that its client can fetch and check
their receipts (`kvguard audit receipt ID`, `kvguard audit verify-receipt`).

An ASGI middleware (`ReceiptHeader`) gives each HTTP request a list in a context variable,
which the tasks serving it share; an engine's adapter calls `noted(id)` where each engine
request is made (agents/vllm/receipts.py, agents/sglang/receipts.py). The response's start is
held until its first body part, by which time the engine requests exist (a stream's headers
would otherwise leave before them).

Invariants: a response names only the engine requests its own HTTP request made, each once,
in the order they were made; one that made none (a health check, a request refused before the
engine) is passed unchanged.
"""

from __future__ import annotations

import contextvars
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

HEADER = "kvguard-receipt"
_IDS: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("kvguard_receipt_ids", default=None)

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
