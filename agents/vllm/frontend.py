"""The vLLM API server's half of a kvguard stop: a request the engine core's guard stopped ends
for its client at once, with an HTTP error that says so (a stream: an error event), never
with vLLM's quiet `finish_reason: "abort"` and HTTP 200.

The engine core ends a stopped request with vLLM's own FinishReason.ERROR and kvguard's
message as its stop_reason (`Guard.told`, adapter.py). vLLM's API server turns ERROR into
HTTP 500 "Internal server error"; here, for a kvguard stop only, the words are kvguard's: the
finding's kind and the request id `kvguard audit request` finds, nothing of any other
request or tenant.

It also carries each request's tenant from where the deployment keeps it, which only the API
server sees, to the engine core: under KVGUARD_TENANT_FIELD `header:NAME` (a header the
gateway sets), `api-key` (the bearer token, hashed) or `user` (the OpenAI `user` field), the
tenant rides in the request's sampling_params.extra_args as `kvguard_tenant`, which the
engine core's tenant reader takes (tenants.tenant_reader). vLLM drops trace headers unless
tracing is on, so they cannot carry it. kvguard stamps that key on every request, so a
client's own `vllm_xargs` can never name its tenant.

Invariants: only outputs whose stop_reason carries kvguard's mark are touched, every other
call falls through to vLLM's own code unchanged; the table of stopped requests the API
server has not yet answered is bounded (the oldest is forgotten first).
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from kvguard.agents.guard.guard import STOPPED

log = logging.getLogger("kvguard.adapter")

MARK = STOPPED  # what the engine core's stop_reason begins with for a kvguard stop
LIMIT = 4096  # stopped requests whose client has not been answered yet, at most
_STOPPED: OrderedDict[str, str] = OrderedDict()  # vLLM's external request id -> message
_PATCHED: dict[str, Callable[..., Any]] = {}
TENANT_ARG = "kvguard_tenant"  # the key in a request's sampling_params.extra_args
_TENANT: contextvars.ContextVar[str] = contextvars.ContextVar("kvguard_tenant", default="")
_PENDING: OrderedDict[str, str] = OrderedDict()  # request id -> tenant, until it reaches the engine


def _user(headers: Mapping[str, str]) -> str:
    return _TENANT.get()


def tenant_from(field: str) -> Callable[[Mapping[str, str]], str] | None:
    """How the API server reads a request's tenant, for the sources only it sees (a header,
    the API key, the OpenAI `user` field: `_user`, read from the request being served);
    None for the others."""
    if field.startswith("header:"):
        name = field[len("header:") :].lower()
        return lambda headers: headers.get(name, "") or ""
    if field == "api-key":
        return lambda headers: api_key_tenant(headers.get("authorization", ""))
    if field == "user":
        return _user
    return None


def api_key_tenant(authorization: str) -> str:
    """A tenant named by its API key, never the key itself: `key-` and 16 hex digits of its
    SHA-256 ("" without a bearer token)."""
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return ""
    return "key-" + hashlib.sha256(token.strip().encode()).hexdigest()[:16]


def noted(external_id: str, reason: str) -> None:
    _STOPPED[external_id] = reason
    while len(_STOPPED) > LIMIT:
        _STOPPED.popitem(last=False)


def taken(request_id: str) -> str | None:
    """kvguard's message for a stopped request of this API request id, once. The completions
    endpoint names its engine requests `{id}-{n}` (one per prompt), hence the prefix."""
    reason = _STOPPED.pop(request_id, None)
    if reason is not None:
        return reason
    prefix = f"{request_id}-"
    for key in _STOPPED:
        if key.startswith(prefix):
            return _STOPPED.pop(key)
    return None


def install() -> bool:
    """Patch the API server's output path (once per process); False where vLLM has no such
    path (then a stopped request still ends, as vLLM's plain "Internal server error")."""
    if _PATCHED:
        return True
    try:
        from vllm.entrypoints.generate.base.serving import GenerateBaseServing
        from vllm.exceptions import GenerationError
        from vllm.v1.engine import FinishReason
        from vllm.v1.engine.output_processor import RequestState
    except ImportError as exc:
        log.warning(
            "kvguard: vLLM's API server path is not the one known (%s): stops read as plain errors", exc
        )
        return False

    make_output = RequestState.make_request_output
    raise_if_error = GenerateBaseServing._raise_if_error
    error = FinishReason.ERROR

    @functools.wraps(make_output)
    def make_request_output(
        self: Any,
        new_token_ids: Any,
        pooling_output: Any,
        finish_reason: Any,
        stop_reason: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if finish_reason == error and isinstance(stop_reason, str) and stop_reason.startswith(MARK):
            noted(self.external_req_id, stop_reason)
            if self.parent_req is not None:
                noted(self.parent_req.external_req_id, stop_reason)
        return make_output(self, new_token_ids, pooling_output, finish_reason, stop_reason, *args, **kwargs)

    @functools.wraps(raise_if_error)
    def _raise_if_error(self: Any, finish_reason: str | None, request_id: str) -> None:
        if finish_reason == "error":
            reason = taken(request_id)
            if reason is not None:
                log.warning("%s", reason)
                raise GenerationError(reason)
        return raise_if_error(self, finish_reason, request_id)

    _PATCHED["RequestState.make_request_output"] = make_output
    _PATCHED["GenerateBaseServing._raise_if_error"] = raise_if_error
    RequestState.make_request_output = make_request_output
    GenerateBaseServing._raise_if_error = _raise_if_error
    read = tenant_from(os.environ.get("KVGUARD_TENANT_FIELD", ""))
    if read is not None:
        _carry_tenants(read)
    return True


def _carry_tenants(read: Callable[[Mapping[str, str]], str]) -> None:
    """The tenant, read where the API server has it (headers: when the serving code asks for
    their trace headers; `user`: when it starts serving the request), noted by request id when
    the serving code asks for its generator, and stamped on every request's sampling
    parameters as it goes to the engine core (AsyncLLM.add_request)."""
    from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.serve.engine.serving import BaseServing
    from vllm.v1.engine.async_llm import AsyncLLM

    trace_headers = BaseServing._get_trace_headers

    @functools.wraps(trace_headers)
    async def _get_trace_headers(self: Any, headers: Mapping[str, str]) -> Mapping[str, str] | None:
        if read is not _user:  # a header or the API key
            _TENANT.set(read(headers))
        return await trace_headers(self, headers)

    generate, add_request = AsyncLLM.generate, AsyncLLM.add_request

    @functools.wraps(generate)
    def gen(self: Any, prompt: Any, params: Any, request_id: str, *args: Any, **kwargs: Any) -> Any:
        # Called in the serving code's own task; the generator may run in another (a stream's).
        _PENDING[request_id] = _TENANT.get()
        while len(_PENDING) > LIMIT:
            _PENDING.popitem(last=False)
        return generate(self, prompt, params, request_id, *args, **kwargs)

    @functools.wraps(add_request)
    async def add(self: Any, request_id: str, prompt: Any, params: Any, *args: Any, **kwargs: Any) -> Any:
        if hasattr(params, "extra_args"):  # stamped on every request: never the client's vllm_xargs
            params.extra_args = {**(params.extra_args or {}), TENANT_ARG: _PENDING.pop(request_id, "")}
        return await add_request(self, request_id, prompt, params, *args, **kwargs)

    _PATCHED["BaseServing._get_trace_headers"] = trace_headers
    _PATCHED["AsyncLLM.generate"] = generate
    _PATCHED["AsyncLLM.add_request"] = add_request
    BaseServing._get_trace_headers = _get_trace_headers
    AsyncLLM.generate = gen
    AsyncLLM.add_request = add
    if read is not _user:
        return
    for cls, name in (
        (OpenAIServingChat, "create_chat_completion"),
        (OpenAIServingCompletion, "create_completion"),
    ):

        def with_user(serve: Callable[..., Any]) -> Callable[..., Any]:
            @functools.wraps(serve)
            async def hook(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
                _TENANT.set(str(getattr(request, "user", None) or ""))  # this request's context only
                return await serve(self, request, *args, **kwargs)

            return hook

        _PATCHED[f"{cls.__name__}.{name}"] = getattr(cls, name)
        setattr(cls, name, with_user(getattr(cls, name)))
