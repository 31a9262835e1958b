"""The testbed's router: an OpenAI-compatible HTTP endpoint in front of a prefill and a decode
worker, each a separate process with its own KV pool (`kvguard testbed up`).

A completion goes: bootstrap (decode reserves pages for the prompt length), prefill (admission,
forward, KV sent to decode over TCP; the sender reports completion), generate (decode
admission, batched decode steps), answered as inference servers do: 200 with the completion,
4xx for a request that cannot be served, 5xx with a clear message for a request kvguard
terminated. Invariant: the router never retries and never hides a worker's verdict.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from kvguard.testbed import wire
from kvguard.testbed.faults import check_faults

MODEL = "kvguard-echo"
_TENANT = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")


@dataclass
class ClusterConfig:
    port: int = 8000
    faults: tuple[str, ...] = ()
    guard: str = "off"  # off, monitor, enforce
    unguarded_roles: tuple[str, ...] = ()  # workers that run without a guard whatever `guard` says
    rule_modes: dict[str, str] = field(default_factory=dict)  # per-rule monitor/enforce
    audit_dir: str = "kvguard-audit"
    agent_socket: str = ""  # send the guards' events to this node agent instead of capture files
    node_prefix: str = ""  # node names are <prefix>prefill-0 and <prefix>decode-0
    context_len: int = 1024
    page_size: int = 16
    decode_pages: int = 512
    prefill_pages: int = 0  # 0: enough for the context (the incident switch makes it smaller)
    prefill_timeout_s: float = 30.0
    max_tokens_default: int = 16
    system_prompts: dict[str, str] = field(default_factory=dict)
    prefix_cache: bool = False
    host_cache: bool = False
    device: str = "cpu"  # the workers' KV pools and models; on CUDA the guard's checks run there too
    prefill_ms_per_token: float = 0.0
    decode_step_ms: float = 0.0
    offload_delay_ms: float = 50.0

    def __post_init__(self) -> None:
        self.faults = tuple(sorted(check_faults(self.faults)))
        if self.guard not in ("off", "monitor", "enforce"):
            raise ValueError(f"guard mode {self.guard!r} is not off, monitor or enforce")
        for rule, mode in self.rule_modes.items():
            if mode not in ("monitor", "enforce"):
                raise ValueError(f"rule {rule}: mode {mode!r} is not monitor or enforce")
        if not self.prefill_pages:
            context_pages = -(-self.context_len // self.page_size)
            # The incident's pool: 681,280 tokens for a context of 1,048,576, i.e. 65 %.
            self.prefill_pages = (
                max(2, context_pages * 65 // 100) if "incident" in self.faults else context_pages * 2
            )


def _spawn(config: ClusterConfig, role: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    worker = {
        "role": role,
        "node": f"{config.node_prefix}{role}-0",
        "agent_socket": config.agent_socket,
        "page_size": config.page_size,
        "num_pages": config.prefill_pages if role == "prefill" else config.decode_pages,
        "context_len": config.context_len,
        "guard": "off" if role in config.unguarded_roles else config.guard,
        "rule_modes": config.rule_modes,
        "faults": list(config.faults),
        "audit_dir": config.audit_dir,
        "prefill_ms_per_token": config.prefill_ms_per_token,
        "decode_step_ms": config.decode_step_ms,
        "offload_delay_ms": config.offload_delay_ms,
        "prefix_cache": config.prefix_cache,
        "host_cache": config.host_cache,
        "device": config.device,
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvguard.testbed.engine", "--config", json.dumps(worker)],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("{"):
        proc.kill()
        raise RuntimeError(f"{role} worker failed to start (exit {proc.poll()})")
    return proc, json.loads(line)


class Router:
    """Spawns the workers and serves the HTTP API."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        Path(config.audit_dir).mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen[str]] = []
        results: dict[str, tuple[subprocess.Popen[str], dict[str, Any]]] = {}

        def start(role: str) -> None:
            results[role] = _spawn(config, role)

        threads = [threading.Thread(target=start, args=(role,)) for role in ("prefill", "decode")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if set(results) != {"prefill", "decode"}:
            for proc, _ in results.values():
                proc.kill()
            raise RuntimeError("a testbed worker failed to start")
        self.procs = [results["prefill"][0], results["decode"][0]]
        self.pids = {f"{config.node_prefix}{role}-0": results[role][0].pid for role in ("prefill", "decode")}
        self.prefill = ("127.0.0.1", results["prefill"][1]["control"])
        self.decode = ("127.0.0.1", results["decode"][1]["control"])
        handler = type("Handler", (_Handler,), {"router": self})
        self.http = ThreadingHTTPServer(("127.0.0.1", config.port), handler)
        self.http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"

    def serve_forever(self) -> None:
        try:
            self.http.serve_forever()
        finally:
            self.close()

    def close(self) -> None:
        self.http.server_close()
        for proc in self.procs:
            if proc.poll() is None:
                with contextlib.suppress(OSError):
                    wire.call(
                        self.prefill if proc is self.procs[0] else self.decode, {"op": "flush"}, timeout=5
                    )
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()

    # ------------------------------------------------------------------ the request path

    def complete(self, tenant: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            return 400, _error("prompt must be a non-empty string", "invalid_request_error")
        max_tokens = body.get("max_tokens", self.config.max_tokens_default)
        if not isinstance(max_tokens, int) or max_tokens < 1:
            return 400, _error("max_tokens must be a positive integer", "invalid_request_error")
        model = body.get("model", MODEL)
        if model != MODEL:
            return 404, _error(
                f"The model `{model}` does not exist.", "invalid_request_error", "model_not_found"
            )
        user_tokens = prompt.encode("utf-8")
        tokens = self.config.system_prompts.get(tenant, "").encode("utf-8") + user_tokens
        if len(tokens) + max_tokens > self.config.context_len:
            return 400, _error(
                f"This model's maximum context length is {self.config.context_len} tokens. However, you "
                f"requested {len(tokens) + max_tokens} tokens ({len(tokens)} in the prompt, {max_tokens} "
                "for the completion).",
                "invalid_request_error",
                "context_length_exceeded",
            )
        req = f"cmpl-{uuid.uuid4().hex[:16]}"
        boot = self._call(
            self.decode,
            op="bootstrap",
            req=req,
            tenant=tenant,
            prompt_tokens=len(tokens),
            max_tokens=max_tokens,
            prefill_node=f"{self.config.node_prefix}prefill-0",
        )
        if boot.get("status") != "ok":
            return self._failed(req, boot, inflight=False, reserved=False)
        try:
            pre = self._call(
                self.prefill,
                timeout=self.config.prefill_timeout_s,
                op="prefill",
                req=req,
                tenant=tenant,
                tokens=list(tokens),
                user_tokens=list(user_tokens),
                decode_kv=boot["kv"],
                decode_node=f"{self.config.node_prefix}decode-0",
            )
        except TimeoutError:
            self._call(self.decode, op="abort", req=req, reason="prefill timed out", inflight=True)
            return 504, _error(f"prefill of {req} timed out", "timeout")
        if pre.get("status") != "done":
            return self._failed(req, pre, inflight=False, reserved=True)
        gen = self._call(self.decode, timeout=120, op="generate", req=req, timeout_s=60)
        if gen.get("status") != "done":
            return self._failed(req, gen, inflight=False, reserved=False)
        out = bytes(gen["tokens"])
        return 200, {
            "id": req,
            "object": "text_completion",
            "created": int(time.time()),
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "text": out.decode("utf-8", errors="replace"),
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": len(tokens),
                "completion_tokens": len(out),
                "total_tokens": len(tokens) + len(out),
            },
        }

    def _call(self, address: tuple[str, int], timeout: float = 60.0, **msg: Any) -> dict[str, Any]:
        try:
            return wire.call(address, msg, timeout=timeout)
        except TimeoutError:
            raise TimeoutError from None
        except (OSError, ConnectionError) as exc:
            return {"status": "error", "error": f"worker unreachable: {exc}"}

    def _failed(
        self, req: str, reply: dict[str, Any], *, inflight: bool, reserved: bool
    ) -> tuple[int, dict[str, Any]]:
        if reserved:
            self._call(
                self.decode, op="abort", req=req, reason=reply.get("error", "failed"), inflight=inflight
            )
        status = reply.get("status")
        message = reply.get("error", "request failed")
        if status == "killed":
            return 500, _error(f"request {req} was terminated by kvguard: {message}", "kvguard_terminated")
        if status == "rejected":
            return 400, _error(message, "invalid_request_error")
        return 502, _error(f"request {req} failed: {message}", "server_error")

    def flush(self) -> dict[str, Any]:
        """Every worker writes out its audit capture and reports its guard's findings."""
        out: dict[str, Any] = {"audit_dir": self.config.audit_dir, "findings": [], "workers": {}}
        for name, address in (("prefill", self.prefill), ("decode", self.decode)):
            reply = wire.call(address, {"op": "flush"}, timeout=10)
            out["findings"] += reply.get("findings", [])
            out["workers"][name] = {"free_pages": reply.get("free_pages")}
        return out


def _error(message: str, kind: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class _Handler(BaseHTTPRequestHandler):
    router: Router
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the workers log findings
        pass

    def _send(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path == "/v1/models":
            model = {
                "id": MODEL,
                "object": "model",
                "created": 0,
                "owned_by": "kvguard-testbed",
                "max_model_len": self.router.config.context_len,
            }
            self._send(200, {"object": "list", "data": [model]})
        elif self.path == "/health":
            self._send(200, {"ok": True})
        else:
            self._send(404, _error(f"no route {self.path}", "invalid_request_error"))

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > 1 << 20:
            self._send(413, _error("request body too large", "invalid_request_error"))
            return
        raw = self.rfile.read(length)
        if self.path == "/admin/flush":
            self._send(200, self.router.flush())
            return
        if self.path != "/v1/completions":
            self._send(404, _error(f"no route {self.path}", "invalid_request_error"))
            return
        auth = self.headers.get("Authorization", "")
        tenant = auth[7:].strip() if auth.startswith("Bearer ") else ""
        if not _TENANT.match(tenant):
            self._send(
                401,
                _error(
                    "missing or malformed API key (Authorization: Bearer <tenant>)",
                    "invalid_request_error",
                    "invalid_api_key",
                ),
            )
            return
        try:
            body = json.loads(raw or b"{}")
        except json.JSONDecodeError as exc:
            self._send(400, _error(f"request body is not JSON: {exc}", "invalid_request_error"))
            return
        if not isinstance(body, dict):
            self._send(400, _error("request body must be a JSON object", "invalid_request_error"))
            return
        status, reply = self.router.complete(tenant, body)
        self._send(status, reply)


def up(config: ClusterConfig) -> int:
    """`kvguard testbed up`: run the cluster in the foreground until interrupted."""
    router = Router(config)
    print(
        "READY "
        + json.dumps(
            {"url": router.url, "pids": router.pids, "audit_dir": config.audit_dir, **asdict(config)}
        ),
        flush=True,
    )
    print(
        f"kvguard testbed: {router.url}/v1 (model {MODEL}, context {config.context_len}, "
        f"guard {config.guard}, faults {', '.join(config.faults) or 'none'}); "
        f"audit captures in {config.audit_dir}/",
        file=sys.stderr,
        flush=True,
    )
    with contextlib.suppress(KeyboardInterrupt):
        router.serve_forever()
    return 0
