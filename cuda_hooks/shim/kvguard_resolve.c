// How a process finds the CUDA driver, and the shim with it. LD_PRELOAD alone interposes only
// calls bound by name in the global scope; a CUDA process finds most driver entry points
// otherwise: the runtime (libcudart, shared or static) dlopens libcuda, looks up
// cuGetProcAddress_v2 with dlsym on that handle and asks it for every other function (by base
// name and CUDA version: "cuMemAlloc" at 12000 is cuMemAlloc_v2); PyTorch and Triton dlsym
// libcuda's handle for what they call. So the shim also exports dlsym and cuGetProcAddress:
// whatever a wrapped entry point resolves to, the caller gets a wrapper around exactly that
// function (one slot of its family per distinct real function).
//
// Invariants: a lookup returns what it would have returned without the shim, or a wrapper
// that calls exactly that; a name the shim does not wrap, a failed lookup and the shim's own
// exports (found by RTLD_DEFAULT) are returned as they are; a function no slot is left for
// is returned unwrapped and counted (kvguard_unwrapped), never dropped.

#include "shim.h"

#include <dlfcn.h>
#include <link.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

_Atomic uint64_t kvguard_unwrapped;
static pthread_mutex_t claim_lock = PTHREAD_MUTEX_INITIALIZER;

// ------------------------------------------------------------------ glibc's dlsym

typedef void *(*dlsym_fn)(void *, const char *);
static dlsym_fn real_dlsym_fn;

void *kvguard_real_dlsym(void *handle, const char *name) {
    dlsym_fn fn = __atomic_load_n(&real_dlsym_fn, __ATOMIC_RELAXED);
    if (!fn) {
        fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.34");
        if (!fn)
            fn = (dlsym_fn)dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
        __atomic_store_n(&real_dlsym_fn, fn, __ATOMIC_RELAXED);
    }
    return fn ? fn(handle, name) : NULL;
}

static int in_shim(const void *address) {
    static const void *base;
    if (!base) {
        Dl_info self;
        if (dladdr((void *)in_shim, &self))
            base = self.dli_fbase;
    }
    Dl_info info;
    return address && dladdr(address, &info) && info.dli_fbase == base;
}

// ------------------------------------------------------------------ RTLD_NEXT for other callers
// glibc answers dlsym(RTLD_NEXT, ...) relative to the object that called it, which is now
// the shim: for another caller, the objects after the caller's are searched in load order.

#define MAX_OBJECTS 1024
struct objects {
    const void *caller;
    int after;  // the caller's object was passed
    int count;
    char names[MAX_OBJECTS][256];
};

static int contains(struct dl_phdr_info *info, const void *address) {
    for (int i = 0; i < info->dlpi_phnum; i++) {
        const ElfW(Phdr) *p = &info->dlpi_phdr[i];
        uintptr_t lo = info->dlpi_addr + p->p_vaddr;
        if (p->p_type == PT_LOAD && (uintptr_t)address >= lo && (uintptr_t)address < lo + p->p_memsz)
            return 1;
    }
    return 0;
}

static int collect_after(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct objects *o = data;
    if (!o->after) {
        o->after = contains(info, o->caller);
        return 0;
    }
    if (o->count < MAX_OBJECTS && info->dlpi_name && *info->dlpi_name)
        strncpy(o->names[o->count++], info->dlpi_name, sizeof(o->names[0]) - 1);
    return 0;
}

static void *next_after(const void *caller, const char *name) {
    if (in_shim(caller))
        return kvguard_real_dlsym(RTLD_NEXT, name);
    static __thread struct objects *o;  // 256 KiB: not on the caller's stack
    if (!o && !(o = calloc(1, sizeof(*o))))
        return NULL;
    o->caller = caller;
    o->after = 0;
    o->count = 0;
    dl_iterate_phdr(collect_after, o);  // dlopen is not called under the loader's iteration lock
    for (int i = 0; i < o->count; i++) {
        void *handle = dlopen(o->names[i], RTLD_LAZY | RTLD_NOLOAD);
        if (!handle)
            continue;
        void *found = kvguard_real_dlsym(handle, name);
        dlclose(handle);
        if (found)
            return found;
    }
    return NULL;
}

