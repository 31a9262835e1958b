"""The testbed's prefill and decode workers: one process each, each with its own KV pool.

A worker serves control calls from the router over TCP (testbed.wire), and the decode worker
also receives KV from prefill over a TCP connection of its own. Each calls its in-engine
guard (when one is on) at the points where real engines change page ownership: admission,
rejection, abort, allocation, write, free, hold/release, prefix share, transfer send and
receive, and before every attention launch. A guard verdict that kills a request fails that
request alone; the rest of the batch goes on.

Invariants: with every fault switch off the workers are a correct engine (a request attends
only to KV it wrote or was legitimately given); each fault switch breaks exactly the code path
that testbed.faults describes. The free list is LIFO, as in real allocators: the pages freed
last are handed out first, which is what makes a stale page hold a recent user's data.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvguard.agents.guard import AgentSink, CaptureSink, EventSink, Guard, NullGuard, TransferLabel, Verdict
from kvguard.testbed import wire
from kvguard.testbed.faults import check_faults
from kvguard.testbed.models import EchoModel

PLACEHOLDER = ord("?")  # the 1-token prompt a rejected request is swapped for (the incident)
AGENT_WAIT_S = 10.0  # a worker with an agent socket waits this long for the agent to watch it
CHUNKED_PAGES = 3  # prompts of more pages are prefilled in chunks (where half_written_page strikes)


class Killed(Exception):
    """kvguard terminated the request; the message says why."""


class PoolFull(Exception):
    """No pages for the request now: it is rejected (the client may retry)."""


@dataclass
class WorkerConfig:
    role: str
    node: str
    page_size: int = 16
    num_pages: int = 256
    context_len: int = 1024
    guard: str = "off"  # off, monitor, enforce
    rule_modes: dict[str, str] = field(default_factory=dict)  # rule id -> monitor or enforce
    faults: frozenset[str] = frozenset()
    audit_dir: str = ""
    agent_socket: str = ""  # when set, events go to the node agent (and its kills come back)
    prefill_ms_per_token: float = 0.0  # test control: a slow prefill, to stage an abort
    decode_step_ms: float = 0.0  # test control: a slow decode step, to stage overlap
    offload_delay_ms: float = 50.0
    prefix_cache: bool = False  # keep prompts' pages for reuse by identical prompts
    host_cache: bool = False  # offload prompts' KV to host memory, restore on a repeat
    device: str = "cpu"  # pool and model; on CUDA the guard checks tags and checksums there


class Worker:
    """What prefill and decode share: the pool, the LIFO free list, the guard, the server."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.faults = config.faults
        self.model = EchoModel(config.page_size, max(config.context_len * 2, 2048), device=config.device)
        self.pool = self.model.pool(config.num_pages)
        self.free_list: list[int] = list(range(config.num_pages - 1, -1, -1))  # pop() gives page 0 first
        self.quarantined: set[int] = set()
        self.copies = TransferLabel()
        self.lock = threading.RLock()
        self.guard: Guard | NullGuard = NullGuard(config.node)
        if config.guard != "off":
            sink: EventSink | None = None
            if config.agent_socket:
                sink = AgentSink(config.agent_socket, config.node)
            elif config.audit_dir:
                sink = CaptureSink(Path(config.audit_dir) / f"{config.node}.jsonl")
            self.guard = Guard(
                config.node,
                mode=config.guard,  # type: ignore[arg-type]
                rule_modes=config.rule_modes,  # type: ignore[arg-type]
                sink=sink,
                on_finding=self._log_finding,
                on_kill=self._killed,
                on_quarantine=self.quarantine,
            )
        self.guard.pool(
            0,
            "prefill" if config.role == "prefill" else "decode",
            config.page_size,
            config.num_pages,
            context_len=config.context_len,
            engine="kvguard-testbed",
            kv_dtype="float32",
            source="testbed",
            # Decode receives KV into its pages: where they lie, so that RDMA writes a probe saw
            # the sender post can be mapped to them (unused by the testbed's TCP transfer).
            regions=self.pool.regions() if config.role != "prefill" else [],
        )

    # ------------------------------------------------------------------ guard and pages

    def _killed(self, req: str, reason: str) -> None:
        """The daemon ordered a kill (the guard recorded it): end the request it names."""
        with self.lock:
            self.on_kill(req, reason)

    def on_kill(self, req: str, reason: str) -> None:
        """The engine's part of a kill ordered from outside (each worker knows its requests)."""

    def _log_finding(self, finding: Any) -> None:
        where = f"[{self.config.node}] {finding.severity.upper()} {finding.action} {finding.rule}"
        print(f"{where}: {finding.message}", file=sys.stderr, flush=True)

    def take_pages(self, req: str, n: int) -> list[int] | None:
        """n pages from the free list, granted to req (None when the pool is short)."""
        with self.lock:
            if len(self.free_list) < n:
                return None
            pages = [self.free_list.pop() for _ in range(n)]
            verdict = self.guard.alloc(req, 0, pages)
            bad = verdict.quarantine
            if bad:
                # Quarantine: pages still in use elsewhere leave circulation; take others.
                self.quarantined |= bad
                self.guard.free(req, 0, sorted(bad))
                keep = [p for p in pages if p not in bad]
                more = self.take_pages(req, len(pages) - len(keep))
                if more is None:
                    return None
                pages = keep + more
            if verdict.kill:
                raise Killed(verdict.reason(req))
            return pages

    def give_back(self, pages: list[int]) -> None:
        """Return pages to the free list (in order: the first page is handed out first again)."""
        with self.lock:
            self.free_list.extend(p for p in reversed(pages) if p not in self.quarantined)

    def quarantine(self, pages: Iterable[int]) -> None:
        """Take pages out of circulation: out of the free list, and never back into it."""
        with self.lock:
            self.quarantined |= set(pages)
            self.free_list = [p for p in self.free_list if p not in self.quarantined]

    def free_pages(self, req: str, pages: list[int]) -> None:
        with self.lock:
            bad = self.guard.free(req, 0, pages).quarantine
            if bad:
                self.quarantine(bad)
            self.give_back(pages)

    # ------------------------------------------------------------------ serving

    def serve(self, ready: Callable[[dict[str, Any]], None]) -> None:
        sink = self.guard.sink
        if isinstance(sink, AgentSink) and not sink.wait_ready(AGENT_WAIT_S):
            # Serve all the same (the guard's own checks hold); the agent's witness misses
            # the connections opened until it takes the guard's hello.
            print(
                f"kvguard testbed: {self.config.node}: the agent at {sink.socket_path} did not take "
                f"the guard's hello within {AGENT_WAIT_S:g} s; serving, not yet witnessed",
                file=sys.stderr,
            )
        control = socket.create_server(("127.0.0.1", 0))
        ports = {"control": control.getsockname()[1], **self.extra_ports()}
        ready(ports)
        while True:
            conn, _ = control.accept()
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def extra_ports(self) -> dict[str, int]:
        return {}

    def _handle(self, conn: socket.socket) -> None:
        with conn:
            try:
                msg, _payload = wire.recv(conn)
                op = getattr(self, f"op_{msg.get('op')}", None)
                reply = {"error": f"unknown op {msg.get('op')!r}"} if op is None else op(msg)
            except Killed as exc:
                reply = {"status": "killed", "error": str(exc)}
            except PoolFull as exc:
                reply = {"status": "rejected", "error": str(exc)}
            except (ConnectionError, OSError, ValueError) as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(OSError):
                wire.send(conn, reply)

    def op_flush(self, msg: dict[str, Any]) -> dict[str, Any]:
        """Write every queued guard event to the audit capture (for tests and shutdown)."""
        if isinstance(self.guard.sink, CaptureSink | AgentSink):
            self.guard.sink.flush()
        findings = [f.to_json_dict() for f in self.guard.findings]
        return {"ok": True, "findings": findings, "free_pages": len(self.free_list)}


