"""The guard's two checks at GPU speed, and their CPU twins: bit-identical on the same input
(tests/cuda_hooks/vectors/kernels.json holds inputs and results that both must reproduce).

- Page-tag check (`tag_check`): before an attention launch, for each request of the batch,
  whether every slot it reads holds its own KV, written under its current grant. The tags
  are the ledger's: `own[p]` is the request whose own KV page p holds (0: none) and
  `valid[p]` the slots written; a request may attend to page p for `need` slots iff
  `own[p] == its index` and `valid[p] >= need`. One launch per decode step. Its CPU twin is
  the ledger's own check (ledger/pages.py check_tags).
- Page checksums (`page_checksums`): one 64-bit checksum per page, read in place from the
  pool through the page list (no gather copy): the stream of a page is, for each layer, its
  K block then its V block, as little-endian 32-bit words w_i, and
  checksum = sum_i w_i * (2i + 1) * 0x9E3779B1 mod 2**64 (testbed/paged.py gives the
  definition's reasons).

Arrays on a CUDA device (CuPy arrays, or torch CUDA tensors, taken without a copy) run the
CuPy raw kernels below; the checksums of CPU tensors run the PyTorch code. `DeviceTags`
keeps a device copy of one pool's tags in step with the ledger: the tags of the pages written
since the last check travel with the next check and are applied by its launch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

CHECKSUM_MULTIPLIER = 0x9E3779B1
_CHUNK_PAGES = 256  # CPU checksums: pages per chunk (bounds the int64 scratch memory)

SOURCE = r"""
extern "C" __global__ void kvguard_tag_check(
    const int *tables, const int *lens, const int *upload, int n_updates, int *own, unsigned int *valid,
    int batch, int width, int page_size, int num_pages, unsigned char *clean)
{
    // upload = [pages (ascending, in range), their own tags, their valid tags]
    // (n_updates each: the tags of the pages written since the last launch), then one reader
    // per request. An updated page is judged by its new tag, found by binary search, and the
    // blocks store the new tags for the next launch: no block reads the stored tag of an
    // updated page, so the stores race with nothing (a page listed twice is stored twice with
    // the same tags).
    const int *readers = upload + 3 * n_updates;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n_updates; i += gridDim.x * blockDim.x) {
        int p = upload[i];
        own[p] = upload[n_updates + i];
        valid[p] = (unsigned int)upload[2 * n_updates + i];
    }
    // One block per request: its threads walk the pages its context covers.
    int b = blockIdx.x;
    if (b >= batch)
        return;
    int len = lens[b], reader = readers[b];
    int pages = (len + page_size - 1) / page_size;
    int bad = pages > width || reader == 0;
    for (int col = threadIdx.x; col < pages && col < width; col += blockDim.x) {
        int need = min(len - col * page_size, page_size);
        int p = tables[(long long)b * width + col];
        if (p < 0 || p >= num_pages) {
            bad = 1;
            continue;
        }
        int lo = 0, hi = n_updates;
        while (lo < hi) {
            int mid = (lo + hi) >> 1;
            if (upload[mid] < p)
                lo = mid + 1;
            else
                hi = mid;
        }
        int o = own[p];
        unsigned int v = valid[p];
        if (lo < n_updates && upload[lo] == p) {
            o = upload[n_updates + lo];
            v = (unsigned int)upload[2 * n_updates + lo];
        }
        if (o != reader || v < (unsigned int)need)
            bad = 1;
    }
    bad = __syncthreads_or(bad);
    if (threadIdx.x == 0)
        clean[b] = len == 0 ? 2 : !bad;  // 2: clean because it reads nothing
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
_functions: dict[tuple[str, int], Any] = {}  # (kernel, device) -> its function


def _kernel(name: str) -> Any:
    """A kernel of SOURCE on the current device (compiled once, on first use)."""
    import cupy

    global _module
    key = (name, cupy.cuda.runtime.getDevice())
    function = _functions.get(key)
    if function is None:
        if _module is None:
            _module = cupy.RawModule(code=SOURCE)
        function = _functions[key] = _module.get_function(name)
    return function


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
    import cupy

    clean = cupy.empty(len(readers), dtype=cupy.uint8)
    _launch_tag_check(own, valid, tables, lens, _int32(readers), 0, page_size, clean)
    return clean.astype(bool)


def _int32(array: Any) -> Any:
    import cupy

    return cupy.ascontiguousarray(cupy.asarray(array), dtype=cupy.int32)


def _launch_tag_check(
    own: Any, valid: Any, tables: Any, lens: Any, upload: Any, n_updates: int, page_size: int, clean: Any
) -> None:
    """One launch: the updates of `upload` applied, a uint8 per request written to `clean`
    (0 not clean, 1 clean, 2 clean because it reads nothing)."""
    tables, lens = _int32(tables), _int32(lens)
    batch, width = tables.shape
    if batch or n_updates:
        _kernel("kvguard_tag_check")(
            (max(batch, 1),),
            (128,),
            (
                tables,
                lens,
                upload,
                np.int32(n_updates),
                own,
                valid,
                np.int32(batch),
                np.int32(width),
                np.int32(page_size),
                np.int32(len(own)),
                clean,
            ),
        )


