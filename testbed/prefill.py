"""The testbed's prefill worker: admission, the prefill forward, and the KV send to decode,
with a prefix cache (identical prompts share pages) and a host offload cache.

Invariants: a prompt that cannot fit the pool is rejected and goes no further (only the
``incident`` fault lets it through, as a one-token placeholder). What leaves the node is
checked as attention reads it, before the transfer, not reported after it. A cached prompt
keeps its origin's grant until eviction; a share ends with the sharer's free. Offloaded pages
go back to the pool only when the copy to host memory is done (the offload hold). With every
fault switch off this is a correct prefill; each switch breaks exactly the code path that
testbed.faults describes.
"""

from __future__ import annotations

import math
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvguard.testbed import wire
from kvguard.testbed.worker import Killed, PoolFull, Worker, WorkerConfig

PLACEHOLDER = ord("?")  # the 1-token prompt a rejected request is swapped for (the incident)
CHUNKED_PAGES = 3  # prompts of more pages are prefilled in chunks (where half_written_page strikes)


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
