// A stand-in CUDA driver (libcuda.so.1) for machines without a GPU: the entry points the
// kvguard shim wraps, with CUDA's signatures and the behaviour the witness depends on, run
// on the CPU. Kernels do nothing but count their runs; streams capture launches into graphs;
// device memory is host memory. It answers cuGetProcAddress from its own table by base name
// and version, as the real driver does, so a process that reaches it the way the CUDA
// runtime, PyTorch and Triton reach libcuda (dlopen + dlsym, cuGetProcAddress) goes through
// the same doors the shim watches. Built by testbed/standin/__init__.py.

#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

typedef int CUresult;
enum { OK = 0, INVALID_VALUE = 1, NOT_FOUND = 500, ILLEGAL_STATE = 401 };
typedef unsigned long long CUdeviceptr;

struct function {
    char name[512];
    uint64_t runs;
};
struct node {
    int type;  // 0 kernel, 5 child graph
    struct function *func;
    struct graph *child;
};
struct graph {
    int count, room;
    struct node **nodes;
};
struct stream {
    struct graph *capture;
};
struct exec {
    struct graph *graph;
};

static struct stream legacy;  // stream 0 (and the per-thread default, 2)

static struct stream *stream_of(void *s) { return s && s != (void *)2 && s != (void *)1 ? s : &legacy; }

CUresult cuInit(unsigned flags) {
    (void)flags;
    return OK;
}

CUresult cuDriverGetVersion(int *version) {
    *version = 12080;
    return OK;
}

// ------------------------------------------------------------------ functions and launches

#define FUNCTIONS 1024
static struct function functions[FUNCTIONS];
static int function_count;

CUresult cuModuleGetFunction(struct function **f, void *module, const char *name) {
    (void)module;
    for (int i = 0; i < function_count; i++)
        if (strcmp(functions[i].name, name) == 0) {
            *f = &functions[i];
            return OK;
        }
    if (function_count == FUNCTIONS)
        return NOT_FOUND;
    struct function *made = &functions[function_count++];
    strncpy(made->name, name, sizeof(made->name) - 1);
    *f = made;
    return OK;
}

CUresult cuFuncGetName(const char **name, struct function *f) {
    if (!f || f < functions || f >= functions + FUNCTIONS)
        return INVALID_VALUE;
    *name = f->name;
    return OK;
}

// How many times a kernel ran (not a CUDA call: the tests' and the testbed's window in).
uint64_t standinRuns(struct function *f) { return f ? f->runs : 0; }

static void add_node(struct graph *g, struct node *n) {
    if (g->count == g->room) {
        g->room = g->room ? g->room * 2 : 8;
        g->nodes = realloc(g->nodes, g->room * sizeof(*g->nodes));
    }
    g->nodes[g->count++] = n;
}

static CUresult launch(struct function *f, void *s) {
    if (!f)
        return INVALID_VALUE;
    struct stream *stream = stream_of(s);
    if (stream->capture) {
        struct node *n = calloc(1, sizeof(*n));
        n->func = f;
        add_node(stream->capture, n);
    } else {
        __atomic_add_fetch(&f->runs, 1, __ATOMIC_RELAXED);
    }
    return OK;
}

CUresult cuLaunchKernel(struct function *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                        unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    (void)gx, (void)gy, (void)gz, (void)bx, (void)by, (void)bz, (void)shared, (void)params, (void)extra;
    return launch(f, stream);
}

