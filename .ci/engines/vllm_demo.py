"""Drive vLLM 0.33.0's own v1 KVCacheManager / BlockPool on CPU: two tenants with different
cache_salt and the same prompt prefix get no cross-tenant share; the same salt does share.
No stubs, no mocks."""
import time
t0 = time.time()
import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request
print(f"imports {time.time()-t0:.1f}s")

BS = 4
init_none_hash(sha256)
cfg = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[
    KVCacheGroupSpec(["layers.0"], FullAttentionSpec(block_size=BS, num_kv_heads=2,
                                                     head_size=8, dtype=torch.float16))])
mgr = KVCacheManager(cfg, max_model_len=64, scheduler_block_size=BS, hash_block_size=BS,
                     enable_caching=True)
pool = mgr.block_pool
hasher = get_request_block_hasher(BS, sha256)
print("free blocks", pool.get_num_free_blocks(), "(block 0 is the null block)")

def req(rid, salt, prompt):
    return Request(rid, prompt, SamplingParams(max_tokens=4), None, cache_salt=salt,
                   block_hasher=hasher)

def run(r):
    """One scheduling step: prefix lookup, allocate, 'compute', cache."""
    hit, n_hit, *_ = mgr.get_computed_blocks(r)
    n_new = r.num_tokens - n_hit
    blocks = mgr.allocate_slots(r, n_new, n_hit, hit)
    r.num_computed_tokens = r.num_tokens
    mgr.cache_blocks(r, r.num_tokens)
    return n_hit, mgr.get_block_ids(r.request_id)[0]

prefix = list(range(1000, 1012))                     # 3 full blocks shared by everyone
a  = req("a-1", "tenant-a", prefix + [1, 2, 3, 4])
b  = req("b-1", "tenant-b", prefix + [5, 6, 7, 8])
a2 = req("a-2", "tenant-a", prefix + [9, 9, 9, 9])

for r in (a, b, a2):
    n_hit, ids = run(r)
    print(f"{r.request_id} salt={r.cache_salt}: prefix hit {n_hit} tokens, blocks {ids}")
ids = {r.request_id: set(mgr.get_block_ids(r.request_id)[0]) for r in (a, b, a2)}
assert not ids["a-1"] & ids["b-1"], "cross-tenant share"
assert len(ids["a-1"] & ids["a-2"]) == 3
print("ref_cnt of a-1's first block:", pool.blocks[min(ids["a-1"])].ref_cnt)  # 2: a-1 and a-2

for r in (a, b, a2):
    mgr.free(r)
print("after free: free blocks", pool.get_num_free_blocks(), "- freed blocks keep their hashes:",
      sum(1 for blk in pool.blocks if blk.block_hash is not None))
a3 = req("a-3", "tenant-a", prefix + [4, 4, 4, 4])
n_hit, ids3 = run(a3)
print(f"a-3 after a-1 freed: hit {n_hit} tokens, blocks {ids3} (revived from the free queue)")
print(f"total {time.time()-t0:.1f}s OK")
