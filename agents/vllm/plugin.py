"""The `vllm.general_plugins` entry point: vLLM calls `register()` in every process it starts
(API server, engine core, workers), so it only patches classes (the engine core's KV and
scheduler classes, and the API server's output path: frontend.py); the guard itself is made
when the first KV cache manager is built, which happens in the engine-core process only.

Invariant: `register()` never raises into vLLM and is idempotent; with KVGUARD_DISABLE=1 it
does nothing.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("kvguard.adapter")


def register() -> None:
    if os.environ.get("KVGUARD_DISABLE", "") == "1":
        return
    try:
        from kvguard.agents.vllm import adapter, frontend, receipts, witness

        if adapter._ACTIVE is None:
            adapter.VllmAdapter().install()
        # The API server's half: a request the engine core stopped reads as kvguard's error;
        # the workers' half: what a synchronous connector's loads really filled.
        frontend.install()
        receipts.install()  # each response names its requests' receipts
        witness.install()
    except Exception as exc:  # kvguard's own defect: vLLM starts unguarded
        log.error(
            "kvguard: vLLM plugin failed to install (%s: %s); vLLM runs unguarded", type(exc).__name__, exc
        )
