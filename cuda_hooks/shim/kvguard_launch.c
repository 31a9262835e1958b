// The launch witness: every kernel launch and graph launch of the process, attention kernels
// told apart by their names, each judged against the guard's step word (record.h: an
// attention launch is guarded while a check of the guard opened a step no end has closed).
//
// Per launch: one relaxed atomic add; per kernel function, once: its name read from the
// driver and matched against the ruleset's attention patterns (cached by function, again
// when the patterns change). Per attention launch: two loads of the step word, a capture
// check, counters. A record goes to the agent when the guard's steps moved since the last
// one (the first attention launch of a step, or kvguard_launches_flush from the guard) or at
// once on the first unguarded launch since the last record: a send, never a wait.
// Graphs are kvguard_graph.c's; their launches are judged here as one launch each.
//
// Invariants: a launch is counted once (a runtime launch's driver call under it is not
// counted again); the wrapper's result is the real call's; a kernel the shim cannot name is
// counted as unnamed, never guessed to be attention or not.

#include "shim.h"
#include "record.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <fnmatch.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

__thread __attribute__((tls_model("initial-exec"))) int kvguard_in_runtime;

// For cuda_hooks/shim.py and steps.py to check that they use the same layouts.
const size_t kvguard_launch_record_size = sizeof(struct kvguard_launch_record);
const size_t kvguard_memory_record_size = sizeof(struct kvguard_memory_record);
const size_t kvguard_steps_size = sizeof(struct kvguard_steps);

// ------------------------------------------------------------------ the guard's step word

static struct kvguard_steps *_Atomic steps_word;
static pthread_mutex_t steps_lock = PTHREAD_MUTEX_INITIALIZER;
static _Atomic int steps_tried;

// Map the step word at `path` (the guard calls this in its own process; other processes of
// the engine find the path in $KVGUARD_STEPS). 0 when mapped.
int kvguard_steps_attach(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    struct stat st;
    void *map = MAP_FAILED;
    if (fstat(fd, &st) == 0 && (size_t)st.st_size >= sizeof(struct kvguard_steps))
        map = mmap(NULL, sizeof(struct kvguard_steps), PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED)
        return -1;
    struct kvguard_steps *word = map;
    if (word->magic != KVGUARD_STEPS_MAGIC || word->version != KVGUARD_STEPS_VERSION) {
        munmap(map, sizeof(struct kvguard_steps));
        return -1;
    }
    pthread_mutex_lock(&steps_lock);
    struct kvguard_steps *old = atomic_exchange(&steps_word, word);
    pthread_mutex_unlock(&steps_lock);
    if (old)
        munmap(old, sizeof(struct kvguard_steps));  // a new guard in this process: its word now
    return 0;
}

struct kvguard_steps *kvguard_steps_word(void) {
    struct kvguard_steps *word = atomic_load_explicit(&steps_word, memory_order_acquire);
    if (word || atomic_load_explicit(&steps_tried, memory_order_relaxed))
        return word;
    atomic_store(&steps_tried, 1);  // $KVGUARD_STEPS is read once; a guard may attach later
    const char *path = getenv("KVGUARD_STEPS");
    if (path && *path)
        kvguard_steps_attach(path);
    return atomic_load(&steps_word);
}

static inline uint64_t word_load(const uint64_t *at) { return __atomic_load_n(at, __ATOMIC_ACQUIRE); }

// ------------------------------------------------------------------ attention patterns

static char patterns[KVGUARD_PATTERNS_BYTES];
static uint32_t patterns_len;
static _Atomic uint64_t patterns_gen = 1;  // the word's generation they were copied from, +1 (1: none)
static pthread_mutex_t patterns_lock = PTHREAD_MUTEX_INITIALIZER;

