"""Paged KV storage and paged attention: the compute core of the testbed engine.

A :class:`KVPool` holds the KV cache of every layer in fixed-size pages, exactly as real engines do
(vLLM, SGLang): ``k`` and ``v`` are ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``.
A request owns a *block table*, the list of page ids holding its logical pages in order; absolute
token position ``p`` lives in page ``block_table[p // page_size]``, slot ``p % page_size``.

Invariant kept here (the point of the testbed): **a page is never scrubbed**. The pool is zeroed
once, at construction; after that a page holds whatever its last writer put there until the next
writer overwrites it, slot by slot. Nothing in this module knows or checks who owns a page:
:func:`paged_attention` reads every page named in a block table, up to ``context_len`` positions,
so a block table that names a page still holding another request's KV makes that request attend to
the other request's data. That is the cross-tenant leak kvguard exists to catch.

Everything runs on the device of the tensors it is given (CPU or CUDA, same code) and is
vectorised: one gather per layer for a whole decode batch, one ``index_put_`` per write, one
``index_select`` per checksum batch; no Python loop per page, per token or per request.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from kvguard.agents import guard
from kvguard.agents.guard import CHECKSUM_MULTIPLIER

__all__ = [
    "CHECKSUM_MULTIPLIER",
    "KVPool",
    "default_scale",
    "dense_attention",
    "page_checksums",
    "paged_attention",
    "prefill_attention",
    "token_slots",
]


def token_slots(
    block_table: torch.Tensor, positions: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Map absolute token positions to ``(page ids, slots)`` through a block table.

    ``block_table`` is either one request's table ``[n_pages]`` with ``positions`` of any shape
    (``page = block_table[pos // page_size]``), or a batch of tables ``[B, max_pages]`` with one
    position per request ``positions: [B]`` (``page = block_table[i, pos_i // page_size]``).
    ``slot = pos % page_size`` in both cases. No bounds check beyond torch's own indexing.
    """
    positions = positions.to(device=block_table.device, dtype=torch.long)
    logical = torch.div(positions, page_size, rounding_mode="floor")
    slots = positions % page_size
    if block_table.dim() == 1:
        pages = block_table[logical]
    elif block_table.dim() == 2:
        if positions.shape != (block_table.shape[0],):
            raise ValueError(
                f"batched token_slots needs positions [B={block_table.shape[0]}], "
                f"got {tuple(positions.shape)}"
            )
        pages = block_table.gather(1, logical.unsqueeze(1)).squeeze(1)
    else:
        raise ValueError(f"block_table must be 1-D or 2-D, got shape {tuple(block_table.shape)}")
    return pages, slots


