// The launch witness's graphs: no API call fires per node when a CUDA graph replays, so a
// graph's kernels are read when it is instantiated (its nodes, child graphs included, through
// the driver's own graph calls) and kept by exec handle; a replay is judged (kvguard_launch.c)
// as one launch of the first attention kernel it holds under the current patterns.
//
// Invariants: an exec handle's summary is the one of its latest instantiation (a handle reused
// is summarised again); a launch of an exec the shim never saw instantiated is counted as
// unnamed, never guessed; the wrapped calls' results are the real ones'.

#include "shim.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>

typedef void *CUstream;

static void *driver_symbol(const char *name) { return kvguard_resolve(name, DRIVER); }

static inline size_t slot_of(uintptr_t key) { return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 52); }

// ------------------------------------------------------------------ what a graph holds

#define GRAPHS 4096
#define GRAPH_KERNELS 32
struct graph_summary {
    _Atomic uintptr_t exec;
    _Atomic int ready;
    int kernels;                     // distinct kernel functions held (at most GRAPH_KERNELS kept)
    uintptr_t funcs[GRAPH_KERNELS];
    _Atomic uintptr_t attention_key; // the first attention kernel among them, by the last patterns
    _Atomic uint64_t gen;
};
static struct graph_summary graphs[GRAPHS];
static pthread_mutex_t graphs_lock = PTHREAD_MUTEX_INITIALIZER;

typedef cuda_status (*nodes_fn)(void *, void **, size_t *);
typedef cuda_status (*type_fn)(void *, int *);
typedef cuda_status (*params_fn)(void *, void *);
typedef cuda_status (*child_fn)(void *, void **);

static void add_kernel(struct graph_summary *g, uintptr_t key) {
    for (int i = 0; i < g->kernels && i < GRAPH_KERNELS; i++)
        if (g->funcs[i] == key)
            return;
    if (g->kernels < GRAPH_KERNELS)
        g->funcs[g->kernels] = key;
    g->kernels++;
}

static void walk(void *graph, struct graph_summary *g, int depth) {
    static nodes_fn nodes;
    static type_fn type_of;
    static params_fn params, params_v1;
    static child_fn child;
    if (!nodes) {
        nodes = (nodes_fn)driver_symbol("cuGraphGetNodes");
        type_of = (type_fn)driver_symbol("cuGraphNodeGetType");
        params = (params_fn)driver_symbol("cuGraphKernelNodeGetParams_v2");
        params_v1 = (params_fn)driver_symbol("cuGraphKernelNodeGetParams");
        child = (child_fn)driver_symbol("cuGraphChildGraphNodeGetGraph");
    }
    params_fn get = params ? params : params_v1;
    size_t n = 0;
    if (!nodes || !type_of || !get || depth > 8 || nodes(graph, NULL, &n) != 0 || n == 0)
        return;
    void **list = calloc(n, sizeof(void *));
    if (!list)
        return;
    if (nodes(graph, list, &n) == 0) {
        for (size_t i = 0; i < n; i++) {
            int type = -1;
            if (type_of(list[i], &type) != 0)
                continue;
            if (type == 0) {  // CU_GRAPH_NODE_TYPE_KERNEL: func first, CUkernel at 56 (v2)
                uint64_t buffer[32] = {0};
                if (get(list[i], buffer) == 0) {
                    uintptr_t key = buffer[0] ? (uintptr_t)buffer[0] : (uintptr_t)buffer[7];
                    if (key)
                        add_kernel(g, key);
                }
            } else if (type == 5 && child) {  // CU_GRAPH_NODE_TYPE_GRAPH
                void *inner = NULL;
                if (child(list[i], &inner) == 0 && inner)
                    walk(inner, g, depth + 1);
            }
        }
    }
    free(list);
}

// The first attention kernel of a summary under the current patterns (0: none).
static uintptr_t graph_attention(struct graph_summary *g, const char **name) {
    uint64_t gen = kvguard_patterns_generation();
    if (atomic_load(&g->gen) == gen) {
        uintptr_t key = atomic_load(&g->attention_key);
        if (key)
            kvguard_classify(key, name);
        return key;
    }
    uintptr_t key = 0;
    for (int i = 0; i < g->kernels && i < GRAPH_KERNELS && !key; i++)
        if (kvguard_classify(g->funcs[i], name) & KVGUARD_ATTENTION)
            key = g->funcs[i];
    atomic_store(&g->attention_key, key);
    atomic_store(&g->gen, gen);
    return key;
}

static struct graph_summary *graph_of(uintptr_t exec) {
    size_t at = slot_of(exec) & (GRAPHS - 1);
    for (int probe = 0; probe < 32; probe++, at = (at + 1) & (GRAPHS - 1)) {
        uintptr_t held = atomic_load_explicit(&graphs[at].exec, memory_order_acquire);
        if (held == exec)
            return atomic_load(&graphs[at].ready) ? &graphs[at] : NULL;
        if (!held)
            return NULL;
    }
    return NULL;
}

