// kvguard LD_PRELOAD shim: counts what an engine process copies with the CUDA runtime and
// driver copy calls, for hosts where BPF is not allowed. Built by `make shim`, one library with
// its other parts: the launch witness (kvguard_launch.c, kvguard_graph.c), the allocation
// witness (kvguard_memory.c) and how a process finds the driver (kvguard_resolve.c). This file
// also holds what they share: kvguard_resolve() and the one non-blocking way to the agent.
//
//   LD_PRELOAD=cuda_hooks/shim/libkvguard_shim.so python -m my_engine
//
// Each intercepted call is passed to the real function (dlsym RTLD_NEXT, resolved once) and
// its byte count added to per-thread counters: no lock, no system call, no allocation on
// the call's path. An engine (its kvguard guard) may name the transfer its copies belong
// to with kvguard_xfer_begin(xfer) / kvguard_xfer_end(); at the end one fixed-size record
// (struct kvguard_shim_record, cuda_hooks/shim/record.h) goes to the node agent's shim socket
// ($KVGUARD_SHIM_SOCKET, a Unix SOCK_SEQPACKET socket), sent without blocking: a record the
// agent cannot take now is counted in the next one's `dropped`, and the engine never waits.
//
// Invariants: the shim never changes an argument or a result of the call it wraps; a copy's
// bytes count once, under the kind its call names (the driver's typed calls map onto the
// runtime's kinds), and under `failed_bytes` instead when the call returned an error.

#include "shim.h"

#include <dlfcn.h>
#include <link.h>
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "record.h"

#define DEFAULT_SOCKET "/run/kvguard/agent.sock.shim"

// For cuda_hooks/shim.py to check that it reads the record with the same layout.
const size_t kvguard_shim_record_size = sizeof(struct kvguard_shim_record);

// initial-exec: the shim is preloaded, so its thread-local state sits in the static TLS block
// and is read without a call to __tls_get_addr on every copy.
static __thread __attribute__((tls_model("initial-exec"))) struct {
    int active;
    struct kvguard_shim_record rec;
} current;

static atomic_ullong dropped;
static int agent = -1;
static pthread_mutex_t agent_lock = PTHREAD_MUTEX_INITIALIZER;

struct loaded {
    const char *library;  // "libcudart.so" or "libcuda.so"
    char path[4096];
};

static int find_loaded(struct dl_phdr_info *info, size_t size, void *data) {
    (void)size;
    struct loaded *want = data;
    const char *base = strrchr(info->dlpi_name, '/');
    if (strncmp(base ? base + 1 : info->dlpi_name, want->library, strlen(want->library)) != 0)
        return 0;
    strncpy(want->path, info->dlpi_name, sizeof(want->path) - 1);
    return 1;
}

// The real function: the next definition in the global scope, or, where the CUDA library was
// loaded into a local scope (dlopen RTLD_LOCAL: Python extensions such as torch are), the
// one in that already loaded library.
void *kvguard_resolve(const char *name, const char *library) {
    void *fn = kvguard_real_dlsym(RTLD_NEXT, name);
    if (fn)
        return fn;
    struct loaded want = {.library = library};
    if (dl_iterate_phdr(find_loaded, &want)) {
        void *handle = dlopen(want.path, RTLD_LAZY | RTLD_NOLOAD);
        if (handle) {
            fn = kvguard_real_dlsym(handle, name);
            dlclose(handle);  // NOLOAD took a reference: the library stays loaded by its owner
        }
    }
    return fn;
}

