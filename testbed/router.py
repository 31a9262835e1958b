"""The testbed's router: it starts a prefill and a decode worker, each a separate process with
its own KV pool, and runs requests through them for the OpenAI-compatible API
(testbed.openai_api) that `kvguard testbed up` serves.

A completion goes: bootstrap (decode reserves pages for the prompt length), prefill (admission,
forward, KV sent to decode over TCP; the sender reports completion), generate (decode
admission, batched decode steps, tokens streamed back as each step makes them). A request
that cannot be served raises :class:`ApiError` with the status inference servers answer:
4xx for the client's mistakes, 500 with the engine's message for a request kvguard
terminated. Invariants: the router never retries and never hides a worker's verdict; the
workers end with the router (SIGTERM, SIGINT, or the router's death: PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from kvguard.testbed import wire
from kvguard.testbed.faults import check_faults

MODEL = "kvguard-echo"
TENANT = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
ROLES = ("prefill", "decode")
DECODE_TIMEOUT_S = 60.0  # for decode to finish a request once prefill has handed it over


RECEIPT_HEADER = "kvguard-receipt"  # the id of the request's kvguard receipt (`kvguard audit receipt ID`)


class ApiError(Exception):
    """A request the API answers with an error, in OpenAI's shape (`body`)."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
        self.req = ""  # the request it ended, once it had one: its receipt's id (RECEIPT_HEADER)


@dataclass(frozen=True)
class Plan:
    """A request that passed validation: what the workers are asked to do."""

    req: str
    tenant: str
    tokens: bytes  # the tenant's system prompt, then the user's
    user_tokens: bytes
    max_tokens: int


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
    cuda_witness: bool = False  # preload the kvguard shim into the workers (its CUDA witnesses)

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


def _spawn(config: ClusterConfig, role: str) -> subprocess.Popen[str]:
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
        "cuda_witness": config.cuda_witness,
    }
    env = None
    if config.cuda_witness:  # the shim, preloaded into the worker; its records go to the agent
        from kvguard.agents.guard import SHIM_LIBRARY

        preload = " ".join(p for p in (str(SHIM_LIBRARY), os.environ.get("LD_PRELOAD", "")) if p)
        env = {**os.environ, "LD_PRELOAD": preload}
        if config.agent_socket:
            env["KVGUARD_SHIM_SOCKET"] = f"{config.agent_socket}.shim"
    # Spawned from the thread that serves (the main one): PR_SET_PDEATHSIG, which the worker sets,
    # fires when the thread that forked it ends, not only the process.
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvguard.testbed.engine",
            "--config",
            json.dumps(worker),
            "--parent",
            str(os.getpid()),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def _ready(role: str, proc: subprocess.Popen[str]) -> dict[str, Any]:
    line = proc.stdout.readline() if proc.stdout else ""
    if not line.startswith("{"):
        raise RuntimeError(f"{role} worker failed to start (exit {proc.poll()})")
    return json.loads(line)


