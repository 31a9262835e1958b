"""The PD half of the SGLang adapter (`PdTransfers`, a part of `SglangAdapter`): SGLang's KV
senders and receivers as kvguard's transfers.

Invariants: a transfer is done when the engine's own poll says Success; a receiver's pages
that did not change since they were reserved did not arrive (the receiver's "Success" counts
ranks, not pages), and a kill turns that poll into Failed, so SGLang's own failure path
aborts the request before its first forward; each sender and receiver is concluded once.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvguard.agents.guard import GuardAPI
from kvguard.agents.guard.verdict import merged
from kvguard.agents.sglang.pages import PageBook

POOL = 0  # the scheduler's one KV pool (hybrid pools: not yet mapped)
UNNAMED = "?"  # the other side of a PD pair: SGLang knows its bootstrap address, not its node name


def host_ints(values: Any) -> np.ndarray:
    """Integers of a torch tensor (on any device), a list or an array, as a flat int64 array."""
    if hasattr(values, "detach"):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)


def page_digests(kvcache: Any, pages: np.ndarray, page_size: int) -> np.ndarray:
    """A digest per page of layer 0's K and V as they lie now (a change detector, not a
    checksum two nodes compare): torch on the pool's own device, one call for all pages."""
    import torch

    slots = torch.as_tensor(pages, device=kvcache.k_buffer[0].device)[:, None] * page_size
    slots = slots + torch.arange(page_size, device=slots.device)
    parts = []
    for buf in (kvcache.k_buffer[0], kvcache.v_buffer[0]):
        raw = buf[slots.reshape(-1)].contiguous().view(torch.uint8).reshape(len(pages), -1)
        weights = torch.arange(1, raw.shape[1] + 1, device=raw.device, dtype=torch.int64)
        parts.append((raw.to(torch.int64) * weights).sum(dim=1))
    return (parts[0] * 1_000_003 + parts[1]).cpu().numpy()


class PdTransfers:
    """The adapter's state this half reads (set by SglangAdapter) and the state it keeps."""

    guard: GuardAPI
    book: PageBook | None
    allocator: Any
    rids: list[str]
    live: dict[int, Any]
    prompt: dict[int, int]
    rooms: dict[int, int]  # bootstrap room -> request index
    sending: dict[int, list[Any]]  # id(sender) -> [pages sent, tokens sent]
    receiving: dict[int, tuple[int, np.ndarray, np.ndarray, int]]
    receiver_room: dict[int, int]
    concluded: dict[int, bool]  # id(sender/receiver) -> may go on

    def sender_init(self, sender: Any) -> None:
        idx = self.rooms.get(int(getattr(sender, "bootstrap_room", -1) or -1))
        if idx is None:
            return
        req = self.live.get(idx)
        prefix = int(getattr(req, "disagg_decode_prefix_len", 0) or 0) if req is not None else 0
        self.sending[id(sender)] = [[], 0]
        self.guard.bootstrap(self.rids[idx], self.guard.node, UNNAMED, self.prompt[idx] - prefix)

    def sent(self, sender: Any, kv_indices: Any, num_kv_tokens: int | None) -> None:
        entry = self.sending.setdefault(id(sender), [[], 0])
        pages = host_ints(kv_indices)
        entry[0].append(pages)
        entry[1] += int(num_kv_tokens) if num_kv_tokens is not None else len(pages) * self.book.page_size

    def sender_polled(self, sender: Any, state: Any, success: Any, failed: Any) -> Any:
        key = id(sender)
        if key in self.concluded:
            return state if self.concluded[key] else failed
        if state not in (success, failed):
            return state
        idx = self.rooms.get(int(getattr(sender, "bootstrap_room", -1) or -1))
        entry = self.sending.pop(key, None)
        if idx is None or entry is None:
            return state
        pages = np.concatenate(entry[0]) if entry[0] else np.zeros(0, np.int64)
        verdict = self.guard.xfer_send(
            self.rids[idx],
            f"room-{sender.bootstrap_room}",
            "",
            POOL,
            pages,
            entry[1],
            0,
            status="done" if state == success else "failed",
        )
        ok = verdict.ok
        self.concluded[key] = ok
        return state if ok else failed

    def receiver_made(self, receiver: Any, room: Any) -> None:
        if room is not None:
            self.receiver_room[id(receiver)] = int(room)

    def reserved(self, receiver: Any, kv_indices: Any, decode_prefix_len: int | None) -> None:
        """Decode told prefill where to write: these pages, whose content is noted now."""
        idx = self.rooms.get(self.receiver_room.get(id(receiver), -1))
        if idx is None or self.book is None:
            return
        pages = host_ints(kv_indices)
        before = page_digests(self.allocator.get_kvcache(), pages, self.book.page_size)
        expected = self.prompt[idx] - int(decode_prefix_len or 0)
        self.receiving[id(receiver)] = (idx, pages, before, expected)
        self.guard.bootstrap(self.rids[idx], UNNAMED, self.guard.node, expected)

    def receiver_polled(self, receiver: Any, state: Any, success: Any, failed: Any) -> Any:
        key = id(receiver)
        if key in self.concluded:
            return state if self.concluded[key] else failed
        if state not in (success, failed) or key not in self.receiving:
            return state
        idx, pages, before, expected = self.receiving.pop(key)
        ps = self.book.page_size
        rid = self.rids[idx]
        changed = page_digests(self.allocator.get_kvcache(), pages, ps) != before
        landed = int(changed.sum())
        tokens = min(landed * ps, expected) if state == success else 0
        ordered = np.concatenate((pages[changed], pages[~changed]))
        room = self.receiver_room.get(key, -1)
        verdict = self.guard.xfer_recv(
            rid, f"room-{room}", "", POOL, ordered, tokens, 0, status="done" if state == success else "failed"
        )
        if state == success and verdict.ok:
            # The check before attention, now: the request joins no batch if it fails.
            verdict = merged(
                verdict, self.guard.check_attention(POOL, [rid], pages[None, :], np.array([expected]))
            )
        ok = verdict.ok
        self.concluded[key] = ok
        return state if ok else failed
