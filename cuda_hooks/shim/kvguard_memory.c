// The allocation witness: the device memory the process allocates or maps (cuMemAlloc,
// cuMemAllocAsync and cuMemAllocFromPoolAsync, the virtual memory calls cuMemMap/cuMemUnmap
// PyTorch's expandable segments use, and the runtime's cudaMalloc/cudaFree), so that the memory under a KV pool is seen
// where CUDA hands it out, not only where the engine says it is.
//
// A guard binds each of its pool's regions (kvguard_pool_bind: base, bytes its pages need);
// the shim answers with the bytes of it that the allocations it saw hold, and says so to the
// agent (a `bound` record). A free or an unmap that lets go of any part of a bound region
// sends a `freed` or `unmapped` record with that part, at once, and forgets the region.
//
// Invariants: allocations are keyed by their start and never overlap (CUDA's do not), so a
// region's coverage is the sum of its intersections; the table changes only on allocation
// calls (rare next to launches), under one lock; the wrapped call's result is the real one's,
// and only a call that succeeded changes the table.

#include "shim.h"
#include "record.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct range {
    uint64_t lo, size;  // lo 0: an empty entry; ~0: a removed one
    const char *call;
};

static struct range *table;
static size_t capacity, used, removed;
static uint64_t allocations;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

#define TOMBSTONE (~(uint64_t)0)
#define WATCHES 256
static struct watch {
    uint32_t pool;
    uint64_t base, bytes;  // bytes 0: an empty entry
} watches[WATCHES];

static inline size_t hash(uint64_t lo) { return (size_t)((lo * 0x9E3779B97F4A7C15ull) >> 17); }

static void put(struct range *into, size_t cap, struct range r) {
    for (size_t at = hash(r.lo) & (cap - 1);; at = (at + 1) & (cap - 1))
        if (!into[at].lo) {
            into[at] = r;
            return;
        }
}

static int grow(void) {
    size_t cap = capacity ? capacity * 2 : 1024;
    struct range *bigger = calloc(cap, sizeof(*bigger));
    if (!bigger)
        return -1;
    for (size_t i = 0; i < capacity; i++)
        if (table[i].lo && table[i].lo != TOMBSTONE)
            put(bigger, cap, table[i]);
    free(table);
    table = bigger;
    capacity = cap;
    removed = 0;
    return 0;
}

static struct range *find(uint64_t lo) {
    if (!capacity)
        return NULL;
    for (size_t at = hash(lo) & (capacity - 1), n = 0; n < capacity; at = (at + 1) & (capacity - 1), n++) {
        if (!table[at].lo)
            return NULL;
        if (table[at].lo == lo)
            return &table[at];
    }
    return NULL;
}

static uint64_t steps_now(void) {
    struct kvguard_steps *word = kvguard_steps_word();
    return word ? __atomic_load_n(&word->steps, __ATOMIC_ACQUIRE) : 0;
}

static void say(uint32_t kind, const struct watch *w, uint64_t covered, uint64_t lo, uint64_t hi, const char *call) {
    struct kvguard_memory_record r = {
        .magic = KVGUARD_MEMORY_MAGIC,
        .version = KVGUARD_MEMORY_VERSION,
        .pid = (uint32_t)getpid(),
        .pool = w->pool,
        .kind = kind,
        .base = w->base,
        .bytes = w->bytes,
        .covered = covered,
        .lo = lo,
        .hi = hi,
        .allocations = allocations,
        .steps = steps_now(),
        .dropped = kvguard_dropped(),
    };
    strncpy(r.call, call ? call : "", sizeof(r.call) - 1);
    kvguard_send(&r, sizeof(r));
}

static void added(uint64_t lo, uint64_t size, const char *call) {
    if (!lo || !size)
        return;
    pthread_mutex_lock(&lock);
    allocations++;
    struct range *held = find(lo);
    if (held) {
        held->size = size;
        held->call = call;
    } else if ((used + removed + 1) * 4 <= capacity * 3 || grow() == 0) {
        put(table, capacity, (struct range){lo, size, call});
        used++;
    }
    pthread_mutex_unlock(&lock);
}

// [lo, hi) was let go of by `call`: every bound region it touches is said and forgotten.
static void let_go(uint64_t lo, uint64_t hi, uint32_t kind, const char *call) {
    for (int i = 0; i < WATCHES; i++) {
        struct watch *w = &watches[i];
        if (!w->bytes || hi <= w->base || lo >= w->base + w->bytes)
            continue;
        uint64_t from = lo > w->base ? lo : w->base, to = hi < w->base + w->bytes ? hi : w->base + w->bytes;
        say(kind, w, 0, from, to, call);
        w->bytes = 0;
    }
}

static void remove_at(struct range *r) {
    r->lo = TOMBSTONE;
    used--;
    removed++;
}

