"""The guard's two checks at GPU speed, and their CPU twins: bit-identical on the same input
(tests/vectors/kernels.json holds inputs and results that both must reproduce).

- Page-tag check (`tag_check`): before an attention launch, for each request of the batch,
  whether every slot it reads holds its own KV, written under its current grant. The tags
  are the ledger's (ledger/pages.py): `own[p]` is the request whose own KV page p holds
  (0: none) and `valid[p]` the slots written; a request may attend to page p for `need`
  slots iff `own[p] == its index` and `valid[p] >= need`. One launch per decode step.
- Page checksums (`page_checksums`): one 64-bit checksum per page, read in place from the
  pool through the page list (no gather copy): the stream of a page is, for each layer, its
  K block then its V block, as little-endian 32-bit words w_i, and
  checksum = sum_i w_i * (2i + 1) * 0x9E3779B1 mod 2**64 (testbed/paged.py gives the
  definition's reasons).

Arrays on a CUDA device (CuPy arrays, or torch CUDA tensors, taken without a copy) run the
CuPy raw kernels below; NumPy arrays and CPU tensors run the NumPy/PyTorch code. `DeviceTags`
keeps a device copy of one pool's tags in step with the ledger by batched scatters.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvguard.ledger.pages import check_tags

CHECKSUM_MULTIPLIER = 0x9E3779B1
_CHUNK_PAGES = 256  # CPU checksums: pages per chunk (bounds the int64 scratch memory)

SOURCE = r"""
extern "C" __global__ void kvguard_tag_check(
    const int *tables, const int *lens, const int *readers, const int *own, const unsigned int *valid,
    int batch, int width, int page_size, int num_pages, unsigned char *clean)
{
    // One block per request: its threads walk the pages its context covers.
    int b = blockIdx.x;
    int len = lens[b], reader = readers[b];
    int pages = (len + page_size - 1) / page_size;
    int bad = pages > width || reader == 0;
    for (int col = threadIdx.x; col < pages && col < width; col += blockDim.x) {
        int need = min(len - col * page_size, page_size);
        int p = tables[(long long)b * width + col];
        if (p < 0 || p >= num_pages || own[p] != reader || valid[p] < (unsigned int)need)
            bad = 1;
    }
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0)
        clean[b] = len == 0 || !bad;
}

