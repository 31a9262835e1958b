"""SGLang's HTTP server names each response's receipts (the `kvguard-receipt` header,
agents/receipt_header.py). SGLang names a request by its `rid` from the tokenizer manager to
the scheduler, where the guard knows it by that name, and its OpenAI responses carry it as
their `id`: the header names the rids the tokenizer manager dispatched for the HTTP request.

Hooks (SGLang's HookRegistry, registered by plugin.py in SGLang's main process only, the one
that serves HTTP: its schedulers never import the tokenizer manager): the tokenizer manager's
`__init__` adds the middleware to the HTTP server's app, which is built and not yet serving
then (an offline `sglang.Engine` has none: nothing is added); `_mark_state_dispatched`, which
every request reaching a scheduler passes, notes its rid.
"""

from __future__ import annotations

import logging
import multiprocessing
import sys
from collections.abc import Callable
from typing import Any

from kvguard.agents.receipt_header import HEADER, ReceiptHeader, noted

log = logging.getLogger("kvguard.adapter")

TOKENIZER = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
HTTP_SERVER = "sglang.srt.entrypoints.http_server"


def _tokenizer_made(result: Any, manager: Any, *args: Any, **kwargs: Any) -> None:
    server = sys.modules.get(HTTP_SERVER)
    app = getattr(server, "app", None)
    if app is None or any(m.cls is ReceiptHeader for m in getattr(app, "user_middleware", ())):
        return
    try:
        app.add_middleware(ReceiptHeader)
    except RuntimeError as exc:  # already serving: Starlette takes no middleware then
        log.warning("kvguard: SGLang's HTTP app is serving already (%s): no %s header", exc, HEADER)


def _dispatched(result: Any, manager: Any, rid: Any, *args: Any, **kwargs: Any) -> None:
    noted(str(rid))


def hooks() -> list[tuple[str, Callable[..., Any], str]]:
    """(target, hook, kind) in SGLang's HookRegistry terms; none outside its main process."""
    if multiprocessing.parent_process() is not None:
        return []
    return [
        (f"{TOKENIZER}.__init__", _tokenizer_made, "AFTER"),
        (f"{TOKENIZER}._mark_state_dispatched", _dispatched, "AFTER"),
    ]