// The per-thread default stream's entry point (what cuGetProcAddress hands out with
// CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM): the same launch here.
CUresult cuLaunchKernel_ptsz(struct function *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                             unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
    return cuLaunchKernel(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
}

typedef struct {
    unsigned grid[3], block[3], shared;
    void *stream;
    void *attrs;
    unsigned attr_count;
} launch_config;

CUresult cuLaunchKernelEx(const launch_config *config, struct function *f, void **params, void **extra) {
    (void)params, (void)extra;
    return launch(f, config ? config->stream : NULL);
}

// ------------------------------------------------------------------ streams and graphs

CUresult cuStreamCreate(struct stream **s, unsigned flags) {
    (void)flags;
    *s = calloc(1, sizeof(**s));
    return OK;
}

CUresult cuStreamBeginCapture_v2(void *s, int mode) {
    (void)mode;
    struct stream *stream = stream_of(s);
    if (stream->capture)
        return ILLEGAL_STATE;
    stream->capture = calloc(1, sizeof(struct graph));
    return OK;
}

CUresult cuStreamEndCapture(void *s, struct graph **graph) {
    struct stream *stream = stream_of(s);
    if (!stream->capture)
        return ILLEGAL_STATE;
    *graph = stream->capture;
    stream->capture = NULL;
    return OK;
}

CUresult cuStreamIsCapturing(void *s, int *status) {
    *status = stream_of(s)->capture ? 1 : 0;
    return OK;
}

CUresult cuGraphCreate(struct graph **g, unsigned flags) {
    (void)flags;
    *g = calloc(1, sizeof(**g));
    return OK;
}

CUresult cuGraphAddChildGraphNode(struct node **out, struct graph *g, void *deps, size_t ndeps, struct graph *child) {
    (void)deps, (void)ndeps;
    struct node *n = calloc(1, sizeof(*n));
    n->type = 5;
    n->child = child;
    add_node(g, n);
    *out = n;
    return OK;
}

CUresult cuGraphGetNodes(struct graph *g, struct node **nodes, size_t *count) {
    if (nodes)
        for (size_t i = 0; i < *count && i < (size_t)g->count; i++)
            nodes[i] = g->nodes[i];
    *count = g->count;
    return OK;
}

CUresult cuGraphNodeGetType(struct node *n, int *type) {
    *type = n->type;
    return OK;
}

struct kernel_params_v2 {  // CUDA_KERNEL_NODE_PARAMS_v2
    struct function *func;
    unsigned grid[3], block[3], shared;
    void **params, **extra;
    void *kern, *ctx;
};

CUresult cuGraphKernelNodeGetParams_v2(struct node *n, struct kernel_params_v2 *p) {
    if (n->type != 0)
        return INVALID_VALUE;
    memset(p, 0, sizeof(*p));
    p->func = n->func;
    return OK;
}

CUresult cuGraphChildGraphNodeGetGraph(struct node *n, struct graph **g) {
    if (n->type != 5)
        return INVALID_VALUE;
    *g = n->child;
    return OK;
}

CUresult cuGraphInstantiateWithFlags(struct exec **e, struct graph *g, unsigned long long flags) {
    (void)flags;
    *e = calloc(1, sizeof(**e));
    (*e)->graph = g;
    return OK;
}

CUresult cuGraphInstantiate(struct exec **e, struct graph *g, void **error_node, char *log, size_t size) {
    (void)error_node, (void)log, (void)size;
    return cuGraphInstantiateWithFlags(e, g, 0);
}

static void run(struct graph *g) {
    for (int i = 0; i < g->count; i++)
        if (g->nodes[i]->type == 0)
            __atomic_add_fetch(&g->nodes[i]->func->runs, 1, __ATOMIC_RELAXED);
        else
            run(g->nodes[i]->child);
}

CUresult cuGraphLaunch(struct exec *e, void *stream) {
    if (!e || stream_of(stream)->capture)
        return INVALID_VALUE;
    run(e->graph);
    return OK;
}

// ------------------------------------------------------------------ memory

CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t size) {
    void *p = NULL;
    if (!size || posix_memalign(&p, 256, size))
        return 2;  // CUDA_ERROR_OUT_OF_MEMORY
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuMemFree_v2(CUdeviceptr ptr) {
    free((void *)(uintptr_t)ptr);
    return OK;
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *ptr, size_t size, void *pool, void *stream) {
    (void)pool, (void)stream;  // one pool here, allocated at once
    return cuMemAlloc_v2(ptr, size);
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t align, CUdeviceptr addr, unsigned long long flags) {
    (void)align, (void)addr, (void)flags;
    void *p = mmap(NULL, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return 2;
    *ptr = (CUdeviceptr)(uintptr_t)p;
    return OK;
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) { return munmap((void *)(uintptr_t)ptr, size) ? 1 : OK; }

CUresult cuMemCreate(unsigned long long *handle, size_t size, const void *prop, unsigned long long flags) {
    (void)prop, (void)flags;
    *handle = size;  // the physical allocation stands in as its size
    return size ? OK : INVALID_VALUE;
}

CUresult cuMemRelease(unsigned long long handle) { return handle ? OK : INVALID_VALUE; }

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, unsigned long long handle, unsigned long long flags) {
    (void)offset, (void)flags;
    if (!handle || size > handle)
        return INVALID_VALUE;
    return mprotect((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE) ? INVALID_VALUE : OK;
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) { return mprotect((void *)(uintptr_t)ptr, size, PROT_NONE) ? 1 : OK; }

// ------------------------------------------------------------------ cuGetProcAddress

static const struct {
    const char *name;  // the base name asked for
    int from;          // the first version this entry answers
    int per_thread;    // answers only with (1) or without (0) the per-thread stream flag; -1 either
    void *fn;
} procs[] = {
    {"cuInit", 2000, -1, (void *)cuInit},
    {"cuDriverGetVersion", 2020, -1, (void *)cuDriverGetVersion},
    {"cuModuleGetFunction", 2000, -1, (void *)cuModuleGetFunction},
    {"cuFuncGetName", 12030, -1, (void *)cuFuncGetName},
    {"cuLaunchKernel", 4000, -1, (void *)cuLaunchKernel},
    {"cuLaunchKernelEx", 11060, -1, (void *)cuLaunchKernelEx},
    {"cuStreamCreate", 2000, -1, (void *)cuStreamCreate},
    {"cuStreamBeginCapture", 10010, -1, (void *)cuStreamBeginCapture_v2},
    {"cuStreamEndCapture", 10000, -1, (void *)cuStreamEndCapture},
    {"cuStreamIsCapturing", 10000, -1, (void *)cuStreamIsCapturing},
    {"cuGraphCreate", 10000, -1, (void *)cuGraphCreate},
    {"cuGraphAddChildGraphNode", 10000, -1, (void *)cuGraphAddChildGraphNode},
    {"cuGraphGetNodes", 10000, -1, (void *)cuGraphGetNodes},
    {"cuGraphNodeGetType", 10000, -1, (void *)cuGraphNodeGetType},
    {"cuGraphKernelNodeGetParams", 12000, -1, (void *)cuGraphKernelNodeGetParams_v2},
    {"cuGraphChildGraphNodeGetGraph", 10000, -1, (void *)cuGraphChildGraphNodeGetGraph},
    {"cuGraphInstantiate", 12000, -1, (void *)cuGraphInstantiateWithFlags},
    {"cuGraphInstantiate", 10000, -1, (void *)cuGraphInstantiate},
    {"cuGraphInstantiateWithFlags", 11040, -1, (void *)cuGraphInstantiateWithFlags},
    {"cuGraphLaunch", 10000, -1, (void *)cuGraphLaunch},
    {"cuMemAlloc", 3020, -1, (void *)cuMemAlloc_v2},
    {"cuMemFree", 3020, -1, (void *)cuMemFree_v2},
    {"cuMemAllocFromPoolAsync", 11020, -1, (void *)cuMemAllocFromPoolAsync},
    {"cuMemAddressReserve", 10020, -1, (void *)cuMemAddressReserve},
    {"cuMemAddressFree", 10020, -1, (void *)cuMemAddressFree},
    {"cuMemCreate", 10020, -1, (void *)cuMemCreate},
    {"cuMemRelease", 10020, -1, (void *)cuMemRelease},
    {"cuMemMap", 10020, -1, (void *)cuMemMap},
    {"cuMemUnmap", 10020, -1, (void *)cuMemUnmap},
};

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags);

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags, int *status) {
    (void)flags;  // one stream semantics here: the per-thread default stream is the legacy one
    if (strcmp(symbol, "cuGetProcAddress") == 0) {  // as the real driver: itself, by ABI
        *pfn = version >= 12000 ? (void *)cuGetProcAddress_v2 : (void *)cuGetProcAddress;
        if (status)
            *status = 0;
        return OK;
    }
    for (size_t i = 0; i < sizeof(procs) / sizeof(procs[0]); i++)
        if (version >= procs[i].from && strcmp(symbol, procs[i].name) == 0) {
            *pfn = procs[i].fn;
            if (status)
                *status = 0;  // CU_GET_PROC_ADDRESS_SUCCESS
            return OK;
        }
    *pfn = NULL;
    if (status)
        *status = 1;  // CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
    return NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}