extern "C" __global__ void kvguard_page_checksums(
    const unsigned int *k, const unsigned int *v, const long long *pages, long long pool_pages,
    long long block_words, unsigned long long *out)
{
    // grid (pages, 2 * layers, chunks): one (page, layer, K or V) block, a chunk of it per block.
    // Word i of the page's stream weighs (2i + 1) * C; a thread steps its weight by additions.
    const unsigned long long C = 0x9E3779B1ull;
    long long page = pages[blockIdx.x];
    int layer = blockIdx.y >> 1;
    const unsigned int *src = (blockIdx.y & 1 ? v : k) + ((long long)layer * pool_pages + page) * block_words;
    unsigned long long first = (unsigned long long)blockIdx.y * block_words;  // its first word in the stream
    long long stride = (long long)gridDim.z * blockDim.x;
    long long t = (long long)blockIdx.z * blockDim.x + threadIdx.x;
    unsigned long long acc = 0;
    if ((block_words & 3) == 0 && ((unsigned long long)src & 15) == 0) {
        // 16-byte loads, four consecutive words at a time
        const uint4 *quads = (const uint4 *)src;
        unsigned long long weight = (2ull * (first + 4ull * (unsigned long long)t) + 1ull) * C;
        const unsigned long long next = 2ull * C, advance = 8ull * (unsigned long long)stride * C;
        for (long long q = t; q < (block_words >> 2); q += stride, weight += advance) {
            uint4 w = quads[q];
            acc += (unsigned long long)w.x * weight;
            acc += (unsigned long long)w.y * (weight + next);
            acc += (unsigned long long)w.z * (weight + 2ull * next);
            acc += (unsigned long long)w.w * (weight + 3ull * next);
        }
    } else {
        unsigned long long weight = (2ull * (first + (unsigned long long)t) + 1ull) * C;
        const unsigned long long advance = 2ull * (unsigned long long)stride * C;
        for (long long i = t; i < block_words; i += stride, weight += advance)
            acc += (unsigned long long)src[i] * weight;
    }
    // Addition mod 2**64 is order-free: any reduction order gives the CPU's result exactly.
    for (int offset = 16; offset > 0; offset >>= 1)
        acc += __shfl_down_sync(0xffffffffu, acc, offset);
    if ((threadIdx.x & 31) == 0)
        atomicAdd(out + blockIdx.x, acc);
}
"""

_module: Any = None


def _kernels() -> Any:
    global _module
    if _module is None:
        import cupy

        _module = cupy.RawModule(code=SOURCE)
    return _module


def on_device(array: Any) -> bool:
    """True for a CuPy array or a torch tensor on a CUDA device."""
    if isinstance(array, torch.Tensor):
        return array.is_cuda
    return hasattr(array, "__cuda_array_interface__")


# ---------------------------------------------------------------------------- tag check


def tag_check(own: Any, valid: Any, tables: Any, lens: Any, readers: Any, page_size: int) -> Any:
    """For each request b: True iff every slot of its context (lens[b] tokens through
    tables[b], entries beyond the context ignored) holds its own KV (own == readers[b],
    valid >= the slots read), or it reads nothing. A table too short for its context, a page
    out of range, or no reader (0) is False. Device arrays in, device bools out."""
    if on_device(tables):
        return _tag_check_gpu(own, valid, tables, lens, readers, page_size)
    return check_tags(own, valid, tables, lens, readers, page_size)


def _tag_check_gpu(own: Any, valid: Any, tables: Any, lens: Any, readers: Any, page_size: int) -> Any:
    import cupy

    tables = cupy.ascontiguousarray(cupy.asarray(tables), dtype=cupy.int32)
    lens = cupy.ascontiguousarray(cupy.asarray(lens), dtype=cupy.int32)
    readers = cupy.ascontiguousarray(cupy.asarray(readers), dtype=cupy.int32)
    batch, width = tables.shape
    clean = cupy.zeros(batch, dtype=cupy.uint8)
    if batch:
        _kernels().get_function("kvguard_tag_check")(
            (batch,),
            (128,),
            (
                tables,
                lens,
                readers,
                own,
                valid,
                np.int32(batch),
                np.int32(width),
                np.int32(page_size),
                np.int32(len(own)),
                clean,
            ),
        )
    return clean.astype(cupy.bool_)


class DeviceTags:
    """One pool's tags on the device, in step with the ledger's host arrays: the guard notes
    the pages each event names (`touch`), and `sync` copies their tags over in one scatter
    before the check (a new pool, i.e. new host arrays, is copied whole)."""

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self._source: Any = None
        self._touched: list[np.ndarray] = []
        self.own: Any = None
        self.valid: Any = None

    def touch(self, pages: Any) -> None:
        self._touched.append(np.asarray(pages, dtype=np.int64))

    def sync(self, host_own: np.ndarray, host_valid: np.ndarray) -> None:
        import cupy

        with cupy.cuda.Device(self.device):
            if self._source is not host_own:
                self.own, self.valid = cupy.asarray(host_own), cupy.asarray(host_valid)
                self._source = host_own
            elif self._touched:
                pages = np.unique(np.concatenate(self._touched))
                pages = pages[(pages >= 0) & (pages < len(host_own))]
                at = cupy.asarray(pages)
                self.own[at] = cupy.asarray(host_own[pages])
                self.valid[at] = cupy.asarray(host_valid[pages])
        self._touched.clear()


# ---------------------------------------------------------------------------- checksums


def page_checksums(k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor) -> np.ndarray:
    """uint64 checksum of each of `pages` of the pool k, v ([layers, pool pages, ...], one
    dtype); computed where the pool is."""
    if k.is_cuda:
        return _checksums_gpu(k, v, pages)
    return checksums_cpu(k, v, pages)


def _weights(words: int, device: torch.device) -> torch.Tensor:
    i = torch.arange(words, dtype=torch.int64, device=device)
    return (2 * i + 1) * CHECKSUM_MULTIPLIER  # int64 arithmetic wraps mod 2**64, as intended


def checksums_cpu(k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor) -> np.ndarray:
    layers, pool_pages = k.shape[0], k.shape[1]
    block = k[0, 0].numel() * k.element_size()
    if block % 4:
        raise ValueError(f"page checksums need a K/V block of a multiple of 4 bytes, got {block}")
    pages = pages.to(device=k.device, dtype=torch.long).reshape(-1)
    weights = _weights(2 * layers * block // 4, k.device)
    out = torch.empty(pages.shape[0], dtype=torch.int64, device=k.device)
    kw, vw = k.reshape(layers, pool_pages, -1), v.reshape(layers, pool_pages, -1)
    for start in range(0, pages.shape[0], _CHUNK_PAGES):
        chunk = pages[start : start + _CHUNK_PAGES]
        # [n, layers, 2, block elements]: the stream order (layer, then K, V)
        data = torch.stack((kw.index_select(1, chunk), vw.index_select(1, chunk)), dim=2).transpose(0, 1)
        words = data.contiguous().view(chunk.shape[0], -1).view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        out[start : start + chunk.shape[0]] = (words * weights).sum(dim=1)
    return out.numpy().view(np.uint64)


def _checksums_gpu(k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor) -> np.ndarray:
    import cupy

    layers, pool_pages = k.shape[0], k.shape[1]
    block_words = k[0, 0].numel() * k.element_size() // 4
    words_k = cupy.asarray(k.detach().reshape(-1).view(torch.int32)).view(cupy.uint32)
    words_v = cupy.asarray(v.detach().reshape(-1).view(torch.int32)).view(cupy.uint32)
    at = cupy.asarray(pages.to(device=k.device, dtype=torch.long).reshape(-1))
    out = cupy.zeros(len(at), dtype=cupy.uint64)
    if len(at):
        chunks = max(1, min(64, block_words // 8192))  # each thread takes several 16-byte loads
        _kernels().get_function("kvguard_page_checksums")(
            (len(at), 2 * layers, chunks),
            (256,),
            (words_k, words_v, at, np.int64(pool_pages), np.int64(block_words), out),
        )
    return cupy.asnumpy(out)
