"""The testbed's OpenAI-compatible HTTP API, served as vLLM and SGLang serve theirs (FastAPI on
uvicorn): /v1/models, /v1/completions and /v1/chat/completions, each answered whole or
streamed (Server-Sent Events in OpenAI's chunk shape, ending `data: [DONE]`). The API key is
the tenant. /admin/flush asks the workers for their guards' findings (tests, the demo).

Invariants: every error reaches the client in OpenAI's shape ({"error": {"message", "type",
"param", "code"}}): before a stream starts as an HTTP status (400 for a request that fails
validation, 500 for one kvguard terminated), after it as an error event followed by
`data: [DONE]`; a stream never ends in silence, and a failed request's stream carries no text
after its error.
"""

from __future__ import annotations

import codecs
import json
import socket
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Annotated, Any, Literal

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from starlette.exceptions import HTTPException

from kvguard.testbed.router import MODEL, RECEIPT_HEADER, TENANT, ApiError, Plan, Router

MAX_BODY_BYTES = 1 << 20
SHUTDOWN_GRACE_S = 5  # for streams in flight to end when the server stops

PositiveInt = Annotated[int, Field(strict=True, ge=1)]


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Request(BaseModel):
    # Clients send sampling parameters the echo model has no use for (temperature, top_p, ...).
    model_config = ConfigDict(extra="allow")

    model: str = MODEL
    max_tokens: PositiveInt | None = None
    n: Literal[1] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None


def _one_prompt(value: Any) -> str:
    # One prompt: a string, or a list holding one string (a batch of several is not served).
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, str) or not value:
        raise ValueError(
            "must be a non-empty string (or a list of one); token ids and batches are not served"
        )
    return value


class CompletionRequest(_Request):
    prompt: Annotated[str, BeforeValidator(_one_prompt)]


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None

    def prompt(self) -> str:
        """The echo model's prompt: the messages' contents, one a line."""
        return "\n".join(m.text() for m in self.messages)


def _tenant(request: Request) -> str:
    auth = request.headers.get("Authorization", "")
    tenant = auth[7:].strip() if auth.startswith("Bearer ") else ""
    if not TENANT.match(tenant):
        raise ApiError(
            401, "missing or malformed API key (Authorization: Bearer <tenant>)", code="invalid_api_key"
        )
    return tenant


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def _usage(plan: Plan, completion_tokens: int) -> dict[str, int]:
    prompt = len(plan.tokens)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
    }


class _Shape:
    """How one endpoint's answers look: whole, and as stream chunks."""

    def __init__(self, chat: bool, plan: Plan) -> None:
        self.chat, self.plan = chat, plan
        self.id = ("chatcmpl-" if chat else "") + plan.req
        self.created = int(time.time())

    def _envelope(self, kind: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": MODEL, "choices": choices}

    def whole(self, text: str, completion_tokens: int) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}}
        else:
            choice = {"index": 0, "text": text}
        kind = "chat.completion" if self.chat else "text_completion"
        body = self._envelope(kind, [{**choice, "logprobs": None, "finish_reason": "length"}])
        return {**body, "usage": _usage(self.plan, completion_tokens)}

    def chunk(self, text: str | None, finish_reason: str | None = None) -> bytes:
        if self.chat:
            delta: dict[str, Any] = {} if text is None else {"content": text}
            if text == "" and finish_reason is None:
                delta["role"] = "assistant"  # the first chunk, as OpenAI sends it
            choice = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text or ""}
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse(self._envelope(kind, [{**choice, "logprobs": None, "finish_reason": finish_reason}]))

    def usage_chunk(self, completion_tokens: int) -> bytes:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return _sse({**self._envelope(kind, []), "usage": _usage(self.plan, completion_tokens)})


