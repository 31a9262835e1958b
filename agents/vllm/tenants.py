"""Where the engine core reads a request's tenant (`tenant_reader`), from the operator's
KVGUARD_TENANT_FIELD (the start-up line says so: `Settings.tenants`).

Tenants: `settings.tenant_field` (KVGUARD_TENANT_FIELD) names where a request's tenant is
read: empty or `cache_salt` (the default): the request's cache_salt; `header:NAME`,
`api-key`, `user`: what the API server stamped (frontend.py; without it, the trace header
NAME); `attr:PATH` (or a bare PATH): the dotted attribute path on the Request (e.g.
`lora_request.lora_name`). A request with no value there has tenant "": unknown, which
the ledger never judges as a cross-tenant share (vLLM shares unsalted prefixes among all
unsalted requests, which it treats as one tenant).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvguard.agents.vllm.frontend import TENANT_ARG


def tenant_reader(field: str) -> Callable[[Any], str]:
    """How a request's tenant is read, from the operator's KVGUARD_TENANT_FIELD."""
    if not field or field == "cache_salt":
        return lambda request: request.cache_salt or ""
    if field.startswith("header:") or field in ("api-key", "user"):
        # The API server stamps it on the sampling parameters (frontend.py); without the API
        # server (vLLM as a library), a trace header of that name is the tenant.
        name = field[len("header:") :] if field.startswith("header:") else ""

        def stamped(request: Any) -> str:
            extra = getattr(request.sampling_params, "extra_args", None) or {}
            if TENANT_ARG in extra:
                return str(extra[TENANT_ARG] or "")
            return str((request.trace_headers or {}).get(name, "") or "") if name else ""

        return stamped
    path = field[len("attr:") :].split(".") if field.startswith("attr:") else field.split(".")

    def read(request: Any) -> str:
        value = request
        for part in path:
            value = getattr(value, part, None)
            if value is None:
                return ""
        return str(value)

    return read
