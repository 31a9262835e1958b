"""Drive SGLang 0.5.23's own KV classes on CPU: paged allocator over a real MHA KV pool,
request-to-token table, radix cache with cache_salt, the fake PD sender. No mocks."""
import os, sys, time
# The venv's _engine_stubs.pth stubs torchvision and triton when sglang is first imported
# (install-engines.sh); without it: import torchvision_stub, triton_stub; .install() each.

t0 = time.time()
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.mem_cache.cache_init_params import CacheInitParams
from sglang.srt.mem_cache.base_prefix_cache import InsertParams, MatchPrefixParams
from sglang.srt.disaggregation.fake.conn import FakeKVReceiver, FakeKVSender
from sglang.srt.disaggregation.base.conn import KVPoll
print(f"imports {time.time()-t0:.1f}s")

PAGE, PAGES = 4, 8
SIZE = PAGE * PAGES
kv = MHATokenToKVPool(size=SIZE, page_size=PAGE, dtype=torch.float16, head_num=2, head_dim=8,
                      layer_num=2, device="cpu", enable_memory_saver=False)
print("k_buffer[0]", tuple(kv.k_buffer[0].shape))           # (size + page, heads, dim)
# need_sort=True is what PD (prefill/decode) mode configures.
alloc = PagedTokenToKVPoolAllocator(size=SIZE, page_size=PAGE, dtype=torch.float16,
                                    device="cpu", kvcache=kv, need_sort=True)
r2t = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
print("available", alloc.available_size())                  # 32 tokens; page 0 = padding

# Tenant A fills the pool, writes K=7 everywhere, finishes.
a = alloc.alloc(SIZE)
print("A slots", a[:6].tolist(), "... pages", sorted(set((a // PAGE).tolist())))
kv.k_buffer[0][a] = 7.0
alloc.free(a)
print("after free, available", alloc.available_size())

# Tenant B (a decode reservation) gets 8 pages, only page 1 of 8 is written (the incident).
row = r2t.alloc_rows(1)[0]
b = alloc.alloc(SIZE)
r2t.write((row, slice(0, SIZE)), b.to(torch.int32))
kv.k_buffer[0][b[:PAGE]] = 1.0
seen = r2t.req_to_token[row, :SIZE].long()
stale = [p for p in range(PAGES) if (kv.k_buffer[0][seen[p*PAGE:(p+1)*PAGE]] == 7.0).all()]
print(f"B reserved {PAGES} pages, wrote 1: {len(stale)} pages still hold A's K")
assert len(stale) == 7
alloc.free(b); r2t.free_rows([row])

# Radix cache over the same allocator: cache_salt namespaces the tree.
alloc2 = PagedTokenToKVPoolAllocator(size=SIZE, page_size=PAGE, dtype=torch.float16,
                                     device="cpu", kvcache=kv, need_sort=False)
tree = RadixCache(CacheInitParams(disable=False, req_to_token_pool=r2t,
                                  token_to_kv_pool_allocator=alloc2, page_size=PAGE))
toks = list(range(100, 108))
slots = alloc2.alloc(8)
tree.insert(InsertParams(key=RadixKey(toks, cache_salt="tenant-a"), value=slots))
hit_a = tree.match_prefix(MatchPrefixParams(key=RadixKey(toks, cache_salt="tenant-a")))
hit_b = tree.match_prefix(MatchPrefixParams(key=RadixKey(toks, cache_salt="tenant-b")))
print("radix hit same salt", hit_a.device_prefix_len, "other salt", hit_b.device_prefix_len)
assert hit_a.device_prefix_len == 8 and hit_b.device_prefix_len == 0

# Fake PD sender: told 8 pages, sent 1, reports Success.
s = FakeKVSender(mgr=None, bootstrap_addr="fake", bootstrap_room=42)
s.init(num_kv_indices=8)
s.send(kv_indices=torch.arange(1, 2).numpy().astype("int32"))
print("FakeKVSender: init(8 pages), send(1 page) -> Success:", s.poll() == KVPoll.Success)
r = FakeKVReceiver(mgr=None, bootstrap_addr="fake", bootstrap_room=42)
r.init(prefill_dp_rank=0)
r.send_metadata(kv_indices=list(range(1, 9)))            # decode reserved 8 pages
print("FakeKVReceiver after send_metadata(8 pages) -> Success:", r.poll() == KVPoll.Success)

# Extend/decode allocations (pure-torch *_naive paths on CPU: supports_triton is False).
alloc2.clear()
ext = alloc2.alloc_extend(prefix_lens=torch.tensor([0]), prefix_lens_cpu=torch.tensor([0]),
                          seq_lens=torch.tensor([6]), seq_lens_cpu=torch.tensor([6]),
                          last_loc=torch.tensor([-1]), extend_num_tokens=6)
dec = alloc2.alloc_decode(seq_lens=torch.tensor([7]), seq_lens_cpu=torch.tensor([7]),
                          last_loc=ext[-1:])
print("alloc_extend(6 tokens)", ext.tolist(), "alloc_decode ->", dec.tolist())
alloc2.free(torch.cat([ext, dec]))

# A request SGLang rejects at admission: the state it leaves (incident failure c).
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.runtime_context import get_parallel
from array import array
req = Req("rid-1", "", array("q", range(50)), SamplingParams(max_new_tokens=4))
with get_parallel().override(tp_rank=0):
    req.set_finish_with_abort("Input is longer than the KV pool")
print("rejected req: finished()", req.finished(), "to_finish", type(req.to_finish).__name__,
      "origin_input_ids", list(req.origin_input_ids))
print(f"total {time.time()-t0:.1f}s OK")
