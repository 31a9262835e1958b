"""Models that run on the paged KV cache of :mod:`kvguard.testbed.paged`.

* :class:`EchoModel` - a one-layer, one-head attention "model" over byte tokens whose response
  repeats its context verbatim. It exists to make a KV leak *visible in the content*: decode step
  ``t`` looks up the KV stored at absolute position ``t`` through the real paged-attention kernel,
  so if a block table names a page that still holds another user's prompt, the response contains
  that user's bytes, verbatim.
* :class:`TinyTransformer` - a random-weight decoder (RMSNorm, rotary attention with optional
  grouped-query heads, SwiGLU MLP) used by the benchmarks as a realistic compute load.

Invariant kept by both: decode attention always goes through :func:`paged_attention`, reading
exactly the pages named in the block tables up to each request's context length, with no ownership
check (that is kvguard's job, outside the model); K/V reach the pool only through
:meth:`KVPool.write`, in the slots of the request's own block table, never zeroing anything else.
All methods are batched and vectorised; they run on the device of the pool and model tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .paged import KVPool, paged_attention, prefill_attention, token_slots

__all__ = ["EchoModel", "TinyTransformer", "TransformerConfig"]


# ---------------------------------------------------------------------- EchoModel


class EchoModel:
    """One-layer, one-head byte model: a response of ``n`` tokens repeats the first ``n`` bytes of context.

    Contract: tokens are the bytes of UTF-8 text (vocabulary 256). The KV of a token with byte ``b``
    at absolute position ``p`` is ``k = key_scale * c_p`` and ``v = one_hot(b)``, where the ``c_p``
    (``p < max_context``) are fixed random unit vectors of dimension ``HEAD_DIM = 256`` drawn from a
    seeded generator. The query of decode step ``t`` (the ``t``-th generated token, from 0) is
    ``key_scale * c_t`` and the attention scale is 1, so the logit of position ``p`` is
    ``key_scale**2 * <c_t, c_p>``: ``key_scale**2`` at ``p == t`` and at most about
    ``0.35 * key_scale**2`` elsewhere (dimension 256, 8192 positions). With ``key_scale = 10`` the gap
    is > 60 nats, so in float32 the softmax is exactly one-hot for contexts well beyond 8192 tokens
    and the emitted token (argmax of the attention output) is the byte stored at position ``t``.

    Consequences the testbed relies on:

    * a request whose pages are its own answers with its own prompt, verbatim (generated tokens are
      appended at positions ``>= prompt_len``, so a response longer than the prompt keeps
      repeating the context: token ``t`` is the byte at position ``t``);
    * if the block table maps logical page ``j`` to a page another request wrote *at the same
      logical index* (positions ``j*page_size ..``), the response carries that request's bytes at
      those positions, verbatim. A stale page written at other positions holds keys that match no
      query of this request; the lookup then degrades to an arbitrary mixture (still wrong output,
      but not verbatim text).
    """

    VOCAB = 256
    HEAD_DIM = 256

    def __init__(
        self,
        page_size: int,
        max_context: int,
        device: torch.device | str = "cpu",
        seed: int = 0,
        key_scale: float = 10.0,
    ) -> None:
        self.page_size = page_size
        self.max_context = max_context
        self.device = torch.device(device)
        self.key_scale = float(key_scale)
        gen = torch.Generator().manual_seed(seed)
        codes = torch.randn(max_context, self.HEAD_DIM, generator=gen, dtype=torch.float64)
        codes = codes / codes.norm(dim=1, keepdim=True)
        self.codes = codes.to(dtype=torch.float32).to(self.device)  # [max_context, HEAD_DIM], unit rows
        self._eye = torch.eye(self.VOCAB, dtype=torch.float32, device=self.device)

    def pool(self, num_pages: int) -> KVPool:
        """A :class:`KVPool` matching this model (1 layer, 1 KV head, head_dim 256, float32)."""
        return KVPool(num_pages, self.page_size, 1, 1, self.HEAD_DIM, torch.float32, self.device)

    @staticmethod
    def encode(text: str | bytes) -> torch.Tensor:
        """UTF-8 bytes of ``text`` as a LongTensor of tokens (CPU)."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return torch.tensor(list(data), dtype=torch.long)

    @staticmethod
    def decode(tokens: torch.Tensor) -> bytes:
        """Tokens back to raw bytes (decode as UTF-8 yourself; a leak may split a character)."""
        return bytes(tokens.detach().to("cpu", torch.uint8).tolist())

    def _kv(self, tokens: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = tokens.to(device=self.device, dtype=torch.long)
        positions = positions.to(device=self.device, dtype=torch.long)
        k = (self.key_scale * self.codes[positions]).unsqueeze(1)
        v = self._eye[tokens].unsqueeze(1)
        return k, v

    def kv_for(self, tokens: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V ``[T, 1, HEAD_DIM]`` of ``tokens`` placed at positions ``start_pos .. start_pos+T-1``."""
        positions = torch.arange(start_pos, start_pos + tokens.shape[0], device=self.device)
        return self._kv(tokens, positions)

    def prefill(
        self,
        pool: KVPool,
        block_table: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
    ) -> None:
        """Write the prompt's KV (layer 0) into positions ``0 .. T-1`` of ``block_table``'s pages,
        or only into ``positions`` of them (what a faulty engine computes)."""
        k, v = self.kv_for(tokens, 0)
        at = torch.arange(tokens.shape[0]) if positions is None else positions.to(dtype=torch.long)
        pages, slots = pool.token_slots(block_table, at.to(pool.device))
        pool.write(0, pages, slots, k[at.to(k.device)], v[at.to(v.device)])

    def decode_step(
        self, pool: KVPool, block_tables: torch.Tensor, context_lens: torch.Tensor, steps: torch.Tensor
    ) -> torch.Tensor:
        """Next token of every request of a batch: ``LongTensor[B]``.

        ``steps[i]`` is how many tokens request ``i`` has generated so far; its query looks up
        absolute position ``steps[i]`` among its first ``context_lens[i]`` positions (via
        :func:`paged_attention`). Does not write: the caller appends the new token's KV at
        position ``context_lens[i]`` (:meth:`append` or :meth:`kv_for`) and increments
        ``context_lens``.
        """
        steps = steps.to(device=self.device, dtype=torch.long)
        q = (self.key_scale * self.codes[steps]).unsqueeze(1)  # [B, 1, HEAD_DIM]
        out = paged_attention(q, pool, 0, block_tables, context_lens, scale=1.0)
        return out[:, 0].argmax(dim=-1)

    def append(
        self, pool: KVPool, block_tables: torch.Tensor, context_lens: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """Write the KV of one new token per request at position ``context_lens[i]`` (batched, one write)."""
        pages, slots = token_slots(block_tables, context_lens, pool.page_size)
        k, v = self._kv(tokens, context_lens)
        pool.write(0, pages, slots, k, v)

    def generate(
        self, pool: KVPool, block_tables: torch.Tensor, context_lens: torch.Tensor, max_new_tokens: int
    ) -> torch.Tensor:
        """Greedy-decode ``max_new_tokens`` for a batch whose prompts are already in the pool.

        Appends each new token's KV (block tables must cover ``context_lens + max_new_tokens``
        positions). Returns ``LongTensor[B, max_new_tokens]``; ``context_lens`` is not modified.
        """
        lens = context_lens.to(device=pool.device, dtype=torch.long).clone()
        out = torch.empty(lens.shape[0], max_new_tokens, dtype=torch.long, device=pool.device)
        for step in range(max_new_tokens):
            steps = torch.full_like(lens, step)
            tok = self.decode_step(pool, block_tables, lens, steps)
            self.append(pool, block_tables, lens, tok)
            out[:, step] = tok
            lens += 1
        return out


# ---------------------------------------------------------------------- TinyTransformer


@dataclass(frozen=True)
class TransformerConfig:
    """Shape of a :class:`TinyTransformer`; weights are random (seeded), for benchmarks only."""

    num_layers: int = 4
    d_model: int = 512
    num_heads: int = 8
    num_kv_heads: int = 8
    mlp_hidden: int = 2048
    vocab: int = 256
    page_size: int = 16
    dtype: torch.dtype = torch.float32
    seed: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    def __post_init__(self) -> None:
        if self.d_model % self.num_heads or self.num_heads % self.num_kv_heads:
            raise ValueError("d_model must be a multiple of num_heads, num_heads of num_kv_heads")
        if self.head_dim % 2:
            raise ValueError("head_dim must be even (rotary embedding)")


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


class TinyTransformer:
    """Random-weight decoder-only transformer on a paged KV cache (benchmark load).

    Per layer: ``x += Wo · attn(rope(Wq·n), rope(Wk·n), Wv·n)`` with ``n = RMSNorm(x)``, then
    ``x += W_down · (silu(W_gate·n) * W_up·n)`` with ``n = RMSNorm(x)``; final RMSNorm and LM head.
    Rotary position embedding (rotate-half form) on Q and K; grouped-query attention when
    ``num_kv_heads < num_heads``.

    KV contract: :meth:`prefill` writes the KV of prompt positions ``0..T-1`` of every layer.
    :meth:`decode_step` takes ``context_lens[i]`` = number of positions already in the pool and
    ``last_tokens[i]`` = the token at position ``context_lens[i]`` (not yet in the pool); for every
    layer it *writes that token's K/V at position* ``context_lens[i]`` before attending (as real
    engines do), then attends over ``context_lens[i] + 1`` positions. The caller's context length
    for the next step is therefore ``context_lens + 1``, and the block tables must already cover
    position ``context_lens[i]``.
    """

    def __init__(self, config: TransformerConfig, device: torch.device | str = "cpu") -> None:
        self.config = c = config
        self.device = torch.device(device)
        gen = torch.Generator().manual_seed(c.seed)
        hd, hq, hk, d, L = c.head_dim, c.num_heads, c.num_kv_heads, c.d_model, c.num_layers

        def rand(*shape: int, fan_in: int | None = None) -> torch.Tensor:
            t = torch.randn(*shape, generator=gen, dtype=torch.float32)
            if fan_in is not None:
                t = t / math.sqrt(fan_in)
            return t.to(dtype=c.dtype).to(self.device)

        def norm_weight() -> torch.Tensor:
            return (1.0 + 0.1 * torch.randn(L, d, generator=gen)).to(dtype=c.dtype).to(self.device)

        self.embed = rand(c.vocab, d)
        self.attn_norm = norm_weight()
        self.w_qkv = rand(L, d, (hq + 2 * hk) * hd, fan_in=d)
        self.w_o = rand(L, hq * hd, d, fan_in=hq * hd)
        self.mlp_norm = norm_weight()
        self.w_gate_up = rand(L, d, 2 * c.mlp_hidden, fan_in=d)
        self.w_down = rand(L, c.mlp_hidden, d, fan_in=c.mlp_hidden)
        self.final_norm = (1.0 + 0.1 * torch.randn(d, generator=gen)).to(dtype=c.dtype).to(self.device)
        self.lm_head = rand(d, c.vocab, fan_in=d)
        self.inv_freq = 1.0 / (
            c.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=self.device) / hd)
        )
        self.scale = 1.0 / math.sqrt(hd)

    def pool(self, num_pages: int) -> KVPool:
        """A :class:`KVPool` matching this model's layers, KV heads, head_dim, page size and dtype."""
        c = self.config
        return KVPool(num_pages, c.page_size, c.num_layers, c.num_kv_heads, c.head_dim, c.dtype, self.device)

    # ------------------------------------------------------------------ pieces

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotary embedding of ``x: [N, H, hd]`` at absolute ``positions: [N]`` (rotate-half form)."""
        ang = positions.to(device=x.device, dtype=torch.float32).unsqueeze(1) * self.inv_freq  # [N, hd/2]
        cos, sin = ang.cos().unsqueeze(1), ang.sin().unsqueeze(1)
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).to(x.dtype)

    def _qkv(
        self, layer: int, x: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        n = x.shape[0]
        h = _rms_norm(x, self.attn_norm[layer], c.norm_eps)
        qkv = h @ self.w_qkv[layer]
        kv_width = c.num_kv_heads * c.head_dim
        q, k, v = qkv.split((c.num_heads * c.head_dim, kv_width, kv_width), dim=1)
        q = self._rope(q.reshape(n, c.num_heads, c.head_dim), positions)
        k = self._rope(k.reshape(n, c.num_kv_heads, c.head_dim), positions)
        return q, k, v.reshape(n, c.num_kv_heads, c.head_dim)

    def _attn_out_and_mlp(self, layer: int, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        c = self.config
        x = x + attn.reshape(x.shape[0], -1) @ self.w_o[layer]
        h = _rms_norm(x, self.mlp_norm[layer], c.norm_eps)
        gate, up = (h @ self.w_gate_up[layer]).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ self.w_down[layer]

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return (_rms_norm(x, self.final_norm, self.config.norm_eps) @ self.lm_head).float()

    # ------------------------------------------------------------------ prompt

    def forward_dense(
        self,
        tokens: torch.Tensor,
        pool: KVPool | None = None,
        block_table: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[T, vocab]`` (float32) of a whole sequence with dense causal attention.

        With ``pool`` and ``block_table`` it also writes the K/V of every layer at positions
        ``0..T-1`` (that is prefill); without them it is the dense reference for tests.
        """
        tokens = tokens.to(device=self.device, dtype=torch.long)
        positions = torch.arange(tokens.shape[0], device=self.device)
        if pool is not None:
            if block_table is None:
                raise ValueError("forward_dense: a pool needs a block_table")
            pages, slots = pool.token_slots(block_table, positions)
        x = self.embed[tokens]
        for layer in range(self.config.num_layers):
            q, k, v = self._qkv(layer, x, positions)
            if pool is not None:
                pool.write(layer, pages, slots, k, v)
            x = self._attn_out_and_mlp(layer, x, prefill_attention(q, k, v, self.scale))
        return self._logits(x)

    def prefill(self, pool: KVPool, block_table: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """Run the prompt, write its K/V (all layers, positions ``0..T-1``); return the next token (0-dim)."""
        return self.forward_dense(tokens, pool, block_table)[-1].argmax()

    # ------------------------------------------------------------------ decode

    def decode_logits(
        self, pool: KVPool, block_tables: torch.Tensor, context_lens: torch.Tensor, last_tokens: torch.Tensor
    ) -> torch.Tensor:
        """Logits ``[B, vocab]`` (float32) of one decode step; writes each ``last_tokens[i]``'s K/V first.

        See the class docstring for the contract on ``context_lens`` (the KV of ``last_tokens`` is
        written at position ``context_lens[i]``; attention covers ``context_lens[i] + 1``).
        """
        lens = context_lens.to(device=self.device, dtype=torch.long)
        block_tables = block_tables.to(device=self.device, dtype=torch.long)
        pages, slots = token_slots(block_tables, lens, pool.page_size)
        attend = lens + 1
        x = self.embed[last_tokens.to(device=self.device, dtype=torch.long)]
        for layer in range(self.config.num_layers):
            q, k, v = self._qkv(layer, x, lens)
            pool.write(layer, pages, slots, k, v)
            attn = paged_attention(q, pool, layer, block_tables, attend, self.scale)
            x = self._attn_out_and_mlp(layer, x, attn)
        return self._logits(x)

    def decode_step(
        self, pool: KVPool, block_tables: torch.Tensor, context_lens: torch.Tensor, last_tokens: torch.Tensor
    ) -> torch.Tensor:
        """Greedy next tokens ``LongTensor[B]`` of one decode step (writes the K/V of ``last_tokens``)."""
        return self.decode_logits(pool, block_tables, context_lens, last_tokens).argmax(dim=-1)