class DeviceTags:
    """One pool's tags on the device, in step with the ledger's host arrays. The guard notes
    the pages each event names (`touch`); `check` sends their tags and the batch's readers in
    one copy, and one launch applies them and checks the batch; the verdicts come back in one
    copy. The copies go through pinned buffers kept from step to step (a new pool, i.e. new
    host arrays, is copied whole)."""

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self._source: Any = None
        self._touched: list[int] = []  # pages, repeats allowed (Python ints: cheap to extend per event)
        self.own: Any = None
        self.valid: Any = None
        self._up_host: np.ndarray = np.zeros(0, np.int32)  # pinned, grown as needed
        self._up: Any = None
        self._out_host: np.ndarray = np.zeros(0, np.uint8)
        self._out: Any = None

    def touch(self, pages: Any) -> None:
        self._touched.extend(pages.tolist() if hasattr(pages, "tolist") else pages)

    def _pending(self, host_own: np.ndarray, host_valid: np.ndarray) -> np.ndarray:
        """The in-range pages touched since the last launch, ascending (a repeat carries the
        same tags as its first: harmless to the kernel, cheaper than removing)."""
        import cupy

        touched, self._touched = self._touched, []
        if self._source is not host_own:
            # The host fields are strided views of the pool's page records: packed for the device.
            self.own = cupy.asarray(np.ascontiguousarray(host_own))
            self.valid = cupy.asarray(np.ascontiguousarray(host_valid))
            self._source = host_own
            return np.zeros(0, np.int64)
        if not touched:
            return np.zeros(0, np.int64)
        pages = np.sort(np.array(touched, dtype=np.int64))
        return pages[(pages >= 0) & (pages < len(host_own))]

    def _buffers(self, words: int, batch: int) -> None:
        import cupy
        import cupyx

        if len(self._up_host) < words:
            size = max(1024, 1 << (words - 1).bit_length())
            self._up_host, self._up = cupyx.empty_pinned(size, np.int32), cupy.empty(size, np.int32)
        if len(self._out_host) < batch:
            size = max(256, 1 << (batch - 1).bit_length())
            self._out_host, self._out = cupyx.empty_pinned(size, np.uint8), cupy.empty(size, np.uint8)

    def sync(self, host_own: np.ndarray, host_valid: np.ndarray) -> None:
        """Bring the device tags up to date (a check does this itself)."""
        self.check(host_own, host_valid, np.zeros((0, 1), np.int32), np.zeros(0, np.int32), (), 1)

    def check(
        self, own: np.ndarray, valid: np.ndarray, tables: Any, lens: Any, readers: Any, page_size: int
    ) -> np.ndarray:
        """`tag_check` of a batch against the tags brought up to date, on the host: per
        request 0 (not clean), 1 (clean) or 2 (clean: reads nothing)."""
        import cupy

        readers = np.asarray(readers, dtype=np.int32)
        batch = len(readers)
        with cupy.cuda.Device(self.device):
            pages = self._pending(own, valid)
            n = len(pages)
            words = 3 * n + batch
            self._buffers(words, batch)
            up = self._up_host
            up[:n], up[n : 2 * n], up[2 * n : 3 * n], up[3 * n : words] = (
                pages,
                own[pages],
                valid[pages],
                readers,
            )
            stream = cupy.cuda.get_current_stream()
            if words:
                cupy.cuda.runtime.memcpyAsync(self._up.data.ptr, up.ctypes.data, 4 * words, 1, stream.ptr)
            _launch_tag_check(self.own, self.valid, tables, lens, self._up, n, page_size, self._out)
            if batch:
                cupy.cuda.runtime.memcpyAsync(
                    self._out_host.ctypes.data, self._out.data.ptr, batch, 2, stream.ptr
                )
            stream.synchronize()  # the pinned buffers are reused: this step's copies are done
            return self._out_host[:batch].copy()


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


def _checksums_gpu(k: torch.Tensor, v: torch.Tensor, pages: torch.Tensor, chunks: int = 0) -> np.ndarray:
    """chunks: blocks per (page, layer, K or V) block; 0 chooses (bench/gpu.py tries others)."""
    import cupy

    layers, pool_pages = k.shape[0], k.shape[1]
    block_words = k[0, 0].numel() * k.element_size() // 4
    words_k = cupy.asarray(k.detach().reshape(-1).view(torch.int32)).view(cupy.uint32)
    words_v = cupy.asarray(v.detach().reshape(-1).view(torch.int32)).view(cupy.uint32)
    at = cupy.asarray(pages.to(device=k.device, dtype=torch.long).reshape(-1))
    out = cupy.zeros(len(at), dtype=cupy.uint64)
    if len(at):
        chunks = chunks or max(1, min(64, block_words // 8192))  # a thread takes several 16-byte loads
        _kernel("kvguard_page_checksums")(
            (len(at), 2 * layers, chunks),
            (256,),
            (words_k, words_v, at, np.int64(pool_pages), np.int64(block_words), out),
        )
    return cupy.asnumpy(out)