// After an instantiation: the exec's kernels, read from its graph (a reused exec handle is
// summarised again).
static void instantiated(void *exec, void *graph) {
    if (!exec || !graph)
        return;
    pthread_mutex_lock(&graphs_lock);
    size_t at = slot_of((uintptr_t)exec) & (GRAPHS - 1);
    struct graph_summary *g = NULL;
    for (int probe = 0; probe < 32 && !g; probe++, at = (at + 1) & (GRAPHS - 1)) {
        uintptr_t held = atomic_load(&graphs[at].exec);
        if (!held || held == (uintptr_t)exec)
            g = &graphs[at];
    }
    if (g) {
        atomic_store(&g->ready, 0);
        atomic_store(&g->exec, (uintptr_t)exec);
        g->kernels = 0;
        atomic_store(&g->gen, 0);
        atomic_store(&g->attention_key, 0);
        walk(graph, g, 0);
        atomic_store(&g->ready, 1);
    }
    pthread_mutex_unlock(&graphs_lock);
}

static void graph_launched(void *exec) {
    struct graph_summary *g = graph_of((uintptr_t)exec);
    kvguard_count_graph_launch(g != NULL);
    const char *name = NULL;
    if (g && graph_attention(g, &name))
        kvguard_judge(name ? name : "", 1);
}

// ------------------------------------------------------------------ the driver's entry points

typedef cuda_status (*graph_launch_fn)(void *, CUstream);
FAMILY(kvguard_graph_launch, cuda_status, (void *exec, CUstream stream), (exec, stream))
static cuda_status kvguard_graph_launch_impl(void *real, void *exec, CUstream stream) {
    if (!real)
        return UNRESOLVED;
    cuda_status status = ((graph_launch_fn)real)(exec, stream);
    if (status == 0 && !kvguard_in_runtime)
        graph_launched(exec);
    return status;
}
EXPORT(kvguard_graph_launch, cuGraphLaunch, DRIVER, cuda_status, (void *exec, CUstream stream), (exec, stream))
EXPORT(kvguard_graph_launch, cuGraphLaunch_ptsz, DRIVER, cuda_status, (void *exec, CUstream stream), (exec, stream))

typedef cuda_status (*instantiate5_fn)(void **, void *, void **, char *, size_t);
FAMILY(kvguard_instantiate5, cuda_status, (void **exec, void *graph, void **error_node, char *log, size_t log_size),
       (exec, graph, error_node, log, log_size))
static cuda_status kvguard_instantiate5_impl(void *real, void **exec, void *graph, void **error_node, char *log,
                                             size_t log_size) {
    if (!real)
        return UNRESOLVED;
    cuda_status status = ((instantiate5_fn)real)(exec, graph, error_node, log, log_size);
    if (status == 0 && exec)
        instantiated(*exec, graph);
    return status;
}
EXPORT(kvguard_instantiate5, cuGraphInstantiate, DRIVER, cuda_status,
       (void **exec, void *graph, void **error_node, char *log, size_t log_size), (exec, graph, error_node, log, log_size))
EXPORT(kvguard_instantiate5, cuGraphInstantiate_v2, DRIVER, cuda_status,
       (void **exec, void *graph, void **error_node, char *log, size_t log_size), (exec, graph, error_node, log, log_size))

typedef cuda_status (*instantiate_flags_fn)(void **, void *, unsigned long long);
FAMILY(kvguard_instantiate_flags, cuda_status, (void **exec, void *graph, unsigned long long flags), (exec, graph, flags))
static cuda_status kvguard_instantiate_flags_impl(void *real, void **exec, void *graph, unsigned long long flags) {
    if (!real)
        return UNRESOLVED;
    cuda_status status = ((instantiate_flags_fn)real)(exec, graph, flags);
    if (status == 0 && exec)
        instantiated(*exec, graph);
    return status;
}
EXPORT(kvguard_instantiate_flags, cuGraphInstantiateWithFlags, DRIVER, cuda_status,
       (void **exec, void *graph, unsigned long long flags), (exec, graph, flags))

typedef cuda_status (*instantiate_params_fn)(void **, void *, void *);
FAMILY(kvguard_instantiate_params, cuda_status, (void **exec, void *graph, void *params), (exec, graph, params))
static cuda_status kvguard_instantiate_params_impl(void *real, void **exec, void *graph, void *params) {
    if (!real)
        return UNRESOLVED;
    cuda_status status = ((instantiate_params_fn)real)(exec, graph, params);
    if (status == 0 && exec)
        instantiated(*exec, graph);
    return status;
}
EXPORT(kvguard_instantiate_params, cuGraphInstantiateWithParams, DRIVER, cuda_status,
       (void **exec, void *graph, void *params), (exec, graph, params))
EXPORT(kvguard_instantiate_params, cuGraphInstantiateWithParams_ptsz, DRIVER, cuda_status,
       (void **exec, void *graph, void *params), (exec, graph, params))

// ------------------------------------------------------------------ the runtime's entry point

cuda_status cudaGraphLaunch(void *exec, void *stream) {
    static __typeof__(&cudaGraphLaunch) real;
    if (!real && !(real = (__typeof__(&cudaGraphLaunch))kvguard_resolve("cudaGraphLaunch", RUNTIME)))
        return UNRESOLVED;
    kvguard_in_runtime++;
    cuda_status status = real(exec, stream);
    kvguard_in_runtime--;
    if (status == 0 && !kvguard_in_runtime)
        graph_launched(exec);
    return status;
}