// The patterns' generation, copied from the step word if it changed (a seqlock read).
static uint64_t current_patterns(struct kvguard_steps *word) {
    uint64_t have = atomic_load_explicit(&patterns_gen, memory_order_acquire);
    if (!word)
        return have;
    uint64_t gen = word_load(&word->generation);
    if (gen + 1 == have || (gen & 1))
        return have;
    pthread_mutex_lock(&patterns_lock);
    uint32_t len = __atomic_load_n(&word->patterns_len, __ATOMIC_ACQUIRE);
    if (len > KVGUARD_PATTERNS_BYTES)
        len = 0;
    memcpy(patterns, word->patterns, len);
    if (word_load(&word->generation) == gen) {
        patterns_len = len;
        if (len)
            patterns[len - 1] = 0;
        atomic_store_explicit(&patterns_gen, gen + 1, memory_order_release);
        have = gen + 1;
    }
    pthread_mutex_unlock(&patterns_lock);
    return have;
}

static int matches(const char *name) {
    int hit = 0;
    pthread_mutex_lock(&patterns_lock);
    for (uint32_t at = 0; at < patterns_len && !hit; at += (uint32_t)strlen(patterns + at) + 1)
        hit = patterns[at] && fnmatch(patterns + at, name, 0) == 0;
    pthread_mutex_unlock(&patterns_lock);
    return hit;
}

// ------------------------------------------------------------------ kernel names

#define NAMED KVGUARD_NAMED
#define ATTENTION KVGUARD_ATTENTION
#define RUNTIME_KEY ((uintptr_t)1 << 63)  // a runtime host stub, not a driver function
#define CLASSES 4096

struct kernel_class {
    _Atomic uintptr_t key;
    _Atomic uint64_t gen;  // patterns_gen it was judged under
    _Atomic int flags;
    char name[KVGUARD_KERNEL_NAME];
};
static struct kernel_class classes[CLASSES];
static pthread_mutex_t classes_lock = PTHREAD_MUTEX_INITIALIZER;

typedef cuda_status (*name_fn)(const char **, const void *);

static void *driver_symbol(const char *name) { return kvguard_resolve(name, DRIVER); }

static const char *name_of(uintptr_t key) {
    const char *name = NULL;
    if (key & RUNTIME_KEY) {
        static name_fn get;
        if (!get)
            get = (name_fn)kvguard_resolve("cudaFuncGetName", RUNTIME);
        if (!get || get(&name, (const void *)(key & ~RUNTIME_KEY)) != 0)
            name = NULL;
        return name;
    }
    static name_fn func_name, kernel_name;  // CUfunction, and CUkernel (a graph node may hold one)
    if (!func_name)
        func_name = (name_fn)driver_symbol("cuFuncGetName");
    if (!kernel_name)
        kernel_name = (name_fn)driver_symbol("cuKernelGetName");
    if (func_name && func_name(&name, (const void *)key) == 0 && name)
        return name;
    if (kernel_name && kernel_name(&name, (const void *)key) == 0 && name)
        return name;
    return NULL;
}

static inline size_t slot_of(uintptr_t key) { return (size_t)((key * 0x9E3779B97F4A7C15ull) >> 52) & (CLASSES - 1); }

// The class of a kernel (NAMED, ATTENTION), judged once per function and patterns; `name`
// (when not NULL) is pointed at the cached name.
int kvguard_classify(uintptr_t key, const char **name) {
    struct kvguard_steps *word = kvguard_steps_word();
    uint64_t gen = current_patterns(word);
    size_t at = slot_of(key);
    for (int probe = 0; probe < 16; probe++, at = (at + 1) & (CLASSES - 1)) {
        uintptr_t held = atomic_load_explicit(&classes[at].key, memory_order_acquire);
        if (held == key && atomic_load_explicit(&classes[at].gen, memory_order_acquire) == gen) {
            if (name)
                *name = classes[at].name;
            return atomic_load_explicit(&classes[at].flags, memory_order_relaxed);
        }
        if (!held || held == key)
            break;
    }
    // First sight (or new patterns): named and judged, then cached where there is room.
    const char *found = name_of(key);
    int flags = found ? NAMED | (matches(found) ? ATTENTION : 0) : 0;
    pthread_mutex_lock(&classes_lock);
    at = slot_of(key);
    for (int probe = 0; probe < 16; probe++, at = (at + 1) & (CLASSES - 1)) {
        uintptr_t held = atomic_load_explicit(&classes[at].key, memory_order_relaxed);
        if (held && held != key)
            continue;
        atomic_store_explicit(&classes[at].gen, 0, memory_order_release);  // readers miss while it changes
        strncpy(classes[at].name, found ? found : "", KVGUARD_KERNEL_NAME - 1);
        atomic_store_explicit(&classes[at].flags, flags, memory_order_relaxed);
        atomic_store_explicit(&classes[at].key, key, memory_order_release);
        atomic_store_explicit(&classes[at].gen, gen, memory_order_release);
        if (name)
            *name = classes[at].name;
        pthread_mutex_unlock(&classes_lock);
        return flags;
    }
    pthread_mutex_unlock(&classes_lock);
    static __thread char spare[KVGUARD_KERNEL_NAME];  // the table is full: named each time
    strncpy(spare, found ? found : "", KVGUARD_KERNEL_NAME - 1);
    if (name)
        *name = spare;
    return flags;
}

