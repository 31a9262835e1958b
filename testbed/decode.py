"""The testbed's decode worker: bootstrap reservations, KV receipt from prefill over a TCP
connection of its own, and continuous batching of decode steps.

Invariants: pages reserved at bootstrap stay held (transfer_recv) until the transfer has
landed or is known not to come; KV is checked on receipt before the request may be decoded;
the guard checks every batch before each attention launch, and a verdict that kills a request
fails that request alone: the rest of the batch goes on. With every fault switch off this is a
correct decode (a request attends only to KV it wrote or was legitimately given); each switch
breaks exactly the code path that testbed.faults describes.
"""

from __future__ import annotations

import contextlib
import math
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvguard.agents.guard import Verdict
from kvguard.testbed import wire
from kvguard.testbed.worker import Killed, Worker, WorkerConfig


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

    def op_generate(self, msg: dict[str, Any]) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """The request's outcome; with `stream`, its tokens as they come ({"tokens"}), then it."""
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
        if msg.get("stream"):
            return self._stream(r, deadline)
        r.done.wait(max(0.0, deadline - time.monotonic()))
        return self._outcome(r, {"tokens": r.generated})

    def _stream(self, r: DecodeRequest, deadline: float) -> Iterator[dict[str, Any]]:
        sent = 0
        while True:
            with self.lock:  # each decode step and each end of a request wakes it
                while len(r.generated) == sent and not r.done.is_set() and time.monotonic() < deadline:
                    self.wake.wait(max(0.0, deadline - time.monotonic()))
                new, finished = r.generated[sent:], r.done.is_set() or time.monotonic() >= deadline
            if new:
                sent += len(new)
                yield {"tokens": new}
            if finished:
                yield self._outcome(r, {"output_tokens": sent})
                return

    @staticmethod
    def _outcome(r: DecodeRequest, done: dict[str, Any]) -> dict[str, Any]:
        if r.state == "done":
            return {"status": "done", **done}
        if r.state == "failed":
            return {"status": "killed", "error": r.error}
        return {"status": "error", "error": f"request {r.req} did not finish ({r.state})"}

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
                    try:
                        self._step(batch)
                    finally:
                        self.guard.step_done()  # its kernels are launched: the next needs a check
                    self.wake.notify_all()  # the streams (op_generate) take their new tokens
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
        if "unguarded_attention" in self.faults:  # attention reached by a path the guard does not hook
            verdict = Verdict()
        elif self.pool.device.type == "cuda":  # the tag check runs on the device, on its block tables
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
        if self.kernels is not None:
            self.kernels.decode()
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
        # The batch's new tokens: one step event (the guard's per-step cost, not per request).
        positions = lens[live]
        written = self.guard.step(
            0, [batch[i].req for i in live], rows[np.arange(len(live)), positions // ps], positions % ps + 1
        )
        for i in live:
            r = batch[i]
            if r.req in written.kill:
                self._fail(r, written.reason(r.req))
                continue
            r.generated.append(int(tokens[i]))
            if len(r.generated) >= r.max_tokens:
                self.guard.finish(r.req, len(r.generated))
                r.state = "done"
                self._finish_pages(r)
                r.done.set()