static void freed(uint64_t lo, const char *call) {
    if (!lo)
        return;
    pthread_mutex_lock(&lock);
    struct range *r = find(lo);
    if (r) {
        let_go(r->lo, r->lo + r->size, KVGUARD_FREED, call);
        remove_at(r);
    } else {
        let_go(lo, lo + 1, KVGUARD_FREED, call);  // not seen allocated: at least its first byte went
    }
    pthread_mutex_unlock(&lock);
}

static void unmapped(uint64_t lo, uint64_t size, const char *call) {
    pthread_mutex_lock(&lock);
    let_go(lo, lo + size, KVGUARD_UNMAPPED, call);
    // Mappings are unmapped in runs of adjacent ones: walk them; a gap means a partial unmap
    // of something the table holds otherwise, so every entry in the range is looked at.
    uint64_t at = lo, end = lo + size;
    struct range *r;
    while (at < end && (r = find(at)) && r->size) {
        at += r->size;
        remove_at(r);
    }
    if (at < end)
        for (size_t i = 0; i < capacity; i++)
            if (table[i].lo && table[i].lo != TOMBSTONE && table[i].lo >= lo && table[i].lo < end)
                remove_at(&table[i]);
    pthread_mutex_unlock(&lock);
}

// Bind a pool's region: remembered (a later free or unmap of it is said) and answered with
// the bytes of it the allocations seen hold. Returns those bytes.
uint64_t kvguard_pool_bind(uint32_t pool, uint64_t base, uint64_t bytes) {
    pthread_mutex_lock(&lock);
    uint64_t covered = 0, end = base + bytes;
    const char *call = "";
    for (size_t i = 0; i < capacity; i++) {
        struct range *r = &table[i];
        if (!r->lo || r->lo == TOMBSTONE || r->lo >= end || r->lo + r->size <= base)
            continue;
        uint64_t from = r->lo > base ? r->lo : base, to = r->lo + r->size < end ? r->lo + r->size : end;
        covered += to - from;
        if (r->lo <= base)
            call = r->call;
    }
    struct watch bound = {pool, base, bytes};
    for (int i = 0; i < WATCHES; i++)
        if (!watches[i].bytes || (watches[i].pool == pool && watches[i].base == base)) {
            watches[i] = bound;
            break;
        }
    say(KVGUARD_BOUND, &bound, covered, 0, 0, call);
    pthread_mutex_unlock(&lock);
    return covered;
}

// ------------------------------------------------------------------ the driver's entry points

typedef void *CUstream;

typedef cuda_status (*alloc_fn)(device_ptr *, size_t);
FAMILY(kvguard_mem_alloc, cuda_status, (device_ptr * ptr, size_t size), (ptr, size))
static cuda_status kvguard_mem_alloc_impl(void *real, device_ptr *ptr, size_t size) {
    if (!real)
        return UNRESOLVED;
    cuda_status status = ((alloc_fn)real)(ptr, size);
    if (status == 0 && ptr && !kvguard_in_runtime)
        added(*ptr, size, "cuMemAlloc");
    return status;
}
EXPORT(kvguard_mem_alloc, cuMemAlloc_v2, DRIVER, cuda_status, (device_ptr * ptr, size_t size), (ptr, size))

typedef cuda_status (*free_fn)(device_ptr);
FAMILY(kvguard_mem_free, cuda_status, (device_ptr ptr), (ptr))
static cuda_status kvguard_mem_free_impl(void *real, device_ptr ptr) {
    if (!real)
        return UNRESOLVED;
    cuda_status status = ((free_fn)real)(ptr);
    if (status == 0 && !kvguard_in_runtime)
        freed(ptr, "cuMemFree");
    return status;
}
EXPORT(kvguard_mem_free, cuMemFree_v2, DRIVER, cuda_status, (device_ptr ptr), (ptr))

typedef cuda_status (*alloc_async_fn)(device_ptr *, size_t, CUstream);
FAMILY(kvguard_mem_alloc_async, cuda_status, (device_ptr * ptr, size_t size, CUstream stream), (ptr, size, stream))
static cuda_status kvguard_mem_alloc_async_impl(void *real, device_ptr *ptr, size_t size, CUstream stream) {
    if (!real)
        return UNRESOLVED;
    cuda_status status = ((alloc_async_fn)real)(ptr, size, stream);
    if (status == 0 && ptr && !kvguard_in_runtime)
        added(*ptr, size, "cuMemAllocAsync");
    return status;
}
EXPORT(kvguard_mem_alloc_async, cuMemAllocAsync, DRIVER, cuda_status, (device_ptr * ptr, size_t size, CUstream stream),
       (ptr, size, stream))
EXPORT(kvguard_mem_alloc_async, cuMemAllocAsync_ptsz, DRIVER, cuda_status,
       (device_ptr * ptr, size_t size, CUstream stream), (ptr, size, stream))