class KVPool:
    """Fixed pool of KV pages for all layers; pages are zeroed once and never scrubbed again.

    ``k`` and ``v``: ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``.
    """

    def __init__(
        self,
        num_pages: int,
        page_size: int,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        if min(num_pages, page_size, num_layers, num_kv_heads, head_dim) < 1:
            raise ValueError("all KVPool dimensions must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v = torch.zeros(shape, dtype=dtype, device=self.device)

    def __repr__(self) -> str:
        return (
            f"KVPool(num_pages={self.num_pages}, page_size={self.page_size}, num_layers={self.num_layers}, "
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, "
            f"device={self.device})"
        )

    @property
    def page_nbytes(self) -> int:
        """Bytes of one page: K and V of every layer."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.page_size * self.num_kv_heads * self.head_dim * elem

    def regions(self) -> list[dict[str, int]]:
        """Where the pages lie in memory, as a pool event's KvRegions (what an engine registers
        for RDMA): one region per layer of K and of V, page p of it at base + p * stride."""
        stride = self.k[0, 0].nbytes
        return [
            {"base": t[layer].data_ptr(), "stride": stride}
            for t in (self.k, self.v)
            for layer in range(self.num_layers)
        ]

    @property
    def words_per_page(self) -> int:
        """Number of 32-bit words in one page's checksum stream (``page_nbytes // 4``)."""
        return self.page_nbytes // 4

    # ------------------------------------------------------------------ addressing and writes

    def token_slots(
        self, block_table: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(pages, slots)`` of absolute ``positions`` through ``block_table`` (see :func:`token_slots`)."""
        return token_slots(block_table, positions, self.page_size)

    def write(
        self, layer: int, pages: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> None:
        """Write ``k, v: [n_tokens, num_kv_heads, head_dim]`` of one layer into ``(pages[i], slots[i])``.

        One ``index_put_`` per tensor. Only the named slots change: the rest of each page keeps
        whatever it held before (possibly another request's KV).
        """
        expect = (pages.shape[0], self.num_kv_heads, self.head_dim)
        if k.shape != expect or v.shape != expect or slots.shape != pages.shape:
            raise ValueError(
                f"write: pages {tuple(pages.shape)}, slots {tuple(slots.shape)}, k {tuple(k.shape)}, "
                f"v {tuple(v.shape)}; expected k/v {expect}"
            )
        index = (pages.to(self.device), slots.to(self.device))
        self.k[layer].index_put_(index, k.to(device=self.device, dtype=self.dtype))
        self.v[layer].index_put_(index, v.to(device=self.device, dtype=self.dtype))

    # ------------------------------------------------------------------ transfer

    def export_pages(self, pages: torch.Tensor) -> torch.Tensor:
        """K and V of every layer of ``pages``, as one contiguous tensor for sending.

        Shape ``[n, num_layers, 2, page_size, num_kv_heads, head_dim]`` (index 0 of the third axis
        is K, 1 is V). Its row-major byte order per page is the checksum stream of
        :meth:`page_checksums`.
        """
        pages = pages.to(device=self.device, dtype=torch.long)
        data = torch.stack((self.k.index_select(1, pages), self.v.index_select(1, pages)), dim=2)
        # [L, n, 2, P, H, D] -> [n, L, 2, P, H, D]
        return data.transpose(0, 1).contiguous()

    def import_pages(self, pages: torch.Tensor, data: torch.Tensor) -> None:
        """Inverse of :meth:`export_pages`: write ``data`` into page ids ``pages`` (any ids of this pool)."""
        pages = pages.to(device=self.device, dtype=torch.long)
        expect = (pages.shape[0], self.num_layers, 2, self.page_size, self.num_kv_heads, self.head_dim)
        if tuple(data.shape) != expect:
            raise ValueError(f"import_pages: data shape {tuple(data.shape)}, expected {expect}")
        if data.dtype != self.dtype:
            raise ValueError(f"import_pages: data dtype {data.dtype}, pool dtype {self.dtype}")
        data = data.to(self.device).transpose(0, 1)  # [L, n, 2, P, H, D]
        self.k.index_copy_(1, pages, data[:, :, 0])
        self.v.index_copy_(1, pages, data[:, :, 1])

    # ------------------------------------------------------------------ checksums

    def page_checksums(self, pages: torch.Tensor) -> np.ndarray:
        """One 64-bit checksum per page, computed on the pool's device; returns ``uint64[n]``.

        Definition (a GPU kernel must reproduce it bit for bit):

        * The page's *stream* is its bytes in this order: for layer ``0..L-1``: the page's K block
          (``page_size * num_kv_heads * head_dim`` elements, row-major ``[slot, head, dim]``), then
          its V block. This is exactly the row-major bytes of ``export_pages(pages)[j]``, with each
          element in its native little-endian encoding.
        * The stream is cut into little-endian unsigned 32-bit words ``w_0 .. w_{m-1}``
          (``m = page_nbytes / 4``). For float32 ``w_i`` is the raw IEEE bit pattern of element
          ``i``. For 16-bit dtypes (float16, bfloat16) consecutive elements are packed in pairs:
          ``w_j = bits(e_{2j}) | bits(e_{2j+1}) << 16`` (the stream of a page always has an even
          number of elements, K and V). For 8-byte dtypes each element gives two words, low half
          first. 8-bit dtypes pack four elements per word (needs ``page_nbytes % 4 == 0``).
        * ``checksum = (sum_i w_i * (2*i + 1) * 0x9E3779B1) mod 2**64``.

        The sum is computed with torch int64 arithmetic: int64 multiplication and summation wrap
        modulo 2**64 (two's complement) on CPU and CUDA, and modular addition does not depend on the
        summation order, so the result is exact; the int64 result is reinterpreted as uint64.
        The weight ``(2i+1)*C`` is odd, so flipping any single bit changes the checksum, and the
        position dependence makes swapped words change it too (unless the words are equal).
        Computed where the pool is, read in place through the page list: the CuPy kernel on
        CUDA, PyTorch on the CPU (the guard's page_checksums; the two agree bit for bit).
        """
        if not np.little_endian:  # pragma: no cover - every CUDA host is little-endian
            raise RuntimeError("page_checksums assumes a little-endian host")
        return guard.page_checksums(self.k, self.v, pages)


def page_checksums(pool: KVPool, pages: torch.Tensor) -> np.ndarray:
    """Function form of :meth:`KVPool.page_checksums`."""
    return pool.page_checksums(pages)


# ---------------------------------------------------------------------- attention


def _group_query(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """``[..., heads_q, D] -> [..., kv_heads, group, D]`` for grouped-query attention."""
    heads_q = q.shape[-2]
    if heads_q % num_kv_heads:
        raise ValueError(f"heads_q={heads_q} is not a multiple of num_kv_heads={num_kv_heads}")
    return q.reshape(*q.shape[:-2], num_kv_heads, heads_q // num_kv_heads, q.shape[-1])


def paged_attention(
    q: torch.Tensor,
    pool: KVPool,
    layer: int,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Decode attention for a batch, reading K/V from pages through each request's block table.

    ``q: [B, heads_q, head_dim]`` (one new token per request), ``block_tables: [B, max_pages]``
    (rows padded with any valid page id), ``context_lens: [B]`` (each >= 1; positions
    ``>= context_len`` are masked out). ``heads_q`` must be a multiple of ``pool.num_kv_heads``
    (grouped-query attention: query head ``h`` uses KV head ``h // (heads_q // num_kv_heads)``).
    Returns ``[B, heads_q, head_dim]`` in ``q.dtype``.

    One gather for the whole batch (``index_select`` of ``B * max_pages`` pages), scores in the
    pool's dtype, softmax in float32. Masked positions get score ``-inf`` and value 0, so whatever
    the unused slots or pages hold (even inf/NaN) cannot reach the result. Every position below
    ``context_len`` is read, whoever wrote it: this kernel performs no ownership check.

    Both products are single ``bmm`` calls on the gathered ``[B, T, Hk*D]`` tensors in their
    natural (page) layout, against a block-diagonal query matrix (zeros off each KV head's block):
    this avoids transposing the gathered K/V, which costs more than the extra multiply-adds by
    zero, since decode attention is memory-bound. (Side effect: a non-finite K value at a *valid*
    position poisons that position's score for every head, not only its own; masked positions
    are unaffected.)
    """
    bsz, heads_q, head_dim = q.shape
    if block_tables.dim() != 2 or block_tables.shape[0] != bsz or context_lens.shape != (bsz,):
        raise ValueError(
            f"paged_attention: q {tuple(q.shape)}, block_tables {tuple(block_tables.shape)}, "
            f"context_lens {tuple(context_lens.shape)}"
        )
    device = pool.device
    span = block_tables.shape[1] * pool.page_size
    hk = pool.num_kv_heads
    flat = block_tables.to(device=device, dtype=torch.long).reshape(-1)
    k = pool.k[layer].index_select(0, flat).view(bsz, span, hk * head_dim)
    v = pool.v[layer].index_select(0, flat).view(bsz, span, hk * head_dim)

    valid = torch.arange(span, device=device).unsqueeze(0) < context_lens.to(device).unsqueeze(1)  # [B, T]
    v.masked_fill_(~valid.unsqueeze(2), 0)  # v is a fresh gathered copy

    qg = _group_query(q.to(pool.dtype), hk)  # [B, Hk, G, D]
    group = qg.shape[2]
    # block-diagonal queries: qbd[b, j*D + d, i*G + g] = qg[b, i, g, d] if i == j else 0
    qbd = torch.diag_embed(qg.permute(0, 3, 2, 1))  # [B, D, G, Hk(j), Hk(i)]
    qbd = qbd.permute(0, 3, 1, 4, 2).reshape(bsz, hk * head_dim, heads_q)
    scores = torch.bmm(k, qbd).float() * scale  # [B, T, heads_q]
    scores.masked_fill_(~valid.unsqueeze(2), float("-inf"))
    probs = torch.softmax(scores, dim=1).to(v.dtype)
    full = torch.bmm(probs.transpose(1, 2), v)  # [B, heads_q, Hk*D]: every query head against every KV head
    out = full.view(bsz, hk, group, hk, head_dim).diagonal(dim1=1, dim2=3)  # [B, G, D, Hk]
    return out.permute(0, 3, 1, 2).reshape(bsz, heads_q, head_dim).to(q.dtype)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Reference decode attention for one request: ``q: [heads_q, D]`` over all of ``k, v: [T, Hk, D]``.

    Returns ``[heads_q, D]``. Same math as :func:`paged_attention` without pages or masks.
    """
    qg = _group_query(q, k.shape[1])  # [Hk, G, D]
    scores = torch.matmul(qg, k.permute(1, 2, 0)).float() * scale  # [Hk, G, T]
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.transpose(0, 1))  # [Hk, G, D]
    return out.reshape(q.shape).to(q.dtype)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention of one prompt: ``q: [T, heads_q, D]``, ``k, v: [T, Hk, D]`` -> like ``q``.

    Dense (the prompt's own K/V, not read from pages); prefill writes its K/V into the pool
    afterwards with :meth:`KVPool.write`. Grouped-query attention as in :func:`paged_attention`.
    """
    t, heads_q, head_dim = q.shape
    hk = k.shape[1]
    qg = _group_query(q, hk).permute(1, 2, 0, 3)  # [Hk, G, T, D]
    scores = torch.matmul(qg, k.permute(1, 2, 0).unsqueeze(1)).float() * scale  # [Hk, G, T, T]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu_(1)
    scores.masked_fill_(causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    out = torch.matmul(probs, v.permute(1, 0, 2).unsqueeze(1))  # [Hk, G, T, D]
    return out.permute(2, 0, 1, 3).reshape(t, heads_q, head_dim).to(q.dtype)


def default_scale(head_dim: int) -> float:
    """The usual ``1 / sqrt(head_dim)`` attention scale."""
    return 1.0 / math.sqrt(head_dim)