// ------------------------------------------------------------------ counting and records

static struct {
    _Atomic uint64_t launches, graphs, attention, checked, unguarded, captured, unjudged, unnamed;
    _Atomic uint64_t kernel_steps;
    _Atomic uint64_t attention_seen;  // the guard's steps at the last attention kernel seen (+1; 0: none)
    _Atomic int kernel_graph;  // that launch was a graph's
    _Atomic uint64_t sent_steps;  // the guard's steps at the last record (+1; 0: none sent)
    _Atomic int first_unguarded;  // an unguarded launch is waiting in `kernel`
    char kernel[KVGUARD_KERNEL_NAME];
} counts;
static pthread_mutex_t flush_lock = PTHREAD_MUTEX_INITIALIZER;
static uint64_t quiet_sent;  // the guard's steps at the last record sent with nothing in it (flush_lock)

static inline void attention_seen(uint64_t steps) {
    atomic_store_explicit(&counts.attention_seen, steps + 1, memory_order_relaxed);
}

// Send what was counted since the last record (skipped when another thread is sending).
int kvguard_launches_flush(void) {
    if (pthread_mutex_trylock(&flush_lock) != 0)
        return -1;
    struct kvguard_steps *word = kvguard_steps_word();
    struct kvguard_launch_record r = {
        .magic = KVGUARD_LAUNCH_MAGIC,
        .version = KVGUARD_LAUNCH_VERSION,
        .pid = (uint32_t)getpid(),
        .flags = word ? KVGUARD_STEPS_SEEN : 0,
    };
    r.checks = word ? word_load(&word->checks) : 0;
    r.steps = word ? word_load(&word->steps) : 0;
    atomic_store(&counts.sent_steps, r.steps + 1);
    r.launches = atomic_exchange(&counts.launches, 0);
    r.graphs = atomic_exchange(&counts.graphs, 0);
    r.attention = atomic_exchange(&counts.attention, 0);
    r.checked = atomic_exchange(&counts.checked, 0);
    r.unguarded = atomic_exchange(&counts.unguarded, 0);
    r.captured = atomic_exchange(&counts.captured, 0);
    r.unjudged = atomic_exchange(&counts.unjudged, 0);
    r.unnamed = atomic_exchange(&counts.unnamed, 0);
    r.unwrapped = atomic_load(&kvguard_unwrapped);
    if (atomic_load(&counts.first_unguarded) == 1) {  // 2: being written, so the next record's
        memcpy(r.kernel, counts.kernel, sizeof(r.kernel));
        r.kernel[sizeof(r.kernel) - 1] = 0;
        r.kernel_steps = atomic_load(&counts.kernel_steps);
        if (atomic_load(&counts.kernel_graph))
            r.flags |= KVGUARD_UNGUARDED_GRAPH;
        atomic_store(&counts.first_unguarded, 0);
    }
    r.dropped = kvguard_dropped();
    uint64_t seen = atomic_load(&counts.attention_seen);
    r.quiet_steps = seen ? r.steps - (seen - 1) : r.steps;
    int sent = 0;
    if (r.launches || r.attention || r.unguarded || r.captured || r.unjudged) {
        sent = kvguard_send(&r, sizeof(r));
    } else if (word && r.quiet_steps >= KVGUARD_QUIET_STEPS && r.steps >= quiet_sent + KVGUARD_QUIET_STEPS) {
        quiet_sent = r.steps;  // nothing seen for a while: said, once every so many steps
        sent = kvguard_send(&r, sizeof(r));
    }
    pthread_mutex_unlock(&flush_lock);
    return sent;
}