# ====================================================================== prefill


@dataclass
class CacheEntry:
    """A prompt whose KV stays in device pages for prefix reuse (the origin keeps its grant)."""

    origin: str
    tenant: str
    tokens: bytes
    user_tokens: bytes
    pages: list[int]


class PrefillWorker(Worker):
    """Admission, prefill forward, KV send to decode; a prefix cache and a host offload cache."""

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.prefix_cache: OrderedDict[str, CacheEntry] = OrderedDict()
        self.host_cache: dict[tuple[str, bytes], torch.Tensor] = {}
        self.xfers = 0
        self._caching = config.prefix_cache or "cross_tenant_share" in self.faults
        self._offloading = config.host_cache or "offload_free" in self.faults

    def op_prefill(self, msg: dict[str, Any]) -> dict[str, Any]:
        req, tenant = msg["req"], msg["tenant"]
        tokens = bytes(msg["tokens"])
        user_tokens = bytes(msg.get("user_tokens", msg["tokens"]))
        decode_kv = (msg["decode_kv"][0], int(msg["decode_kv"][1]))
        with self.lock:
            # Admission: a prompt that cannot fit the pool is rejected and must go no further.
            capacity = self.config.num_pages * self.config.page_size
            rejected = len(tokens) > capacity
            reason = f"prompt of {len(tokens)} tokens exceeds the prefill KV pool ({capacity} tokens)"
            if rejected and "incident" not in self.faults:
                self.guard.reject(req, reason)
                return {"status": "rejected", "error": reason}
            verdict = self.guard.admit(req, tenant, len(tokens), "prefill")
            if verdict.kill:
                raise Killed(verdict.reason(req))
            if rejected:
                # The incident: the rejection is queued (to_finish) but admission asks
                # finished(), which is still false, so the request passes; its prompt was
                # swapped for a one-token placeholder and an almost empty forward runs.
                self.guard.reject(req, reason)
                tokens = bytes([PLACEHOLDER])
        if self.config.prefill_ms_per_token:
            time.sleep(self.config.prefill_ms_per_token * len(tokens) / 1000)
        with self.lock:
            pages, shared_from = self._pages_for(req, tenant, tokens, user_tokens)
        try:
            sent = self._send(req, pages, tokens, decode_kv, msg)
        finally:
            with self.lock:
                self._release_after_send(req, tenant, tokens, user_tokens, pages, shared_from)
        self.guard.finish(req, 0)
        return {"status": "done", "sent_tokens": sent, "rejected_but_sent": rejected}

    # -- pages for a prompt: a prefix-cache hit, a host-cache restore, or a forward

    def _cache_key(self, tenant: str, tokens: bytes, user_tokens: bytes) -> str:
        if "cross_tenant_share" in self.faults:
            return user_tokens.hex()  # the bug: no tenant, no system prompt in the key
        return f"{tenant}:{tokens.hex()}"

    def _pages_for(self, req: str, tenant: str, tokens: bytes, user_tokens: bytes) -> tuple[list[int], str]:
        entry = self.prefix_cache.get(self._cache_key(tenant, tokens, user_tokens)) if self._caching else None
        if entry is not None:
            verdict = self.guard.share(req, 0, entry.pages, entry.origin)
            if verdict.kill:
                self.guard.free(req, 0, entry.pages)
                raise Killed(verdict.reason(req))
            if not verdict.deny:
                return entry.pages, entry.origin
            self.guard.free(req, 0, entry.pages)  # the share is refused: compute instead
        n = math.ceil(len(tokens) / self.config.page_size)
        pages = self._take_or_evict(req, n)
        table = torch.tensor(pages, dtype=torch.long)
        host = self.host_cache.get((tenant, tokens)) if self._offloading else None
        ps = self.config.page_size
        slots = [ps] * (n - 1) + [len(tokens) - ps * (n - 1)]
        if host is not None:
            self.pool.import_pages(table, host)  # restore offloaded KV instead of computing it
        elif "half_written_page" in self.faults and n > CHUNKED_PAGES:
            # The first chunk stops half way through page 0; the next starts at page 1. The
            # engine reports what its kernels wrote.
            written = torch.cat([torch.arange(ps // 2), torch.arange(ps, len(tokens))])
            self.model.prefill(self.pool, table, torch.tensor(list(tokens), dtype=torch.long), written)
            slots[0] = ps // 2
        else:
            self.model.prefill(self.pool, table, torch.tensor(list(tokens), dtype=torch.long))
        verdict = self.guard.write(req, 0, pages, slots)
        if verdict.kill:
            self.free_pages(req, pages)
            raise Killed(verdict.reason(req))
        return pages, ""

    def _take_or_evict(self, req: str, n: int) -> list[int]:
        while True:
            pages = self.take_pages(req, n)
            if pages is not None:
                return pages
            if not self.prefix_cache:
                raise PoolFull(f"prefill KV pool exhausted ({n} pages needed, {len(self.free_list)} free)")
            _, old = self.prefix_cache.popitem(last=False)
            self.free_pages(old.origin, old.pages)

    def _send(
        self, req: str, pages: list[int], tokens: bytes, decode_kv: tuple[str, int], msg: dict[str, Any]
    ) -> int:
        pages = pages[: math.ceil(len(tokens) / self.config.page_size)]  # a shared prefix may hold more
        # What leaves the node is read like attention reads it: it must be this request's own KV
        # (or a prefix it was given). Checked before the transfer, not reported after it.
        verdict = self.guard.check_attention(0, [req], np.array([pages]), np.array([len(tokens)]))
        if verdict.kill:
            raise Killed(verdict.reason(req))
        table = torch.tensor(pages, dtype=torch.long)
        checksums = self.pool.page_checksums(table)
        send_pages = pages
        if "short_transfer" in self.faults and len(pages) > 1:
            send_pages = pages[: len(pages) // 2]  # half the pages, the whole claim
        with self.lock:
            self.xfers += 1
            xfer = f"{self.config.node}-x{self.xfers}"
            self.guard.hold(req, 0, pages, "transfer_send")
        with self.copies.transfer(xfer):  # on CUDA, the shim (when preloaded) counts this copy off the GPU
            data = self.pool.export_pages(torch.tensor(send_pages, dtype=torch.long)).cpu().numpy().tobytes()
        header = {
            "op": "kv",
            "req": req,
            "xfer": xfer,
            "peer": self.config.node,
            "tokens": len(tokens),
            "pages": len(pages),
            "bytes": len(pages) * self.pool.page_nbytes,
            "checksums": [int(c) for c in checksums],
        }
        status, ack = "done", {}
        try:
            with socket.create_connection(decode_kv, timeout=60) as sock:
                wire.send(sock, header, data)
                ack, _ = wire.recv(sock)
            if ack.get("error"):
                status = "failed"
        except OSError:
            status = "failed"
        with self.lock:
            # The sender reports what it claims: every page, done (the short-transfer bug).
            self.guard.xfer_send(
                req,
                xfer,
                msg.get("decode_node", "decode"),
                0,
                pages,
                len(tokens),
                header["bytes"],
                checksums,
                status,
            )
            self.guard.release(req, 0, pages, "transfer_send")
        if status != "done":
            raise ConnectionError(f"transfer {xfer} of {req} failed")
        return len(tokens)

    def _release_after_send(
        self, req: str, tenant: str, tokens: bytes, user_tokens: bytes, pages: list[int], shared_from: str
    ) -> None:
        if shared_from:
            self.guard.free(req, 0, pages)  # the end of the share; the cache keeps the origin's grant
            return
        key = self._cache_key(tenant, tokens, user_tokens)
        if self._caching and key not in self.prefix_cache:
            # Keep the prompt for prefix reuse; its grant lives on until eviction.
            self.prefix_cache[key] = CacheEntry(req, tenant, tokens, user_tokens, pages)
            return
        if self._offloading:
            self._offload(req, tenant, tokens, pages)
        else:
            self.free_pages(req, pages)

    def _offload(self, req: str, tenant: str, tokens: bytes, pages: list[int]) -> None:
        """Copy a prompt's KV to the host cache in the background; its pages go back to the
        pool only when the copy is done (the offload hold)."""
        self.guard.hold(req, 0, pages, "offload")
        self.guard.free(req, 0, pages)
        if "offload_free" in self.faults:
            self.give_back(pages)  # the bug: back in the pool while the copy still reads them

        def copy() -> None:
            time.sleep(self.config.offload_delay_ms / 1000)
            with self.lock:
                self.host_cache[(tenant, tokens)] = self.pool.export_pages(
                    torch.tensor(pages, dtype=torch.long)
                ).cpu()  # host memory, as an offload is
                self.guard.release(req, 0, pages, "offload")
                if "offload_free" not in self.faults:
                    self.give_back(pages)

        threading.Thread(target=copy, daemon=True).start()


# ====================================================================== decode


@dataclass
class DecodeRequest:
    req: str
    tenant: str
    prompt_tokens: int
    max_tokens: int
    pages: list[int]
    slot: int = -1
    held: bool = True  # the transfer_recv hold on the reserved pages
    state: str = "reserved"  # reserved, ready, running, done, failed, aborted
    generated: list[int] = field(default_factory=list)
    error: str = ""
    done: threading.Event = field(default_factory=threading.Event)


class DecodeWorker(Worker):
    """Bootstrap reservations, KV receipt, continuous batching of decode steps."""

    MAX_BATCH = 64

    def __init__(self, config: WorkerConfig) -> None:
        super().__init__(config)
        self.requests: dict[str, DecodeRequest] = {}
        self.wake = threading.Condition(self.lock)
        self.max_pages = math.ceil(config.context_len * 2 / config.page_size)
        # Batch slots own a block-table row each, reused from request to request.
        self.slot_tables = np.zeros((self.MAX_BATCH, self.max_pages), dtype=np.int64)
        self.slots_free = list(range(self.MAX_BATCH - 1, -1, -1))
        self.kv_server = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._kv_loop, daemon=True).start()
        threading.Thread(target=self._decode_loop, daemon=True).start()

    def extra_ports(self) -> dict[str, int]:
        return {"kv": self.kv_server.getsockname()[1]}

    # -- bootstrap: the router says how long the prompt is; pages are reserved for it

    def op_bootstrap(self, msg: dict[str, Any]) -> dict[str, Any]:
        req, prompt = msg["req"], int(msg["prompt_tokens"])
        with self.lock:
            verdict = self.guard.bootstrap(
                req, msg.get("prefill_node", "prefill"), self.config.node, prompt, msg["tenant"]
            )
            if verdict.kill:
                raise Killed(verdict.reason(req))
            pages = self.take_pages(req, math.ceil(prompt / self.config.page_size))
            if pages is None:
                self.guard.reject(req, "decode KV pool full")
                return {"status": "rejected", "error": "decode KV pool full"}
            self.guard.hold(req, 0, pages, "transfer_recv")
            self.requests[req] = DecodeRequest(req, msg["tenant"], prompt, int(msg["max_tokens"]), pages)
        return {"status": "ok", "kv": ["127.0.0.1", self.kv_server.getsockname()[1]]}

    # -- KV receipt, checked before the request may be decoded

    def _kv_loop(self) -> None:
        while True:
            conn, _ = self.kv_server.accept()
            threading.Thread(target=self._receive, args=(conn,), daemon=True).start()

    def _receive(self, conn: socket.socket) -> None:
        with conn:
            try:
                header, payload = wire.recv(conn)
                reply = self._import(header, payload)
            except (ConnectionError, OSError, ValueError, KeyError) as exc:
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            with contextlib.suppress(OSError):
                wire.send(conn, reply)

    def _import(self, header: dict[str, Any], payload: bytearray) -> dict[str, Any]:
        req = header["req"]
        with self.lock:
            r = self.requests.get(req)
            if r is None:
                return {"error": f"unknown request {req}"}
            nbytes = self.pool.page_nbytes
            arrived = len(payload) // nbytes
            claimed_pages = int(header["pages"])
            if arrived > len(r.pages) or claimed_pages > len(r.pages):
                return {"error": f"{req}: {max(arrived, claimed_pages)} pages sent, {len(r.pages)} reserved"}
            ps = self.config.page_size
            tokens = min(int(header["tokens"]), arrived * ps)
            checked = r.pages[:claimed_pages]
            landing = r.pages[: math.ceil(tokens / ps)]

            def report(status: str, checksums: Any) -> Verdict:
                return self.guard.xfer_recv(
                    req,
                    header["xfer"],
                    header.get("peer", "prefill"),
                    0,
                    checked,
                    tokens,
                    arrived * nbytes,
                    checksums,
                    status,
                    claimed_tokens=int(header["tokens"]),
                    claimed_bytes=int(header["bytes"]),
                    claimed_checksums=header["checksums"],
                )

            if self.guard.mode == "enforce" and not self.guard.receive_allowed(req, 0, landing):
                report("refused", [])  # keep the KV out of pages no longer held for this request
                return {"error": f"{req}: pages no longer held for this transfer; refused"}
            target = torch.tensor(r.pages[:arrived], dtype=torch.long)
            shape = (arrived, self.pool.num_layers, 2, ps, self.pool.num_kv_heads, self.pool.head_dim)
            if arrived:
                data = torch.frombuffer(payload[: arrived * nbytes], dtype=torch.float32).view(shape)
                self.pool.import_pages(target, data)
            verdict = report("done", self.pool.page_checksums(torch.tensor(checked, dtype=torch.long)))
            if r.held:
                self.guard.release(req, 0, r.pages, "transfer_recv")
                r.held = False
                if r.state == "aborted":
                    self.give_back(r.pages)  # the drained reservation goes back to the pool now
            if verdict.kill:
                self._fail(r, verdict.reason(req))
            elif r.state == "reserved":
                r.state = "ready"
            self.wake.notify_all()
        return {"ok": True}

    # -- generate: decode admission, then wait for the batch loop to finish the request

    def op_generate(self, msg: dict[str, Any]) -> dict[str, Any]:
        req = msg["req"]
        deadline = time.monotonic() + float(msg.get("timeout_s", 60))
        with self.lock:
            r = self.requests.get(req)
            if r is None:
                return {"status": "error", "error": f"unknown request {req}"}
            while r.state == "reserved" and time.monotonic() < deadline:
                self.wake.wait(0.05)
            if r.state == "ready":
                # Decode admission: the hand-off was reported finished, so the request goes in.
                verdict = self.guard.admit(req, r.tenant, r.prompt_tokens, "decode")
                if verdict.kill:
                    self._fail(r, verdict.reason(req))
                else:
                    self._place(r)
                    r.state = "running"
                    self.wake.notify_all()
        r.done.wait(max(0.0, deadline - time.monotonic()))
        if r.state == "done":
            return {"status": "done", "tokens": r.generated}
        if r.state == "failed":
            return {"status": "killed", "error": r.error}
        return {"status": "error", "error": f"request {req} did not finish ({r.state})"}

    def _place(self, r: DecodeRequest) -> None:
        r.slot = self.slots_free.pop()
        row = self.slot_tables[r.slot]
        row[:] = 0
        row[: len(r.pages)] = r.pages
        neighbours = [o for o in self.requests.values() if o.state == "running" and o.slot >= 0]
        if "block_table" in self.faults and neighbours:
            # The bug: the row is copied from the neighbouring batch slot beyond the first page.
            other = self.slot_tables[neighbours[0].slot]
            row[1 : len(r.pages)] = other[1 : len(r.pages)]

    def on_kill(self, req: str, reason: str) -> None:
        r = self.requests.get(req)
        if r is not None and r.state in ("reserved", "ready", "running"):
            self._fail(r, f"terminated by the kvguard daemon: {reason}")
            self.wake.notify_all()

    # -- abort: the router gave up on the request

    def op_abort(self, msg: dict[str, Any]) -> dict[str, Any]:
        req = msg["req"]
        with self.lock:
            r = self.requests.get(req)
            if r is None:
                return {"ok": True}
            self.guard.abort(req, msg.get("reason", "aborted by the router"))
            if r.state in ("done", "failed", "aborted"):
                return {"ok": True}
            r.state = "aborted"
            if r.held and not msg.get("inflight", False):
                self.guard.release(req, 0, r.pages, "transfer_recv")  # no transfer will come
                r.held = False
            self._finish_pages(r)
            if "double_free" in self.faults:
                self.free_pages(r.req, r.pages)  # the bug: the error path frees them once more
            r.done.set()
            self.wake.notify_all()
        return {"ok": True}

    def _finish_pages(self, r: DecodeRequest) -> None:
        """Give the grant back; while a transfer may still land, the pages stay held."""
        if r.slot >= 0:
            self.slots_free.append(r.slot)
            r.slot = -1
        if r.held and "late_write" in self.faults:
            self.guard.release(r.req, 0, r.pages, "transfer_recv")  # the bug: drop the hold early
            r.held = False
        if r.held:
            self.guard.free(r.req, 0, r.pages)  # back to the pool when the transfer drains
        else:
            self.free_pages(r.req, r.pages)

    def _fail(self, r: DecodeRequest, error: str) -> None:
        if r.state in ("done", "failed"):
            return
        r.state, r.error = "failed", error
        self._finish_pages(r)
        r.done.set()

    # -- the decode loop: one batch step at a time over every running request

    def _decode_loop(self) -> None:
        pause = self.config.decode_step_ms / 1000
        idle = True
        while True:
            with self.lock:
                batch = [r for r in self.requests.values() if r.state == "running"]
                if not batch:
                    self.wake.wait(0.5)
                    idle = True
                    continue
                if not (idle and pause):
                    self._step(batch)
            # With slow steps staged, a request admitted to an idle loop waits for the next step
            # boundary as it would behind a running batch, not less: the window in which a
            # verdict from afar can still stop its first attention does not depend on whether
            # the request before it had finished.
            idle = False
            if pause:
                time.sleep(pause)

    def _step(self, batch: list[DecodeRequest]) -> None:
        ps = self.config.page_size
        lens = np.array([r.prompt_tokens + len(r.generated) for r in batch], dtype=np.int64)
        tables = self.slot_tables[[r.slot for r in batch]]
        if self.pool.device.type == "cuda":  # the tag check runs on the device, on its block tables
            on_device = (
                torch.from_numpy(tables).to(self.pool.device),
                torch.from_numpy(lens).to(self.pool.device),
            )
            verdict = self.guard.check_attention(0, [r.req for r in batch], *on_device)
        else:
            verdict = self.guard.check_attention(0, [r.req for r in batch], tables, lens)
        if verdict.kill:
            for r in batch:
                if r.req in verdict.kill:
                    self._fail(r, verdict.reason(r.req))
            keep = [i for i, r in enumerate(batch) if r.req not in verdict.kill]
            batch = [batch[i] for i in keep]
            if not batch:
                return
            lens, tables = lens[keep], tables[keep]
        steps = torch.tensor([len(r.generated) for r in batch], dtype=torch.long)
        tokens = self.model.decode_step(self.pool, torch.from_numpy(tables), torch.from_numpy(lens), steps)
        # Each new token's KV goes at position `len`; a full last page needs a new page first.
        for i, r in enumerate(batch):
            pos = int(lens[i])
            if pos // ps >= len(r.pages):
                more = self.take_pages(r.req, 1)
                if more is None:
                    self._fail(r, "decode KV pool exhausted")
                    continue
                r.pages += more
                self.slot_tables[r.slot, len(r.pages) - 1] = more[0]
        live = [i for i, r in enumerate(batch) if r.state == "running"]
        rows = self.slot_tables[[batch[i].slot for i in live]]
        self.model.append(self.pool, torch.from_numpy(rows), torch.from_numpy(lens[live]), tokens[live])
        for i in live:
            r, pos = batch[i], int(lens[i])
            self.guard.write(r.req, 0, [int(rows[live.index(i), pos // ps])], [pos % ps + 1])
            r.generated.append(int(tokens[i]))
            if len(r.generated) >= r.max_tokens:
                self.guard.finish(r.req, len(r.generated))
                r.state = "done"
                self._finish_pages(r)
                r.done.set()


# ====================================================================== process entry


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvguard testbed worker (started by the router)")
    parser.add_argument("--config", required=True, help="worker configuration as JSON")
    args = parser.parse_args(argv)
    raw = json.loads(args.config)
    raw["faults"] = check_faults(raw.get("faults", []))
    config = WorkerConfig(**raw)
    torch.set_num_threads(1)
    worker: Worker = PrefillWorker(config) if config.role == "prefill" else DecodeWorker(config)

    def stop(signum: int, frame: object) -> None:
        worker.guard.sink.close()
        os._exit(0)

    # The router stops the workers (SIGTERM) after it has asked them to flush; a Ctrl-C in the
    # terminal reaches the whole process group, and only the router should act on it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, stop)

    def ready(ports: dict[str, Any]) -> None:
        print(json.dumps({"ready": True, "pid": os.getpid(), **ports}), flush=True)

    worker.serve(ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
