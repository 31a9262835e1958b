// The record the kvguard shim sends to the node agent when a named transfer ends: fixed size,
// native byte order (both ends are on one host). cuda_hooks/shim.py reads it with the same
// layout (SHIM_RECORD); a test checks that the two agree.
#pragma once
#include <stdint.h>

#define KVGUARD_SHIM_MAGIC 0x5347564bu  // "KVGS"
#define KVGUARD_SHIM_VERSION 1

// Copy kinds: cudaMemcpyKind's values; the driver's typed calls map onto them.
enum { KVGUARD_H2H = 0, KVGUARD_H2D = 1, KVGUARD_D2H = 2, KVGUARD_D2D = 3, KVGUARD_DEFAULT = 4, KVGUARD_KINDS = 8 };

struct kvguard_shim_record {
    uint32_t magic;
    uint16_t version;
    uint16_t reserved;
    uint32_t pid;
    int32_t last_error;       // the last failed call's status (0: none failed)
    char xfer[128];           // the transfer's name, NUL-terminated
    uint64_t bytes[KVGUARD_KINDS];  // bytes copied by calls that succeeded, by kind
    uint64_t calls;           // copy calls made while the transfer was named
    uint64_t failed;          // of which returned an error
    uint64_t failed_bytes;    // the bytes those asked for
    uint64_t dropped;         // records this process could not send before this one
};

// ------------------------------------------------------------------ the launch witness
// Sent when the guard's step advanced since the last one (or at once, on the first unguarded
// attention launch since the last one): what the process launched in between.
#define KVGUARD_LAUNCH_MAGIC 0x4c47564bu  // "KVGL"
#define KVGUARD_LAUNCH_VERSION 1
#define KVGUARD_KERNEL_NAME 192

struct kvguard_launch_record {
    uint32_t magic;
    uint16_t version;
    uint16_t reserved;
    uint32_t pid;
    uint32_t flags;           // KVGUARD_STEPS_SEEN, KVGUARD_UNGUARDED_GRAPH
    uint64_t launches;        // kernel and graph launches since the last record
    uint64_t graphs;          // of which graph launches
    uint64_t attention;       // attention launches judged (a graph launch holding one counts once)
    uint64_t checked;         // of which an open, checked step of the guard preceded
    uint64_t unguarded;       // of which none did
    uint64_t captured;        // attention launches recorded into a graph under capture (not run)
    uint64_t unjudged;        // attention launches before the guard's first check or step end
    uint64_t unnamed;         // launches whose kernel name could not be read
    uint64_t unwrapped;       // entry points handed out unwrapped so far (no slot left): blind spots
    uint64_t checks;          // the guard's checks and steps when this record was sent
    uint64_t steps;
    uint64_t kernel_steps;    // the guard's steps at the first unguarded launch
    uint64_t quiet_steps;     // steps ended since the last attention kernel this process saw (all: none)
    uint64_t dropped;         // records this process could not send before this one
    char kernel[KVGUARD_KERNEL_NAME];  // the first unguarded attention kernel's name
};
#define KVGUARD_STEPS_SEEN 1u
#define KVGUARD_UNGUARDED_GRAPH 2u  // the first unguarded launch was a graph launch
// A process that launches nothing the witness judges still reports, every this many steps, so
// that a witness blind to an engine's kernels says so (quiet_steps) instead of staying silent.
#define KVGUARD_QUIET_STEPS 8

// ------------------------------------------------------------------ the allocation witness
// Sent when a guard binds a pool's memory (kind bound) and when a call frees or unmaps a part
// of a bound region (freed, unmapped: the region is then forgotten).
#define KVGUARD_MEMORY_MAGIC 0x4d47564bu  // "KVGM"
#define KVGUARD_MEMORY_VERSION 1
enum { KVGUARD_BOUND = 1, KVGUARD_FREED = 2, KVGUARD_UNMAPPED = 3 };

struct kvguard_memory_record {
    uint32_t magic;
    uint16_t version;
    uint16_t reserved;
    uint32_t pid;
    uint32_t pool;
    uint32_t kind;
    uint32_t reserved2;
    uint64_t base;            // the region as the guard bound it
    uint64_t bytes;
    uint64_t covered;         // bound: the bytes of it that allocations the shim saw hold
    uint64_t lo;              // freed, unmapped: the part of the region the call let go
    uint64_t hi;
    uint64_t allocations;     // allocation and map calls the shim has seen in this process
    uint64_t steps;           // the guard's steps then
    uint64_t dropped;
    char call[32];            // the CUDA call that allocated (bound) or let go of it
};

// ------------------------------------------------------------------ the guard's step word
// A small file the guard maps (cuda_hooks/steps.py) and the shim maps read-only, in the
// guard's process or its workers ($KVGUARD_STEPS): read on each attention launch, no call.
// An attention launch is guarded while checks > ends: a check opened a step no end closed.
#define KVGUARD_STEPS_MAGIC 0x5453564bu  // "KVST"
#define KVGUARD_STEPS_VERSION 1
#define KVGUARD_PATTERNS_BYTES 8192

struct kvguard_steps {
    uint32_t magic;
    uint16_t version;
    uint16_t reserved;
    uint64_t checks;          // the guard's checks so far
    uint64_t ends;            // `checks` as it was at the last step's end
    uint64_t steps;           // steps ended so far
    uint64_t generation;      // odd while `patterns` is being written; changes with them
    uint32_t patterns_len;
    uint32_t reserved2;
    char patterns[KVGUARD_PATTERNS_BYTES];  // attention kernel name patterns (fnmatch), NUL-separated
};