// ------------------------------------------------------------------ families and slots

static void *claim(struct family *f, void *real) {
    if (!real || in_shim(real))
        return NULL;
    for (int i = 0; i < SLOTS; i++)
        if (__atomic_load_n(&f->reals[i], __ATOMIC_ACQUIRE) == real)
            return f->wrappers[i];
    void *wrapper = NULL;
    pthread_mutex_lock(&claim_lock);
    for (int i = 0; i < SLOTS && !wrapper; i++) {
        void *held = __atomic_load_n(&f->reals[i], __ATOMIC_ACQUIRE);
        if (held == real || !held) {
            __atomic_store_n(&f->reals[i], real, __ATOMIC_RELEASE);
            wrapper = f->wrappers[i];
        }
    }
    pthread_mutex_unlock(&claim_lock);
    if (!wrapper)
        atomic_fetch_add(&kvguard_unwrapped, 1);
    return wrapper;
}

// Exact ABI names, as libcuda exports them (what dlsym asks for).
static const struct {
    const char *name;
    struct family *family;
} exact[] = {
    {"cuGetProcAddress", &kvguard_gpa1},
    {"cuGetProcAddress_v2", &kvguard_gpa2},
    {"cuLaunchKernel", &kvguard_launch},
    {"cuLaunchKernel_ptsz", &kvguard_launch},
    {"cuLaunchKernelEx", &kvguard_launch_ex},
    {"cuLaunchKernelEx_ptsz", &kvguard_launch_ex},
    {"cuGraphLaunch", &kvguard_graph_launch},
    {"cuGraphLaunch_ptsz", &kvguard_graph_launch},
    {"cuGraphInstantiate", &kvguard_instantiate5},  // the exported symbol keeps CUDA 11's ABI
    {"cuGraphInstantiate_v2", &kvguard_instantiate5},
    {"cuGraphInstantiateWithFlags", &kvguard_instantiate_flags},
    {"cuGraphInstantiateWithParams", &kvguard_instantiate_params},
    {"cuGraphInstantiateWithParams_ptsz", &kvguard_instantiate_params},
    {"cuMemAlloc_v2", &kvguard_mem_alloc},
    {"cuMemFree_v2", &kvguard_mem_free},
    {"cuMemAllocAsync", &kvguard_mem_alloc_async},
    {"cuMemAllocAsync_ptsz", &kvguard_mem_alloc_async},
    {"cuMemAllocFromPoolAsync", &kvguard_mem_alloc_pool},
    {"cuMemAllocFromPoolAsync_ptsz", &kvguard_mem_alloc_pool},
    {"cuMemFreeAsync", &kvguard_mem_free_async},
    {"cuMemFreeAsync_ptsz", &kvguard_mem_free_async},
    {"cuMemMap", &kvguard_mem_map},
    {"cuMemUnmap", &kvguard_mem_unmap},
};

static void *wrap_exact(const char *abi_name, void *real) {
    for (size_t i = 0; i < sizeof(exact) / sizeof(exact[0]); i++)
        if (strcmp(abi_name, exact[i].name) == 0)
            return claim(exact[i].family, real);
    return NULL;
}