// One attention launch (or a graph launch holding attention) that ran: judged by the word.
void kvguard_judge(const char *name, int graph) {
    struct kvguard_steps *word = kvguard_steps_word();
    uint64_t ends = word ? word_load(&word->ends) : 0, checks = word ? word_load(&word->checks) : 0;
    uint64_t steps = word ? word_load(&word->steps) : 0;
    attention_seen(steps);
    if (!checks && !steps) {  // no guard, or one that has not begun serving: the engine's warm-up
        atomic_fetch_add_explicit(&counts.unjudged, 1, memory_order_relaxed);
        return;
    }
    atomic_fetch_add_explicit(&counts.attention, 1, memory_order_relaxed);
    int now = 0;
    if (checks > ends) {
        atomic_fetch_add_explicit(&counts.checked, 1, memory_order_relaxed);
    } else {
        atomic_fetch_add_explicit(&counts.unguarded, 1, memory_order_relaxed);
        int none = 0;
        if (atomic_compare_exchange_strong(&counts.first_unguarded, &none, 2)) {
            strncpy(counts.kernel, name, sizeof(counts.kernel) - 1);
            atomic_store(&counts.kernel_steps, steps);
            atomic_store(&counts.kernel_graph, graph);
            atomic_store(&counts.first_unguarded, 1);
            now = 1;  // said at once, not at the step's end
        }
    }
    uint64_t sent = atomic_load_explicit(&counts.sent_steps, memory_order_relaxed);
    if (!sent)  // the first judged launch: its step is where records start from
        atomic_compare_exchange_strong(&counts.sent_steps, &sent, steps + 1);
    else if (sent != steps + 1)
        now = 1;
    if (now)
        kvguard_launches_flush();
}

uint64_t kvguard_patterns_generation(void) { return current_patterns(kvguard_steps_word()); }

void kvguard_count_graph_launch(int known) {
    atomic_fetch_add_explicit(&counts.launches, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&counts.graphs, 1, memory_order_relaxed);
    if (!known)  // instantiated before the shim could see it, or by a path it does not wrap
        atomic_fetch_add_explicit(&counts.unnamed, 1, memory_order_relaxed);
}

typedef cuda_status (*capturing_fn)(void *, int *);

// Whether `stream` is being captured into a graph: its launches are recorded, not run.
static int capturing(void *stream, int runtime) {
    static capturing_fn driver, via_runtime;
    capturing_fn fn = runtime ? via_runtime : driver;
    if (!fn) {
        fn = runtime ? (capturing_fn)kvguard_resolve("cudaStreamIsCapturing", RUNTIME)
                     : (capturing_fn)driver_symbol("cuStreamIsCapturing");
        if (!fn)
            return 0;
        if (runtime)
            via_runtime = fn;
        else
            driver = fn;
    }
    int status = 0;  // CU_STREAM_CAPTURE_STATUS_NONE, cudaStreamCaptureStatusNone
    return fn(stream, &status) == 0 && status != 0;
}

static inline void launched(uintptr_t key, void *stream, int runtime) {
    atomic_fetch_add_explicit(&counts.launches, 1, memory_order_relaxed);
    const char *name = NULL;
    int flags = kvguard_classify(key, &name);
    if (!(flags & NAMED)) {
        atomic_fetch_add_explicit(&counts.unnamed, 1, memory_order_relaxed);
        return;
    }
    if (!(flags & ATTENTION))
        return;
    if (capturing(stream, runtime)) {
        struct kvguard_steps *word = kvguard_steps_word();
        attention_seen(word ? word_load(&word->steps) : 0);
        atomic_fetch_add_explicit(&counts.captured, 1, memory_order_relaxed);
        return;
    }
    kvguard_judge(name, 0);
}