typedef cuda_status (*alloc_pool_fn)(device_ptr *, size_t, void *, CUstream);
FAMILY(kvguard_mem_alloc_pool, cuda_status, (device_ptr * ptr, size_t size, void *pool, CUstream stream),
       (ptr, size, pool, stream))
static cuda_status kvguard_mem_alloc_pool_impl(void *real, device_ptr *ptr, size_t size, void *pool, CUstream stream) {
    if (!real)
        return UNRESOLVED;
    cuda_status status = ((alloc_pool_fn)real)(ptr, size, pool, stream);
    if (status == 0 && ptr && !kvguard_in_runtime)
        added(*ptr, size, "cuMemAllocFromPoolAsync");  // PyTorch's cudaMallocAsync backend
    return status;
}
EXPORT(kvguard_mem_alloc_pool, cuMemAllocFromPoolAsync, DRIVER, cuda_status,
       (device_ptr * ptr, size_t size, void *pool, CUstream stream), (ptr, size, pool, stream))
EXPORT(kvguard_mem_alloc_pool, cuMemAllocFromPoolAsync_ptsz, DRIVER, cuda_status,
       (device_ptr * ptr, size_t size, void *pool, CUstream stream), (ptr, size, pool, stream))

typedef cuda_status (*free_async_fn)(device_ptr, CUstream);
FAMILY(kvguard_mem_free_async, cuda_status, (device_ptr ptr, CUstream stream), (ptr, stream))
static cuda_status kvguard_mem_free_async_impl(void *real, device_ptr ptr, CUstream stream) {
    if (!real)
        return UNRESOLVED;
    cuda_status status = ((free_async_fn)real)(ptr, stream);
    if (status == 0 && !kvguard_in_runtime)
        freed(ptr, "cuMemFreeAsync");
    return status;
}
EXPORT(kvguard_mem_free_async, cuMemFreeAsync, DRIVER, cuda_status, (device_ptr ptr, CUstream stream), (ptr, stream))
EXPORT(kvguard_mem_free_async, cuMemFreeAsync_ptsz, DRIVER, cuda_status, (device_ptr ptr, CUstream stream),
       (ptr, stream))

typedef cuda_status (*map_fn)(device_ptr, size_t, size_t, unsigned long long, unsigned long long);
FAMILY(kvguard_mem_map, cuda_status,
       (device_ptr ptr, size_t size, size_t offset, unsigned long long handle, unsigned long long flags),
       (ptr, size, offset, handle, flags))
static cuda_status kvguard_mem_map_impl(void *real, device_ptr ptr, size_t size, size_t offset,
                                        unsigned long long handle, unsigned long long flags) {
    if (!real)
        return UNRESOLVED;
    cuda_status status = ((map_fn)real)(ptr, size, offset, handle, flags);
    if (status == 0)
        added(ptr, size, "cuMemMap");
    return status;
}
EXPORT(kvguard_mem_map, cuMemMap, DRIVER, cuda_status,
       (device_ptr ptr, size_t size, size_t offset, unsigned long long handle, unsigned long long flags),
       (ptr, size, offset, handle, flags))

typedef cuda_status (*unmap_fn)(device_ptr, size_t);
FAMILY(kvguard_mem_unmap, cuda_status, (device_ptr ptr, size_t size), (ptr, size))
static cuda_status kvguard_mem_unmap_impl(void *real, device_ptr ptr, size_t size) {
    if (!real)
        return UNRESOLVED;
    cuda_status status = ((unmap_fn)real)(ptr, size);
    if (status == 0)
        unmapped(ptr, size, "cuMemUnmap");
    return status;
}
EXPORT(kvguard_mem_unmap, cuMemUnmap, DRIVER, cuda_status, (device_ptr ptr, size_t size), (ptr, size))

// ------------------------------------------------------------------ the runtime's entry points

cuda_status cudaMalloc(void **ptr, size_t size) {
    static __typeof__(&cudaMalloc) real;
    if (!real && !(real = (__typeof__(&cudaMalloc))kvguard_resolve("cudaMalloc", RUNTIME)))
        return UNRESOLVED;
    kvguard_in_runtime++;
    cuda_status status = real(ptr, size);
    kvguard_in_runtime--;
    if (status == 0 && ptr && !kvguard_in_runtime)
        added((uint64_t)(uintptr_t)*ptr, size, "cudaMalloc");
    return status;
}

cuda_status cudaFree(void *ptr) {
    static __typeof__(&cudaFree) real;
    if (!real && !(real = (__typeof__(&cudaFree))kvguard_resolve("cudaFree", RUNTIME)))
        return UNRESOLVED;
    kvguard_in_runtime++;
    cuda_status status = real(ptr);
    kvguard_in_runtime--;
    if (status == 0 && !kvguard_in_runtime)
        freed((uint64_t)(uintptr_t)ptr, "cudaFree");
    return status;
}