class Router:
    """Starts the workers and runs requests through them."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.errors: Counter[str] = Counter()  # requests answered with an error, by code (else type)
        self._errors_lock = threading.Lock()
        Path(config.audit_dir).mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen[str]] = []
        try:
            self.procs = [_spawn(config, "prefill")]
            self.procs.append(_spawn(config, "decode"))
            ready = {role: _ready(role, proc) for role, proc in zip(ROLES, self.procs, strict=True)}
        except BaseException:  # a failed start or a signal: no worker outlives it
            self._stop_workers(flush=False)
            raise
        self.pids = {
            f"{config.node_prefix}{role}-0": p.pid for role, p in zip(ROLES, self.procs, strict=True)
        }
        self.prefill = ("127.0.0.1", ready["prefill"]["control"])
        self.decode = ("127.0.0.1", ready["decode"]["control"])

    def close(self) -> None:
        """Flush the workers' captures and stop them."""
        self._stop_workers(flush=True)

    def _stop_workers(self, *, flush: bool) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                if flush:
                    address = self.prefill if proc is self.procs[0] else self.decode
                    with contextlib.suppress(OSError):
                        wire.call(address, {"op": "flush"}, timeout=5)
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

    def plan(self, tenant: str, prompt: str, max_tokens: int | None) -> Plan:
        """Check a validated request against the model's context; ApiError (400) when over."""
        max_tokens = self.config.max_tokens_default if max_tokens is None else max_tokens
        user_tokens = prompt.encode("utf-8")
        tokens = self.config.system_prompts.get(tenant, "").encode("utf-8") + user_tokens
        if len(tokens) + max_tokens > self.config.context_len:
            raise ApiError(
                400,
                f"This model's maximum context length is {self.config.context_len} tokens. However, "
                f"you requested {len(tokens) + max_tokens} tokens ({len(tokens)} in the prompt, "
                f"{max_tokens} for the completion).",
                code="context_length_exceeded",
            )
        return Plan(f"cmpl-{uuid.uuid4().hex[:16]}", tenant, tokens, user_tokens, max_tokens)

    def count(self, error: ApiError) -> ApiError:
        """Count a request answered with an error (by its code, else its type); hand it back."""
        detail = error.body["error"]
        with self._errors_lock:  # counted from the server's loop and from its stream threads
            self.errors[detail["code"] or detail["type"]] += 1
        return error

    def generate(self, plan: Plan) -> Iterator[bytes]:
        """The completion's tokens as decode makes them; ApiError when the request fails."""
        req = plan.req
        boot = self._call(
            self.decode,
            op="bootstrap",
            req=req,
            tenant=plan.tenant,
            prompt_tokens=len(plan.tokens),
            max_tokens=plan.max_tokens,
            prefill_node=f"{self.config.node_prefix}prefill-0",
        )
        if boot.get("status") != "ok":
            raise self._failed(req, boot, reserved=False)
        try:
            pre = self._call(
                self.prefill,
                timeout=self.config.prefill_timeout_s,
                op="prefill",
                req=req,
                tenant=plan.tenant,
                tokens=list(plan.tokens),
                user_tokens=list(plan.user_tokens),
                decode_kv=boot["kv"],
                decode_node=f"{self.config.node_prefix}decode-0",
            )
        except TimeoutError:
            self._call(self.decode, op="abort", req=req, reason="prefill timed out", inflight=True)
            raise ApiError(504, f"prefill of {req} timed out", "timeout") from None
        if pre.get("status") != "done":
            raise self._failed(req, pre, reserved=True)
        finished = False
        try:
            with socket.create_connection(self.decode, timeout=DECODE_TIMEOUT_S * 2) as sock:
                wire.send(sock, {"op": "generate", "req": req, "timeout_s": DECODE_TIMEOUT_S, "stream": True})
                while True:
                    reply, _ = wire.recv(sock)
                    if "tokens" in reply and "status" not in reply:
                        yield bytes(reply["tokens"])
                        continue
                    finished = True
                    if reply.get("status") != "done":
                        raise self._failed(req, reply, reserved=False)
                    return
        except (OSError, ConnectionError) as exc:
            finished = True  # decode is gone, or broke the stream: nothing there to abort
            raise self._failed(req, {"error": f"worker unreachable: {exc}"}, reserved=False) from None
        finally:
            if not finished:  # the client went away mid-stream: decode stops the request
                self._call(self.decode, op="abort", req=req, reason="client disconnected")

    def _call(self, address: tuple[str, int], timeout: float = 60.0, **msg: Any) -> dict[str, Any]:
        try:
            return wire.call(address, msg, timeout=timeout)
        except TimeoutError:
            raise TimeoutError from None
        except (OSError, ConnectionError) as exc:
            return {"status": "error", "error": f"worker unreachable: {exc}"}

    def _failed(self, req: str, reply: dict[str, Any], *, reserved: bool) -> ApiError:
        if reserved:
            self._call(self.decode, op="abort", req=req, reason=reply.get("error", "failed"), inflight=False)
        status = reply.get("status")
        message = reply.get("error", "request failed")
        if status == "killed":
            error = ApiError(500, f"request {req} was terminated by kvguard: {message}", "kvguard_terminated")
        elif status == "rejected":
            error = ApiError(400, message)
        else:
            error = ApiError(502, f"request {req} failed: {message}", "server_error")
        return error

    def flush(self) -> dict[str, Any]:
        """Every worker writes out its audit capture and reports its guard's findings."""
        out: dict[str, Any] = {
            "audit_dir": self.config.audit_dir,
            "findings": [],
            "workers": {},
            "errors": dict(self.errors),  # answered with an error, by code (else type)
        }
        for name, address in (("prefill", self.prefill), ("decode", self.decode)):
            reply = wire.call(address, {"op": "flush"}, timeout=10)
            out["findings"] += reply.get("findings", [])
            out["workers"][name] = {"free_pages": reply.get("free_pages")}
        return out


class Stopped(Exception):
    """SIGINT or SIGTERM reached `kvguard testbed up`."""


def _stopped(signum: int, frame: FrameType | None) -> None:
    raise Stopped(signal.Signals(signum).name)


def up(config: ClusterConfig) -> int:
    """`kvguard testbed up`: run the cluster in the foreground until SIGINT or SIGTERM."""
    from kvguard.testbed.openai_api import listen, serve  # FastAPI is loaded only to serve

    # uvicorn takes SIGINT and SIGTERM while it serves and raises them again once it has shut
    # down; this handler turns either into one exception, so that the workers are stopped. SIGINT
    # gets it too: left to Python's default it went a second way, through asyncio's runner,
    # and once in CI `up` died of it instead of stopping its workers.
    signal.signal(signal.SIGTERM, _stopped)
    signal.signal(signal.SIGINT, _stopped)
    router: Router | None = None
    try:
        router = Router(config)
        sock = listen(config.port)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        print(
            "READY "
            + json.dumps({"url": url, "pids": router.pids, "audit_dir": config.audit_dir, **asdict(config)}),
            flush=True,
        )
        print(
            f"kvguard testbed: {url}/v1 (model {MODEL}, context {config.context_len}, "
            f"guard {config.guard}, faults {', '.join(config.faults) or 'none'}); "
            f"audit captures in {config.audit_dir}/",
            file=sys.stderr,
            flush=True,
        )
        serve(router, sock)
    except (KeyboardInterrupt, Stopped):  # a Ctrl-C before the handlers are in place
        pass
    finally:
        # A second signal while the workers flush and stop must not cut that short.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if router is not None:
            router.close()
    return 0