// ------------------------------------------------------------------ the driver's entry points

typedef void *CUfunction;
typedef void *CUstream;
typedef struct {
    unsigned grid[3], block[3], shared;
    CUstream stream;
    void *attrs;
    unsigned attr_count;
} launch_config;

typedef cuda_status (*launch_fn)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                 unsigned, CUstream, void **, void **);
FAMILY(kvguard_launch, cuda_status,
       (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared,
        CUstream stream, void **params, void **extra),
       (f, gx, gy, gz, bx, by, bz, shared, stream, params, extra))
static cuda_status kvguard_launch_impl(void *real, CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                                       unsigned by, unsigned bz, unsigned shared, CUstream stream, void **params,
                                       void **extra) {
    if (!real)
        return UNRESOLVED;
    cuda_status status = ((launch_fn)real)(f, gx, gy, gz, bx, by, bz, shared, stream, params, extra);
    if (status == 0 && !kvguard_in_runtime)
        launched((uintptr_t)f, stream, 0);
    return status;
}
#define LAUNCH_PARAMS                                                                                       \
    (CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shared, \
     CUstream stream, void **params, void **extra)
#define LAUNCH_ARGS (f, gx, gy, gz, bx, by, bz, shared, stream, params, extra)
EXPORT(kvguard_launch, cuLaunchKernel, DRIVER, cuda_status, LAUNCH_PARAMS, LAUNCH_ARGS)
EXPORT(kvguard_launch, cuLaunchKernel_ptsz, DRIVER, cuda_status, LAUNCH_PARAMS, LAUNCH_ARGS)

typedef cuda_status (*launch_ex_fn)(const launch_config *, CUfunction, void **, void **);
FAMILY(kvguard_launch_ex, cuda_status, (const launch_config *config, CUfunction f, void **params, void **extra),
       (config, f, params, extra))
static cuda_status kvguard_launch_ex_impl(void *real, const launch_config *config, CUfunction f, void **params,
                                          void **extra) {
    if (!real)
        return UNRESOLVED;
    cuda_status status = ((launch_ex_fn)real)(config, f, params, extra);
    if (status == 0 && !kvguard_in_runtime)
        launched((uintptr_t)f, config ? config->stream : NULL, 0);
    return status;
}
EXPORT(kvguard_launch_ex, cuLaunchKernelEx, DRIVER, cuda_status,
       (const launch_config *config, CUfunction f, void **params, void **extra), (config, f, params, extra))
EXPORT(kvguard_launch_ex, cuLaunchKernelEx_ptsz, DRIVER, cuda_status,
       (const launch_config *config, CUfunction f, void **params, void **extra), (config, f, params, extra))

// ------------------------------------------------------------------ the runtime's entry points
// Exported only (the runtime is found by name); the driver calls the runtime makes under one
// are not counted again (kvguard_in_runtime). Its kernels are host stubs, named by the runtime.

typedef struct {
    unsigned x, y, z;
} dim3;

cuda_status cudaLaunchKernel(const void *func, dim3 grid, dim3 block, void **args, size_t shared, void *stream) {
    static __typeof__(&cudaLaunchKernel) real;
    if (!real && !(real = (__typeof__(&cudaLaunchKernel))kvguard_resolve("cudaLaunchKernel", RUNTIME)))
        return UNRESOLVED;
    kvguard_in_runtime++;
    cuda_status status = real(func, grid, block, args, shared, stream);
    kvguard_in_runtime--;
    if (status == 0 && !kvguard_in_runtime)
        launched((uintptr_t)func | RUNTIME_KEY, stream, 1);
    return status;
}

__attribute__((destructor)) static void last_record(void) { kvguard_launches_flush(); }
