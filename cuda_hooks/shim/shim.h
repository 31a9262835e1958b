// What the kvguard shim's parts share (cuda_hooks/shim/*.c, one library): the CUDA types they
// need, how a wrapper finds the real function, and the one non-blocking way to the agent.
#pragma once
#define _GNU_SOURCE
#include <stddef.h>
#include <stdint.h>

// Everything declared here is the shim's own: hidden from the process it is preloaded into,
// which sees only the CUDA entry points, dlsym, and the kvguard_* calls a guard makes.
#pragma GCC visibility push(hidden)

typedef int cuda_status;                // cudaError_t and CUresult: 0 is success for both
typedef unsigned long long device_ptr;  // CUdeviceptr

#define UNRESOLVED 999  // cudaErrorUnknown, CUDA_ERROR_UNKNOWN: no real function to call
#define RUNTIME "libcudart.so"
#define DRIVER "libcuda.so"

// The real definition of `name` after the shim (RTLD_NEXT), or in an already loaded `library`
// (one dlopen'ed RTLD_LOCAL, as Python extensions load the CUDA libraries).
void *kvguard_resolve(const char *name, const char *library);
// glibc's dlsym, for the shim's own lookups (the exported dlsym is the shim's wrapper).
void *kvguard_real_dlsym(void *handle, const char *name);

// Send one fixed-size record to the node agent's shim socket without ever waiting: 0 when it
// went, -1 when it was dropped (and counted in every later record's `dropped`).
int kvguard_send(void *record, size_t size);
uint64_t kvguard_dropped(void);

// Set while a runtime wrapper runs: the driver calls the runtime makes under it are the same
// launch or allocation, already counted once.
extern __thread __attribute__((tls_model("initial-exec"))) int kvguard_in_runtime;

// ------------------------------------------------------------------ wrapped entry points
// A family is one ABI of a driver entry point (cuLaunchKernel and cuLaunchKernel_ptsz share
// one). Its SLOTS wrappers each call the real function in the same slot: the resolver hands
// one out for each distinct real function a process asks for (by dlsym or cuGetProcAddress),
// so a wrapper always calls exactly the function the caller would have had.
#define SLOTS 4
struct family {
    const char *name;
    void *reals[SLOTS];
    void *wrappers[SLOTS];
};

#define UNPACK(...) __VA_ARGS__
#define FAMILY(fam, ret, params, args)                                                      \
    static ret fam##_impl(void *real, UNPACK params);                                       \
    static ret fam##_s0 params { return fam##_impl(__atomic_load_n(&fam.reals[0], __ATOMIC_RELAXED), UNPACK args); } \
    static ret fam##_s1 params { return fam##_impl(__atomic_load_n(&fam.reals[1], __ATOMIC_RELAXED), UNPACK args); } \
    static ret fam##_s2 params { return fam##_impl(__atomic_load_n(&fam.reals[2], __ATOMIC_RELAXED), UNPACK args); } \
    static ret fam##_s3 params { return fam##_impl(__atomic_load_n(&fam.reals[3], __ATOMIC_RELAXED), UNPACK args); } \
    struct family fam = {#fam, {0}, {(void *)fam##_s0, (void *)fam##_s1, (void *)fam##_s2, (void *)fam##_s3}};

// An exported definition of `name` (what LD_PRELOAD interposes): the family's body around the
// next definition of the same name.
#define EXPORT(fam, name, library, ret, params, args)                         \
    ret name params {                                                         \
        static void *real_;                                                   \
        void *fn = __atomic_load_n(&real_, __ATOMIC_RELAXED);                 \
        if (!fn) {                                                            \
            fn = kvguard_resolve(#name, library);                             \
            __atomic_store_n(&real_, fn, __ATOMIC_RELAXED);                   \
        }                                                                     \
        return fam##_impl(fn, UNPACK args);                                   \
    }

extern struct family kvguard_launch, kvguard_launch_ex, kvguard_graph_launch, kvguard_instantiate5,
    kvguard_instantiate_flags, kvguard_instantiate_params, kvguard_mem_alloc, kvguard_mem_free,
    kvguard_mem_alloc_async, kvguard_mem_alloc_pool, kvguard_mem_free_async, kvguard_mem_map, kvguard_mem_unmap, kvguard_gpa1,
    kvguard_gpa2;
extern _Atomic uint64_t kvguard_unwrapped;  // entry points handed out unwrapped: no slot was left

// The launch witness's judgement (kvguard_launch.c), for the graphs' (kvguard_graph.c).
enum { KVGUARD_NAMED = 1, KVGUARD_ATTENTION = 2 };
int kvguard_classify(uintptr_t key, const char **name);  // KVGUARD_NAMED | KVGUARD_ATTENTION, cached
uint64_t kvguard_patterns_generation(void);              // changes when the attention patterns do
void kvguard_judge(const char *name, int graph);          // one attention launch that ran
void kvguard_count_graph_launch(int known);               // a graph launch (known: its summary is)

// The guard's step word (record.h), mapped when a guard publishes one; NULL until then.
struct kvguard_steps;
struct kvguard_steps *kvguard_steps_word(void);

#pragma GCC visibility pop
