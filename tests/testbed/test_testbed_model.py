"""The testbed's compute core: paged attention equals dense attention and ignores what lies beyond
each context, the EchoModel repeats its own prompt and shows a stale page as another user's text
verbatim, page checksums match their bit-exact definition, export/import round-trips, and the
TinyTransformer's paged decode matches a dense recomputation."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from kvguard.testbed.models import EchoModel, TinyTransformer, TransformerConfig
from kvguard.testbed.paged import (
    CHECKSUM_MULTIPLIER,
    KVPool,
    dense_attention,
    paged_attention,
    prefill_attention,
)

# ---------------------------------------------------------------------- helpers


def random_pool(
    gen: torch.Generator, num_pages: int, page_size: int, layers: int, heads: int, dim: int
) -> KVPool:
    pool = KVPool(num_pages, page_size, layers, heads, dim)
    pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
    pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
    return pool


def shuffled_tables(
    gen: torch.Generator, num_pages: int, page_size: int, lens: list[int]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Disjoint, shuffled page lists per request, padded with page 0 into one [B, max_pages] table."""
    perm = torch.randperm(num_pages, generator=gen)
    need = [-(-n // page_size) for n in lens]
    max_pages = max(need) + 1  # always at least one pad column
    tables, own, at = torch.zeros(len(lens), max_pages, dtype=torch.long), [], 0
    for i, n in enumerate(need):
        own.append(perm[at : at + n])
        tables[i, :n] = own[-1]
        at += n
    return tables, own


def gather_dense(pool: KVPool, layer: int, pages: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    k = pool.k[layer, pages].reshape(-1, pool.num_kv_heads, pool.head_dim)[:n]
    v = pool.v[layer, pages].reshape(-1, pool.num_kv_heads, pool.head_dim)[:n]
    return k, v


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ---------------------------------------------------------------------- paged attention


class TestPagedAttention:
    @pytest.mark.parametrize(("heads_q", "heads_kv"), [(4, 4), (8, 2)])
    def test_matches_dense(self, heads_q: int, heads_kv: int) -> None:
        gen = torch.Generator().manual_seed(1)
        page, dim, layers = 16, 32, 2
        lens = [1, 5, 16, 17, 48, 70, 129]  # single token, partial, exact multiples, partial last pages
        pool = random_pool(gen, 64, page, layers, heads_kv, dim)
        tables, own = shuffled_tables(gen, 64, page, lens)
        q = torch.randn(len(lens), heads_q, dim, generator=gen)
        scale = dim**-0.5
        for layer in range(layers):
            out = paged_attention(q, pool, layer, tables, torch.tensor(lens), scale)
            assert out.shape == (len(lens), heads_q, dim)
            for i, n in enumerate(lens):
                k, v = gather_dense(pool, layer, own[i], n)
                assert rel_err(out[i], dense_attention(q[i], k, v, scale)) < 1e-5

    def test_mask_hides_garbage(self) -> None:
        gen = torch.Generator().manual_seed(2)
        page, dim = 8, 16
        lens = [3, 8, 13, 20]
        pool = random_pool(gen, 40, page, 1, 2, dim)
        tables, own = shuffled_tables(gen, 40, page, lens)
        q = torch.randn(len(lens), 4, dim, generator=gen)
        ctx = torch.tensor(lens)
        before = paged_attention(q, pool, 0, tables, ctx, 0.25)
        # garbage in the unused slots of every request's last page...
        for i, n in enumerate(lens):
            last, used = own[i][-1], n - (len(own[i]) - 1) * page
            pool.k[0, last, used:] = 1e30
            pool.v[0, last, used:] = float("nan")
        # ...and in every page no request uses, which includes the pad page column of each table
        unused = torch.ones(40, dtype=torch.bool)
        unused[torch.cat(own)] = False
        pool.k[0, unused] = float("inf")
        pool.v[0, unused] = -1e30
        tables[:, -1] = torch.nonzero(unused)[0, 0]  # pad with a garbage page
        after = paged_attention(q, pool, 0, tables, ctx, 0.25)
        assert torch.isfinite(after).all()
        torch.testing.assert_close(after, before, rtol=0, atol=0)

    def test_prefill_attention_is_causal_dense(self) -> None:
        gen = torch.Generator().manual_seed(3)
        t, hq, hk, dim = 11, 6, 3, 8
        q = torch.randn(t, hq, dim, generator=gen)
        k = torch.randn(t, hk, dim, generator=gen)
        v = torch.randn(t, hk, dim, generator=gen)
        out = prefill_attention(q, k, v, 0.3)
        for i in range(t):
            assert rel_err(out[i], dense_attention(q[i], k[: i + 1], v[: i + 1], 0.3)) < 1e-5


# ---------------------------------------------------------------------- EchoModel

PROMPTS = [
    "Hello, tenant A. My card number is 4111-1111-1111-1111.",  # > 1 page
    "short",
    "exactly thirty-two bytes long!!!",  # 2 pages of 16
    "Ünïcödé bytes are still bytes: ☃ and 🔑 travel verbatim",  # multi-byte UTF-8
]


def echo_batch(
    model: EchoModel, pool: KVPool, prompts: list[bytes], tables: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    lens = torch.tensor([len(p) for p in prompts])
    for i, p in enumerate(prompts):
        model.prefill(pool, tables[i], EchoModel.encode(p))
    return lens, model.generate(pool, tables, lens, int(lens.max()))


class TestEchoModel:
    def test_each_request_repeats_its_own_prompt(self) -> None:
        page = 16
        model = EchoModel(page, 256)
        pool = model.pool(64)
        prompts = [p.encode() for p in PROMPTS]
        assert len(prompts[2]) == 2 * page
        gen = torch.Generator().manual_seed(4)
        # room for prompt + response (2x the longest prompt)
        tables, _ = shuffled_tables(gen, 64, page, [2 * max(len(p) for p in prompts)] * len(prompts))
        lens, out = echo_batch(model, pool, prompts, tables)
        for i, p in enumerate(prompts):
            n = len(p)
            assert EchoModel.decode(out[i, :n]) == p
            # beyond the prompt it keeps repeating its context: token t is the byte at position t
            assert EchoModel.decode(out[i, n:]) == (p * (int(lens.max()) // n + 2))[n : int(lens.max())]
        assert EchoModel.decode(out[0, : len(prompts[0])]).decode() == PROMPTS[0]

    def test_stale_page_leaks_another_prompt_verbatim(self) -> None:
        page = 16
        model = EchoModel(page, 256)
        pool = model.pool(32)
        secret = b"tenant B secret: the launch code is 0000-CAFE-BABE, do not share!"
        victim = b"tenant A asks about the weather in Lisbon tomorrow, please?"
        # B's prompt was written earlier into pages 20..24; page 21 holds B's positions 16..31
        b_table = torch.tensor([20, 21, 22, 23, 24])
        model.prefill(pool, b_table, EchoModel.encode(secret))
        # A is granted 8 pages; 21 and 22 are stale (never scrubbed) and A's own prefill wrote only
        # its first page, as in the incident (a 1-page placeholder prefill for an 8-page reservation)
        a_table = torch.tensor([[3, 21, 22, 6, 7, 8, 9, 10]])
        model.prefill(pool, a_table[0, :1], EchoModel.encode(victim[:page]))
        out = model.generate(pool, a_table, torch.tensor([len(victim)]), len(victim))[0]
        got = EchoModel.decode(out)
        assert got[:page] == victim[:page]
        assert got[page : 3 * page] == secret[page : 3 * page]  # the other tenant's bytes, verbatim
        assert b"launch code is 0000-CAFE" in got
        # the same request with its own pages written answers correctly
        pool2 = model.pool(32)
        model.prefill(pool2, a_table[0], EchoModel.encode(victim))
        own = model.generate(pool2, a_table, torch.tensor([len(victim)]), len(victim))[0]
        assert EchoModel.decode(own) == victim

    def test_lookup_exact_for_8192_positions(self) -> None:
        page, n = 16, 8192
        model = EchoModel(page, n)
        pool = model.pool(n // page)
        gen = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, 256, (n,), generator=gen)
        table = torch.randperm(n // page, generator=gen)
        model.prefill(pool, table, tokens)
        # every position, with the kernel's math on the gathered context (chunks bound the memory)
        k = pool.k[0, table].reshape(n, -1)
        v = pool.v[0, table].reshape(n, -1)
        for start in range(0, n, 2048):
            q = model.key_scale * model.codes[start : start + 2048]
            probs = torch.softmax(q @ k.T, dim=-1)
            assert (probs.diagonal(offset=start) == 1.0).all()  # one-hot in float32
            assert torch.equal((probs @ v).argmax(dim=-1), tokens[start : start + 2048])
        # and 8 random positions through the paged kernel itself, shuffled table, full context
        steps = torch.randint(0, n, (8,), generator=gen)
        got = model.decode_step(pool, table.expand(8, -1), torch.full((8,), n), steps)
        assert torch.equal(got, tokens[steps])


# ---------------------------------------------------------------------- checksums and transfer


def reference_checksum(data: bytes) -> int:
    words = struct.unpack(f"<{len(data) // 4}I", data)
    return sum(w * (2 * i + 1) * CHECKSUM_MULTIPLIER for i, w in enumerate(words)) % 2**64


def page_bytes(pool: KVPool, page: int) -> bytes:
    """The page's stream, built independently of export_pages: per layer, K block then V block."""
    parts = []
    for layer in range(pool.num_layers):
        for t in (pool.k, pool.v):
            block = t[layer, page].contiguous()
            if block.element_size() == 2:
                block = block.view(torch.int16)
            parts.append(block.numpy().tobytes())
    return b"".join(parts)


class TestChecksums:
    @pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
    def test_matches_reference(self, dtype: torch.dtype) -> None:
        gen = torch.Generator().manual_seed(6)
        pool = KVPool(12, 4, 3, 2, 8, dtype=dtype)
        pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
        pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
        pages = torch.tensor([7, 0, 11, 3])
        sums = pool.page_checksums(pages)
        assert sums.dtype == np.uint64
        assert pool.page_nbytes == len(page_bytes(pool, 0))
        for p, s in zip(pages.tolist(), sums.tolist(), strict=True):
            assert s == reference_checksum(page_bytes(pool, p))

    def test_bit_flip_and_swap_change_it(self) -> None:
        gen = torch.Generator().manual_seed(7)
        pool = KVPool(4, 4, 2, 2, 8)
        pool.k.copy_(torch.randn(pool.k.shape, generator=gen))
        pool.v.copy_(torch.randn(pool.v.shape, generator=gen))
        page = torch.tensor([2])
        base = int(pool.page_checksums(page)[0])
        assert base == reference_checksum(page_bytes(pool, 2))
        words = pool.v.view(torch.int32)  # same storage, raw bits
        words[1, 2, 3, 1, 5] ^= 1 << 31  # one bit, in layer 1's V block
        flipped = int(pool.page_checksums(page)[0])
        assert flipped != base and flipped == reference_checksum(page_bytes(pool, 2))
        words[1, 2, 3, 1, 5] ^= 1 << 31
        assert int(pool.page_checksums(page)[0]) == base
        a, b = pool.k[0, 2, 0, 0, 0].item(), pool.k[0, 2, 0, 0, 1].item()
        assert a != b
        pool.k[0, 2, 0, 0, 0], pool.k[0, 2, 0, 0, 1] = b, a
        swapped = int(pool.page_checksums(page)[0])
        assert swapped != base and swapped == reference_checksum(page_bytes(pool, 2))

    def test_export_import_round_trip(self) -> None:
        gen = torch.Generator().manual_seed(8)
        src = random_pool(gen, 10, 4, 2, 2, 8)
        dst = KVPool(10, 4, 2, 2, 8)
        sent, into = torch.tensor([1, 7, 4]), torch.tensor([9, 0, 5])
        data = src.export_pages(sent)
        assert data.is_contiguous() and data.shape == (3, 2, 2, 4, 2, 8)
        assert data[0].numpy().tobytes() == page_bytes(src, 1)
        assert data.numel() * data.element_size() == 3 * src.page_nbytes
        dst.import_pages(into, data)
        np.testing.assert_array_equal(dst.page_checksums(into), src.page_checksums(sent))
        assert torch.equal(dst.k[:, into], src.k[:, sent]) and torch.equal(dst.v[:, into], src.v[:, sent])
        assert not dst.k[:, [2, 3]].any()  # other pages untouched

    def test_write_touches_only_named_slots(self) -> None:
        pool = KVPool(4, 4, 1, 1, 2)
        pool.k.fill_(7.0)
        k = torch.ones(3, 1, 2)
        pool.write(0, torch.tensor([2, 2, 0]), torch.tensor([1, 3, 0]), k, -k)
        assert pool.k[0, 2, 1].eq(1).all() and pool.k[0, 2, 3].eq(1).all() and pool.v[0, 0, 0].eq(-1).all()
        assert pool.k[0, 2, 0].eq(7).all() and pool.k[0, 1].eq(7).all()
        pages, slots = pool.token_slots(torch.tensor([3, 1, 0]), torch.tensor([0, 3, 4, 9]))
        assert pages.tolist() == [3, 3, 1, 0] and slots.tolist() == [0, 3, 0, 1]


# ---------------------------------------------------------------------- TinyTransformer


class TestTinyTransformer:
    def test_paged_decode_matches_dense(self) -> None:
        cfg = TransformerConfig(
            num_layers=2, d_model=64, num_heads=4, num_kv_heads=2, mlp_hidden=128, page_size=4
        )
        model = TinyTransformer(cfg)
        pool = model.pool(48)
        gen = torch.Generator().manual_seed(9)
        lens, steps = [3, 8, 13], 6
        tables, _ = shuffled_tables(gen, 48, cfg.page_size, [n + steps for n in lens])
        seqs = [torch.randint(0, cfg.vocab, (n,), generator=gen) for n in lens]
        last = torch.stack([model.prefill(pool, tables[i], s) for i, s in enumerate(seqs)])
        ctx = torch.tensor(lens)
        for _ in range(steps):
            seqs = [torch.cat((s, last[i : i + 1])) for i, s in enumerate(seqs)]
            logits = model.decode_logits(pool, tables, ctx, last)
            dense = torch.stack([model.forward_dense(s)[-1] for s in seqs])
            torch.testing.assert_close(logits, dense, rtol=1e-4, atol=1e-4)
            top2 = dense.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 1e-3
            last = logits.argmax(dim=-1)
            assert torch.equal(last[clear], dense.argmax(dim=-1)[clear])
            ctx = ctx + 1

    def test_batch_8_shapes(self) -> None:
        cfg = TransformerConfig(num_layers=2, d_model=128, num_heads=4, num_kv_heads=4, mlp_hidden=256)
        model = TinyTransformer(cfg)
        pool = model.pool(8 * 4)
        tables = torch.arange(32).view(8, 4)
        ctx = torch.full((8,), 20)
        for i in range(8):
            model.prefill(pool, tables[i], torch.randint(0, 256, (20,)))
        nxt = model.decode_step(pool, tables, ctx, torch.zeros(8, dtype=torch.long))
        assert nxt.shape == (8,) and nxt.dtype == torch.long and (nxt < cfg.vocab).all()
        assert model.decode_logits(pool, tables, ctx + 1, nxt).shape == (8, cfg.vocab)


def test_the_pools_regions_say_where_each_page_of_each_layer_lies() -> None:
    # What a decode engine registers for RDMA, in the pool event's terms: page p of region
    # (K or V of layer l) at base + p * stride, its bytes that page's KV of that layer.
    pool = KVPool(num_pages=5, page_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    regions = pool.regions()
    assert len(regions) == 2 * 3
    for i, region in enumerate(regions):
        tensor, layer = (pool.k, pool.v)[i // 3], i % 3
        for page in range(5):
            assert region["base"] + page * region["stride"] == tensor[layer, page].data_ptr()
            assert region["stride"] == tensor[layer, page].nbytes == 4 * 2 * 8 * 4