#define REAL(name, library)                                                  \
    static __typeof__(&name) real_##name;                                    \
    __typeof__(&name) fn = __atomic_load_n(&real_##name, __ATOMIC_RELAXED);  \
    if (!fn) {                                                               \
        fn = (__typeof__(&name))kvguard_resolve(#name, library);                     \
        if (!fn)                                                             \
            return UNRESOLVED;                                               \
        __atomic_store_n(&real_##name, fn, __ATOMIC_RELAXED);                \
    }

static inline cuda_status count(int kind, size_t bytes, cuda_status status) {
    if (current.active) {
        struct kvguard_shim_record *r = &current.rec;
        r->calls++;
        if (status == 0) {
            r->bytes[kind] += bytes;
        } else {
            r->failed++;
            r->failed_bytes += bytes;
            r->last_error = status;
        }
    }
    return status;
}

// ------------------------------------------------------------------ the transfer's name

void kvguard_xfer_begin(const char *xfer) {
    memset(&current.rec, 0, sizeof(current.rec));
    strncpy(current.rec.xfer, xfer ? xfer : "", sizeof(current.rec.xfer) - 1);
    current.active = 1;
}

static int connect_agent(void) {
    const char *path = getenv("KVGUARD_SHIM_SOCKET");
    if (!path || !*path)
        path = DEFAULT_SOCKET;
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    strncpy(addr.sun_path, path, sizeof(addr.sun_path) - 1);
    if (connect(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

int kvguard_send(void *record, size_t size) {
    int sent = -1;
    // Records are rare next to the calls they count (one a transfer or a step): a lock here
    // costs the engine nothing.
    pthread_mutex_lock(&agent_lock);
    for (int attempt = 0; attempt < 2 && sent < 0; attempt++) {
        if (agent < 0)
            agent = connect_agent();
        if (agent < 0)
            break;
        if (send(agent, record, size, MSG_DONTWAIT | MSG_NOSIGNAL) == (ssize_t)size) {
            sent = 0;
        } else if (errno != EAGAIN && errno != EWOULDBLOCK) {
            close(agent);  // the agent went away: reconnect once
            agent = -1;
        } else {
            break;  // the agent is behind: drop, never wait
        }
    }
    pthread_mutex_unlock(&agent_lock);
    if (sent < 0)
        atomic_fetch_add(&dropped, 1);
    return sent;
}

uint64_t kvguard_dropped(void) { return atomic_load(&dropped); }

// Returns 0 when the record went to the agent, -1 when it was dropped (and counted).
int kvguard_xfer_end(void) {
    if (!current.active)
        return -1;
    current.active = 0;
    struct kvguard_shim_record *r = &current.rec;
    r->magic = KVGUARD_SHIM_MAGIC;
    r->version = KVGUARD_SHIM_VERSION;
    r->pid = (uint32_t)getpid();
    r->dropped = atomic_load(&dropped);
    return kvguard_send(r, sizeof(*r));
}

// ------------------------------------------------------------------ the CUDA runtime

cuda_status cudaMemcpy(void *dst, const void *src, size_t count_, int kind) {
    REAL(cudaMemcpy, RUNTIME);
    return count(kind & 7, count_, fn(dst, src, count_, kind));
}

cuda_status cudaMemcpyAsync(void *dst, const void *src, size_t count_, int kind, void *stream) {
    REAL(cudaMemcpyAsync, RUNTIME);
    return count(kind & 7, count_, fn(dst, src, count_, kind, stream));
}

cuda_status cudaMemcpyPeer(void *dst, int dst_dev, const void *src, int src_dev, size_t count_) {
    REAL(cudaMemcpyPeer, RUNTIME);
    return count(KVGUARD_D2D, count_, fn(dst, dst_dev, src, src_dev, count_));
}

cuda_status cudaMemcpyPeerAsync(void *dst, int dst_dev, const void *src, int src_dev, size_t count_,
                                void *stream) {
    REAL(cudaMemcpyPeerAsync, RUNTIME);
    return count(KVGUARD_D2D, count_, fn(dst, dst_dev, src, src_dev, count_, stream));
}

// ------------------------------------------------------------------ the CUDA driver

cuda_status cuMemcpy(device_ptr dst, device_ptr src, size_t n) {
    REAL(cuMemcpy, DRIVER);
    return count(KVGUARD_DEFAULT, n, fn(dst, src, n));
}

cuda_status cuMemcpyAsync(device_ptr dst, device_ptr src, size_t n, void *stream) {
    REAL(cuMemcpyAsync, DRIVER);
    return count(KVGUARD_DEFAULT, n, fn(dst, src, n, stream));
}

cuda_status cuMemcpyDtoH_v2(void *dst, device_ptr src, size_t n) {
    REAL(cuMemcpyDtoH_v2, DRIVER);
    return count(KVGUARD_D2H, n, fn(dst, src, n));
}

cuda_status cuMemcpyDtoHAsync_v2(void *dst, device_ptr src, size_t n, void *stream) {
    REAL(cuMemcpyDtoHAsync_v2, DRIVER);
    return count(KVGUARD_D2H, n, fn(dst, src, n, stream));
}

cuda_status cuMemcpyHtoD_v2(device_ptr dst, const void *src, size_t n) {
    REAL(cuMemcpyHtoD_v2, DRIVER);
    return count(KVGUARD_H2D, n, fn(dst, src, n));
}

cuda_status cuMemcpyHtoDAsync_v2(device_ptr dst, const void *src, size_t n, void *stream) {
    REAL(cuMemcpyHtoDAsync_v2, DRIVER);
    return count(KVGUARD_H2D, n, fn(dst, src, n, stream));
}

cuda_status cuMemcpyDtoD_v2(device_ptr dst, device_ptr src, size_t n) {
    REAL(cuMemcpyDtoD_v2, DRIVER);
    return count(KVGUARD_D2D, n, fn(dst, src, n));
}

cuda_status cuMemcpyDtoDAsync_v2(device_ptr dst, device_ptr src, size_t n, void *stream) {
    REAL(cuMemcpyDtoDAsync_v2, DRIVER);
    return count(KVGUARD_D2D, n, fn(dst, src, n, stream));
}

cuda_status cuMemcpyPeer(device_ptr dst, void *dst_ctx, device_ptr src, void *src_ctx, size_t n) {
    REAL(cuMemcpyPeer, DRIVER);
    return count(KVGUARD_D2D, n, fn(dst, dst_ctx, src, src_ctx, n));
}

cuda_status cuMemcpyPeerAsync(device_ptr dst, void *dst_ctx, device_ptr src, void *src_ctx, size_t n,
                              void *stream) {
    REAL(cuMemcpyPeerAsync, DRIVER);
    return count(KVGUARD_D2D, n, fn(dst, dst_ctx, src, src_ctx, n, stream));
}
