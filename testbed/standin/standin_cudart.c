// A stand-in CUDA runtime (libcudart.so.12) over the stand-in driver: the few runtime calls
// an engine makes that the kvguard shim wraps, reaching the driver exactly as the real
// runtime does: dlopen("libcuda.so.1"), dlsym(handle, "cuGetProcAddress_v2"), and every other
// driver function from cuGetProcAddress by base name and version. Kernels are registered as
// nvcc's generated code registers them (__cudaRegisterFunction: host stub -> device name).
// Built by testbed/standin/__init__.py.

#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef int cudaError_t;
enum { SUCCESS = 0, INSUFFICIENT_DRIVER = 35, INVALID_FUNCTION = 98 };
typedef struct {
    unsigned x, y, z;
} dim3;

typedef int (*gpa_fn)(const char *, void **, int, unsigned long long, int *);
static struct {
    int (*launch)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void *, void **,
                  void **);
    int (*get_function)(void **, void *, const char *);
    int (*graph_launch)(void *, void *);
    int (*alloc)(unsigned long long *, size_t);
    int (*free)(unsigned long long);
    int (*capturing)(void *, int *);
    int (*begin_capture)(void *, int);
    int (*end_capture)(void *, void **);
    int (*instantiate)(void **, void *, unsigned long long);
} drv;
static int ready = -1;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void start(void) {
    void *cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    gpa_fn gpa = cuda ? (gpa_fn)dlsym(cuda, "cuGetProcAddress_v2") : NULL;
    if (!gpa) {
        ready = 0;
        return;
    }
    const int v = 12080;
    int ok = 1;
#define GET(field, name) ok &= gpa(name, (void **)&drv.field, v, 0, NULL) == 0
    GET(launch, "cuLaunchKernel");
    GET(get_function, "cuModuleGetFunction");
    GET(graph_launch, "cuGraphLaunch");
    GET(alloc, "cuMemAlloc");
    GET(free, "cuMemFree");
    GET(capturing, "cuStreamIsCapturing");
    GET(begin_capture, "cuStreamBeginCapture");
    GET(end_capture, "cuStreamEndCapture");
    GET(instantiate, "cuGraphInstantiate");
#undef GET
    ready = ok;
}

static int started(void) {
    pthread_once(&once, start);
    return ready == 1;
}

#define STUBS 1024
static struct {
    const void *stub;
    char name[512];
    void *function;
} stubs[STUBS];
static int stub_count;
static pthread_mutex_t stubs_lock = PTHREAD_MUTEX_INITIALIZER;

void __cudaRegisterFunction(void **fatbin, const char *stub, char *device_fun, const char *device_name, int limit,
                            void *tid, void *bid, void *block, void *grid, int *warp) {
    (void)fatbin, (void)device_fun, (void)limit, (void)tid, (void)bid, (void)block, (void)grid, (void)warp;
    pthread_mutex_lock(&stubs_lock);
    if (stub_count < STUBS) {
        stubs[stub_count].stub = stub;
        strncpy(stubs[stub_count].name, device_name, sizeof(stubs[0].name) - 1);
        stub_count++;
    }
    pthread_mutex_unlock(&stubs_lock);
}

static int stub_index(const void *stub) {
    for (int i = 0; i < stub_count; i++)
        if (stubs[i].stub == stub)
            return i;
    return -1;
}

cudaError_t cudaFuncGetName(const char **name, const void *func) {
    int i = stub_index(func);
    if (i < 0)
        return INVALID_FUNCTION;
    *name = stubs[i].name;
    return SUCCESS;
}

cudaError_t cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, size_t shared, void *stream) {
    if (!started())
        return INSUFFICIENT_DRIVER;
    int i = stub_index(func);
    if (i < 0)
        return INVALID_FUNCTION;
    if (!stubs[i].function && drv.get_function(&stubs[i].function, NULL, stubs[i].name) != 0)
        return INVALID_FUNCTION;
    return drv.launch(stubs[i].function, grid.x, grid.y, grid.z, block.x, block.y, block.z, (unsigned)shared, stream,
                      args, NULL);
}

cudaError_t cudaGraphLaunch(void *exec, void *stream) { return started() ? drv.graph_launch(exec, stream) : INSUFFICIENT_DRIVER; }

cudaError_t cudaMalloc(void **ptr, size_t size) {
    unsigned long long p = 0;
    if (!started())
        return INSUFFICIENT_DRIVER;
    cudaError_t status = drv.alloc(&p, size);
    *ptr = (void *)(uintptr_t)p;
    return status;
}

cudaError_t cudaFree(void *ptr) { return started() ? drv.free((unsigned long long)(uintptr_t)ptr) : INSUFFICIENT_DRIVER; }

cudaError_t cudaStreamIsCapturing(void *stream, int *status) {
    return started() ? drv.capturing(stream, status) : INSUFFICIENT_DRIVER;
}

cudaError_t cudaStreamBeginCapture(void *stream, int mode) {
    return started() ? drv.begin_capture(stream, mode) : INSUFFICIENT_DRIVER;
}

cudaError_t cudaStreamEndCapture(void *stream, void **graph) {
    return started() ? drv.end_capture(stream, graph) : INSUFFICIENT_DRIVER;
}

cudaError_t cudaGraphInstantiate(void **exec, void *graph, unsigned long long flags) {
    return started() ? drv.instantiate(exec, graph, flags) : INSUFFICIENT_DRIVER;
}