// cuGetProcAddress's names: the base name, whose ABI depends on the CUDA version asked for
// (cuda.h's #defines: cuMemAlloc is cuMemAlloc_v2 from 3.2, cuGraphInstantiate takes flags
// from 12.0); the per-thread-stream flag changes the function, not its ABI.
static struct family *family_of(const char *symbol, int version) {
    static const struct {
        const char *name;
        int from;  // the first CUDA version with this ABI under that name
        struct family *family;
    } versioned[] = {
        {"cuGetProcAddress", 12000, &kvguard_gpa2},
        {"cuGetProcAddress", 11030, &kvguard_gpa1},
        {"cuLaunchKernel", 4000, &kvguard_launch},
        {"cuLaunchKernelEx", 11060, &kvguard_launch_ex},
        {"cuGraphLaunch", 10000, &kvguard_graph_launch},
        {"cuGraphInstantiate", 12000, &kvguard_instantiate_flags},
        {"cuGraphInstantiate", 11000, &kvguard_instantiate5},
        {"cuGraphInstantiateWithFlags", 11040, &kvguard_instantiate_flags},
        {"cuGraphInstantiateWithParams", 12000, &kvguard_instantiate_params},
        {"cuMemAlloc", 3020, &kvguard_mem_alloc},
        {"cuMemFree", 3020, &kvguard_mem_free},
        {"cuMemAllocAsync", 11020, &kvguard_mem_alloc_async},
        {"cuMemAllocFromPoolAsync", 11020, &kvguard_mem_alloc_pool},
        {"cuMemFreeAsync", 11020, &kvguard_mem_free_async},
        {"cuMemMap", 10020, &kvguard_mem_map},
        {"cuMemUnmap", 10020, &kvguard_mem_unmap},
    };
    for (size_t i = 0; i < sizeof(versioned) / sizeof(versioned[0]); i++)
        if (version >= versioned[i].from && strcmp(symbol, versioned[i].name) == 0)
            return versioned[i].family;
    return NULL;
}

static void *wrap(const char *symbol, int cuda_version, void *real) {
    struct family *f = family_of(symbol, cuda_version);
    return f ? claim(f, real) : NULL;
}

// ------------------------------------------------------------------ the exported lookups

void *dlsym(void *handle, const char *name) {
    const void *caller = __builtin_return_address(0);
    void *found = handle == RTLD_NEXT ? next_after(caller, name) : kvguard_real_dlsym(handle, name);
    if (found && name[0] == 'c' && name[1] == 'u' && name[2] >= 'A' && name[2] <= 'Z') {
        void *wrapper = wrap_exact(name, found);
        if (wrapper)
            return wrapper;
    }
    return found;
}

typedef cuda_status (*gpa1_fn)(const char *, void **, int, uint64_t);
typedef cuda_status (*gpa2_fn)(const char *, void **, int, uint64_t, int *);

static cuda_status answered(const char *symbol, void **pfn, int version, cuda_status status) {
    if (status == 0 && pfn && *pfn && symbol) {
        void *wrapper = wrap(symbol, version, *pfn);
        if (wrapper)
            *pfn = wrapper;
    }
    return status;
}

FAMILY(kvguard_gpa1, cuda_status, (const char *symbol, void **pfn, int version, uint64_t flags),
       (symbol, pfn, version, flags))
static cuda_status kvguard_gpa1_impl(void *real, const char *symbol, void **pfn, int version, uint64_t flags) {
    if (!real)
        return UNRESOLVED;
    return answered(symbol, pfn, version, ((gpa1_fn)real)(symbol, pfn, version, flags));
}
EXPORT(kvguard_gpa1, cuGetProcAddress, DRIVER, cuda_status,
       (const char *symbol, void **pfn, int version, uint64_t flags), (symbol, pfn, version, flags))

FAMILY(kvguard_gpa2, cuda_status, (const char *symbol, void **pfn, int version, uint64_t flags, int *status),
       (symbol, pfn, version, flags, status))
static cuda_status kvguard_gpa2_impl(void *real, const char *symbol, void **pfn, int version, uint64_t flags,
                                     int *status) {
    if (!real)
        return UNRESOLVED;
    return answered(symbol, pfn, version, ((gpa2_fn)real)(symbol, pfn, version, flags, status));
}
EXPORT(kvguard_gpa2, cuGetProcAddress_v2, DRIVER, cuda_status,
       (const char *symbol, void **pfn, int version, uint64_t flags, int *status),
       (symbol, pfn, version, flags, status))
