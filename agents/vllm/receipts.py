"""vLLM's API server names each response's receipts (the `kvguard-receipt` header,
agents/receipt_header.py): the middleware is added to every app the server builds, and the
output processor's `add_request`, which every engine request passes (each child of `n > 1`
too), notes its id. vLLM names an engine request by the API's id plus 8 random characters (its
internal id); the engine core's guard knows it by that name, so the header names those.

Invariant: a PD prefill server (kv_producer) sets no header: its client is the router, and the
receipt is the decode's.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from kvguard.agents.receipt_header import HEADER, ReceiptHeader, noted

log = logging.getLogger("kvguard.adapter")

_PATCHED: dict[str, Callable[..., Any]] = {}


def install() -> bool:
    """Patch the app builder and the output processor (once per process); False where vLLM's
    are not the ones known (then responses carry no header)."""
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
