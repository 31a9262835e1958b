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