def build_app(router: Router) -> FastAPI:
    """The FastAPI application over a running router."""
    app = FastAPI(title="kvguard testbed", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        router.count(exc)
        headers = {RECEIPT_HEADER: exc.req} if exc.req else None
        return JSONResponse(exc.body, status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = router.count(_validation_error(exc))
        return JSONResponse(error.body, status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        message = (
            f"no route {request.method} {request.url.path}" if exc.status_code in (404, 405) else exc.detail
        )
        error = router.count(ApiError(exc.status_code, str(message)))
        return JSONResponse(error.body, status_code=exc.status_code)

    @app.middleware("http")
    async def body_limit(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if int(request.headers.get("Content-Length") or 0) > MAX_BODY_BYTES:
            error = router.count(ApiError(413, f"request body over {MAX_BODY_BYTES} bytes"))
            return JSONResponse(error.body, status_code=error.status)
        return await call_next(request)

    @app.get("/health")
    def health() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        model = {
            "id": MODEL,
            "object": "model",
            "created": 0,
            "owned_by": "kvguard-testbed",
            "max_model_len": router.config.context_len,
        }
        return {"object": "list", "data": [model]}

    @app.post("/v1/completions", response_model=None)
    def completions(body: CompletionRequest, tenant: str = Depends(_tenant)) -> Any:
        return _answer(router, tenant, body, body.prompt, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions", response_model=None)
    def chat_completions(body: ChatRequest, tenant: str = Depends(_tenant)) -> Any:
        max_tokens = body.max_completion_tokens or body.max_tokens
        return _answer(router, tenant, body, body.prompt(), max_tokens, chat=True)

    @app.post("/admin/flush")
    def flush() -> dict[str, Any]:
        return router.flush()

    return app


def _validation_error(exc: RequestValidationError) -> ApiError:
    """One 400 naming each bad input (its place in the body) and why it is bad."""
    problems, params = [], []
    for error in exc.errors():
        where = [str(part) for part in error.get("loc", ()) if part != "body"]
        # A union's alternatives add their type names to the place; keep the body's own path.
        path = ".".join(p for p in where if not p.startswith(("str", "list[", "function-")))
        message = str(error.get("msg", "is not valid")).removeprefix("Value error, ")
        if error.get("type") == "json_invalid":
            problems.append(f"request body is not JSON: {message}")
            continue
        params.append(path)
        problems.append(f"{path or 'body'}: {message}")
    param = params[0] if len(set(params)) == 1 else None
    return ApiError(400, "; ".join(dict.fromkeys(problems)), param=param or None)


def _answer(
    router: Router, tenant: str, body: _Request, prompt: str, max_tokens: int | None, *, chat: bool
) -> Any:
    if body.model != MODEL:
        raise ApiError(404, f"The model `{body.model}` does not exist.", code="model_not_found")
    plan = router.plan(tenant, prompt, max_tokens)
    shape = _Shape(chat, plan)
    receipt = {RECEIPT_HEADER: plan.req}  # the client may fetch what kvguard signed of this request
    if not body.stream:
        try:
            out = b"".join(router.generate(plan))
        except ApiError as exc:
            exc.req = plan.req
            raise
        return JSONResponse(shape.whole(out.decode("utf-8", errors="replace"), len(out)), headers=receipt)
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    stream = _stream(router, plan, shape, include_usage)
    return StreamingResponse(stream, media_type="text/event-stream", headers=receipt)


def _stream(router: Router, plan: Plan, shape: _Shape, include_usage: bool) -> Iterator[bytes]:
    """The SSE body: chunks as decode makes tokens; an error event if the request fails; [DONE]."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")  # a character may span tokens
    produced = 0
    try:
        if shape.chat:
            yield shape.chunk("")
        for tokens in router.generate(plan):
            produced += len(tokens)
            text = decoder.decode(tokens)
            if text:
                yield shape.chunk(text)
        rest = decoder.decode(b"", final=True)
        yield shape.chunk(rest if rest else (None if shape.chat else ""), finish_reason="length")
        if include_usage:
            yield shape.usage_chunk(produced)
    except ApiError as exc:
        yield _sse(router.count(exc).body)
    yield b"data: [DONE]\n\n"


def listen(port: int) -> socket.socket:
    """The API's listening socket on loopback (port 0: any free port)."""
    return socket.create_server(("127.0.0.1", port))


def serve(router: Router, sock: socket.socket) -> None:
    """Serve the API on sock until SIGINT or SIGTERM (which uvicorn raises again once it stops)."""
    config = uvicorn.Config(
        build_app(router),
        log_config=None,
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    uvicorn.Server(config).run(sockets=[sock])
